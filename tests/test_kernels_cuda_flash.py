"""The ``cuda_flash`` backend's CPU-side logic against a fake of PyTorch's FlashAttention-2 ops
(``aten._flash_attention_forward`` / ``_backward``, tests/fake_flash_attn.py's ``ATEN``): the layout it
hands them (no transposes, GQA without repeated kv heads), the window only where a band asks for one,
the varlen form of document tiles and its lse, the empty-row lse, and the rng placeholders made once.

The fake computes in fp64 with the kernels' conventions; inputs are fp32, compared with the fp64 reference
at 1e-4 (the fp32 casts and surrogate ``out`` cost ~1e-6; a wrong window, layout or lse is off by O(1)).
The real kernels are checked in tests/test_cuda_path.py on a GPU machine.
"""
from __future__ import annotations

import pytest
import torch

from burst_impl.kernels import TileMask, compute_delta, reference
from burst_impl.kernels import cuda_flash as CF
from burst_impl.kernels.flash_tiles import flash_window
from tests import fake_flash_attn as fake
from tests.refs import attention_reference, make_inputs, max_err

TOL = 1e-4


@pytest.fixture(autouse=True)
def aten(monkeypatch):
    monkeypatch.setattr(CF, "_aten", lambda: fake.ATEN)
    fake.CALLS.clear()


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (4, 1)], ids=["mha", "gqa", "mqa"])
def test_dense_forward_backward(causal, heads):
    q, k, v, do = make_inputs(2, 24, *heads, 16)
    q = q.transpose(1, 2).contiguous().transpose(1, 2)       # unit-stride last dim, not contiguous
    scale = 0.3
    out, lse = CF.forward(q, k, v, causal, scale)
    dq, dk, dv = CF.backward(do, q, k, v, lse, compute_delta(do, out), causal, scale)
    ref = attention_reference(q, k, v, do, causal, softmax_scale=scale)
    got = dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv)
    for name in ref:
        assert got[name].shape == ref[name].shape, name
        assert max_err(got[name], ref[name]) < TOL, name
    fwd, bwd = fake.CALLS
    assert fwd["ptrs"] == [q.data_ptr(), k.data_ptr(), v.data_ptr()], "q, k or v was copied or its heads repeated"
    assert not fwd["windowed"], "an unbounded call passes no window (the call SDPA makes)"


def test_rng_placeholders_are_made_once_per_device():
    q, k, v, do = make_inputs(1, 8, 2, 2, 8)
    out, lse = CF.forward(q, k, v, False, 0.3)
    for _ in range(2):
        CF.backward(do, q, k, v, lse, compute_delta(do, out), False, 0.3)
    assert len({c["rng"] for c in fake.CALLS if c["name"] == "aten_bwd"}) == 1


# (n_rows, n_cols, lo, hi): square, tall and wide bands, one sided, a tall band with rows without a key,
# and a tall band open on the right (not expressible: the exact path)
BANDS = [(16, 16, -4, 0), (16, 16, -3, None), (20, 8, -15, -12), (12, 4, -9, -8), (8, 20, None, 12),
         (20, 8, -9, None)]


@pytest.mark.parametrize("band", BANDS, ids=[str(b) for b in BANDS])
def test_band_tiles(band):
    n_rows, n_cols, lo, hi = band
    g = torch.Generator().manual_seed(n_rows * 100 + n_cols)
    q, do = (torch.randn(1, n_rows, 2, 8, generator=g) for _ in range(2))
    k, v = (torch.randn(1, n_cols, 1, 8, generator=g) for _ in range(2))
    tm, scale = TileMask("band", n_rows, n_cols, lo=lo, hi=hi), 0.35
    out, lse = CF.masked_forward(q, k, v, tm, scale)
    r_out, r_lse = reference.masked_forward(q, k, v, tm, scale)
    assert max_err(out, r_out) < TOL
    assert torch.equal(torch.isneginf(lse), torch.isneginf(r_lse)), "a row with no live key must have lse -inf"
    assert max_err(lse.masked_fill(lse.isinf(), 0), r_lse.masked_fill(r_lse.isinf(), 0)) < TOL
    delta = compute_delta(do, r_out)
    for g_, w in zip(CF.masked_backward(do, q, k, v, r_lse.float(), delta, tm, scale),
                     reference.masked_backward(do, q, k, v, r_lse, delta, tm, scale)):
        assert torch.isfinite(g_).all() and max_err(g_, w) < TOL
    window = flash_window(*band)
    assert [c["window"] for c in fake.CALLS] == ([window] * 2 if window is not None else [])


@pytest.mark.parametrize("kind", ["varlen", "varlen_full"])
@pytest.mark.parametrize("heads", [(2, 2), (4, 1)], ids=["mha", "mqa"])
def test_document_tiles_in_the_varlen_form(kind, heads):
    q, k, v, do = make_inputs(2, 11, *heads, 8)
    tm, scale = TileMask(kind, 11, 11, cu=(0, 3, 4, 11)), 0.3
    out, lse = CF.masked_forward(q, k, v, tm, scale)
    r_out, r_lse = reference.masked_forward(q, k, v, tm, scale)
    assert out.shape == q.shape and lse.shape == r_lse.shape
    assert max_err(out, r_out) < TOL and max_err(lse, r_lse) < TOL
    delta = compute_delta(do, r_out)
    got = CF.masked_backward(do, q, k, v, r_lse.float(), delta, tm, scale)
    for g_, w in zip(got, reference.masked_backward(do, q, k, v, r_lse, delta, tm, scale)):
        assert g_.shape == w.shape and max_err(g_, w) < TOL
    assert len({c["cu"] for c in fake.CALLS}) == 1, "the boundaries were rebuilt (a host copy per tile)"


def test_a_dense_tile_runs_in_the_exact_path():
    q, k, v, _ = make_inputs(1, 6, 2, 1, 8)
    live = torch.rand(6, 6, generator=torch.Generator().manual_seed(0)) > 0.3
    tm = TileMask("dense", 6, 6, rows_fn=lambda a, b: live[a:b])
    out, lse = CF.masked_forward(q, k, v, tm, 0.3)
    r_out, r_lse = reference.masked_forward(q, k, v, tm, 0.3)
    assert max_err(out, r_out) < TOL and not fake.CALLS


def test_an_unknown_varlen_lse_layout_is_a_clear_error(monkeypatch):
    def padded(*args, **kwargs):           # FlashAttention-2 before 2.4: (documents, Z, longest)
        out, lse, *rest = fake._aten_fwd(*args, **kwargs)
        return (out, lse.reshape(1, *lse.shape), *rest)

    monkeypatch.setattr(CF, "_aten", lambda: type(fake.ATEN)(_flash_attention_forward=padded))
    q, k, v, _ = make_inputs(1, 6, 2, 2, 8)
    with pytest.raises(RuntimeError, match=r"lse of shape \(1, 2, 6\)"):
        CF.masked_forward(q, k, v, TileMask("varlen", 6, 6, cu=(0, 2, 6)), 0.3)
