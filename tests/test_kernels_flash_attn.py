"""The ``flash_attn`` backend's CPU-side logic against fakes of flash-attn's private interface in each
generation (tests/fake_flash_attn.py: 2.7+'s custom ops, 2.6's and 2.4-2.5's 8-tuple forwards), with
flash-attn's window and empty-row conventions (issue 39, item 1).

The fakes compute in fp64; inputs are fp32 (the fakes take any dtype), so results are compared with
the fp64 reference at 1e-4: the fp32 casts and the fp32 surrogate ``out`` cost ~1e-6, while a wrong
window, lse or argument is off by O(1) or NaN. The real kernels are checked in tests/test_cuda_path.py.
"""
from __future__ import annotations

import inspect
import sys
from types import SimpleNamespace

import pytest
import torch

from burst_impl.attention import merge_partial
from burst_impl.kernels import TileMask, compute_delta, reference
from burst_impl.kernels import flash_attn as FA
from burst_impl.kernels.flash_tiles import flash_window
from tests import fake_flash_attn as fake
from tests.refs import attention_reference, make_inputs, max_err

TOL = 1e-4


@pytest.fixture(params=list(fake.INTERFACES))
def fai(request, monkeypatch):
    interface = fake.INTERFACES[request.param]
    # what ``from flash_attn import flash_attn_interface`` finds
    monkeypatch.setitem(sys.modules, "flash_attn.flash_attn_interface", interface)
    monkeypatch.setitem(sys.modules, "flash_attn", SimpleNamespace(flash_attn_interface=interface))
    fake.CALLS.clear()
    return request.param


def test_custom_op_signature_is_read_through_init_fn():
    op = fake.V27._flash_attn_forward
    assert list(inspect.signature(op).parameters) == ["args", "kwargs"], "what flash-attn 2.7+ exposes"
    assert {"window_size_left", "window_size_right", "softcap"} <= FA._params(op)
    assert FA._window_kwargs(op, 3, 0) == dict(window_size_left=3, window_size_right=0, softcap=0.0)
    assert FA._window_kwargs(fake.V26._flash_attn_forward, 3, 0) == dict(window_size=(3, 0), softcap=0.0)
    assert FA._window_kwargs(fake.V25._flash_attn_forward, 3, 0) == dict(window_size=(3, 0))


@pytest.mark.parametrize("causal", [False, True])
def test_dense_forward_backward_on_every_interface(fai, causal):
    q, k, v, do = make_inputs(2, 24, 4, 2, 16)
    # a unit-stride last dim but not contiguous: flash-attn takes it as it is, so no copy is made
    q = q.transpose(1, 2).contiguous().transpose(1, 2)
    scale = 0.3
    out, lse = FA.forward(q, k, v, causal, scale)
    dq, dk, dv = FA.backward(do, q, k, v, lse, compute_delta(do, out), causal, scale)
    ref = attention_reference(q, k, v, do, causal, softmax_scale=scale)
    got = dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv)
    for name in ref:
        assert max_err(got[name], ref[name]) < TOL, name
    assert fake.CALLS[0]["ptrs"][0] == q.data_ptr(), "q was copied before the kernel"


# (n_rows, n_cols, lo, hi): square, tall (Sq > Sk) and wide tiles; bands open on one side; a tall band
# whose top rows have no live key (flash-attn's lse +inf there)
BANDS = [(16, 16, -4, 0), (16, 16, None, 0), (16, 16, -3, None), (16, 16, -20, 30),
         (20, 8, -15, -12), (20, 8, -9, None), (20, 8, None, -12), (12, 4, -9, -8),
         (8, 20, 0, 12), (8, 20, None, 12), (8, 20, 5, None)]


def _band_case(n_rows, n_cols, lo, hi):
    g = torch.Generator().manual_seed(n_rows * 100 + n_cols)
    q, do = (torch.randn(1, n_rows, 2, 8, generator=g) for _ in range(2))
    k, v = (torch.randn(1, n_cols, 1, 8, generator=g) for _ in range(2))
    return q, k, v, do, TileMask("band", n_rows, n_cols, lo=lo, hi=hi)


@pytest.mark.parametrize("band", BANDS, ids=[str(b) for b in BANDS])
def test_band_tiles_as_flash_attn_defines_its_window(fai, band):
    q, k, v, do, tm = _band_case(*band)
    scale = 0.35
    out, lse = FA.masked_forward(q, k, v, tm, scale)
    r_out, r_lse = reference.masked_forward(q, k, v, tm, scale)
    assert max_err(out, r_out) < TOL
    assert torch.equal(torch.isneginf(lse), torch.isneginf(r_lse)), "a row with no live key must have lse -inf"
    assert max_err(lse.masked_fill(lse.isinf(), 0), r_lse.masked_fill(r_lse.isinf(), 0)) < TOL
    delta = compute_delta(do, r_out)
    got = FA.masked_backward(do, q, k, v, r_lse.float(), delta, tm, scale)
    want = reference.masked_backward(do, q, k, v, r_lse, delta, tm, scale)
    for g_, w in zip(got, want):
        assert torch.isfinite(g_).all() and max_err(g_, w) < TOL
    window = flash_window(*band)
    assert [c["window"] for c in fake.CALLS] == ([window] * 2 if window is not None else [])
    for left, right in [c["window"] for c in fake.CALLS]:
        # both unbounded, or both in [0, Sk): never a value flash-attn resets or reinterprets
        assert (left, right) == (-1, -1) or (0 <= left < band[1] and 0 <= right < band[1])


def test_tall_band_open_on_the_right_is_left_to_the_exact_path():
    # flash-attn would read the missing right side as Sk: rows 0..10 of a 20 x 8 tile would lose keys
    assert flash_window(20, 8, -9, None) is None
    assert flash_window(16, 16, -3, None) == (3, 15)


def test_an_empty_row_merges_as_nothing(fai):
    """Two blocks of one query block, the first leaving rows without a live key: its lse must be -inf
    (the merge's neutral element), not flash-attn's +inf, or the merged row is NaN."""
    q, k, v, do, tm = _band_case(12, 4, -9, -8)
    scale = 0.35
    out, lse = FA.masked_forward(q, k, v, tm, scale)
    k2, v2 = torch.randn(1, 4, 1, 8), torch.randn(1, 4, 1, 8)
    out2, lse2 = FA.forward(q, k2, v2, False, scale)
    acc, acc_lse = out.float().clone(), lse.clone()
    merge_partial(acc, acc_lse, out2, lse2)
    assert torch.isfinite(acc).all() and torch.isfinite(acc_lse).all()


def _varlen_case():
    q, k, v, do = make_inputs(2, 8, 2, 1, 8)
    return q, k, v, do, TileMask("varlen", 8, 8, cu=(0, 3, 8))


def test_varlen_documents_and_device_cached_boundaries(fai):
    q, k, v, do, tm = _varlen_case()
    scale = 0.3
    out, lse = FA.masked_forward(q, k, v, tm, scale)
    r_out, r_lse = reference.masked_forward(q, k, v, tm, scale)
    assert max_err(out, r_out) < TOL and max_err(lse, r_lse) < TOL
    delta = compute_delta(do, r_out)
    for g_, w in zip(FA.masked_backward(do, q, k, v, r_lse.float(), delta, tm, scale),
                     reference.masked_backward(do, q, k, v, r_lse, delta, tm, scale)):
        assert max_err(g_, w) < TOL
    FA.masked_forward(q, k, v, tm, scale)
    cus = {c["cu"] for c in fake.CALLS}
    assert len(fake.CALLS) == 3 and len(cus) == 1, "the boundaries were rebuilt (a host copy per tile)"


def test_an_unknown_forward_result_is_a_clear_error():
    with pytest.raises(RuntimeError, match="returned 5 values"):
        FA._out_lse((1, 2, 3, 4, 5))
