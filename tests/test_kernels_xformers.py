"""The ``xformers`` backend's CPU-side logic, with fakes of the two xformers functions it calls.

The fakes behave as the documented API does (BMHK layout, equal query and kv
heads, lse padded to a multiple of 32 rows by the forward and accepted with
S or more rows by the backward, delta formed from ``output``) and compute in
fp64 with the reference math, so these tests check OUR side: the layout and
argument mapping, lse slicing, GQA expand/fold, the surrogate ``out``, the
global-lse block backward, the probe that rejects a backward ignoring lse,
availability and the automatic order. The real kernels are checked against
the fp64 reference in tests/test_cuda_path.py (GPU machines only).
"""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from burst_impl import kernels as K
from burst_impl.attention import merge_partial
from burst_impl.kernels import reference
from burst_impl.kernels import xformers as X
from tests.refs import attention_reference, make_inputs, max_err


class _LowerTriangularMask:
    pass


class FakeFmha:
    """``xformers.ops.fmha`` as far as the backend uses it; ``honour_lse=False`` mimics the SDPA
    fallback of xformers >= 0.0.36 without mslk (its backward recomputes the softmax)."""

    class attn_bias:
        LowerTriangularMask = _LowerTriangularMask

    def __init__(self, honour_lse: bool = True):
        self.honour_lse = honour_lse
        self.calls: list[tuple] = []

    @staticmethod
    def _check(q, k, v):
        assert q.dim() == k.dim() == v.dim() == 4, "BMHK"
        assert q.shape[2] == k.shape[2] == v.shape[2], "BMHK takes equal query and kv heads"
        assert all(t.stride(-1) == 1 for t in (q, k, v)), "unit-stride last dim"

    def memory_efficient_attention_forward_requires_grad(self, q, k, v, attn_bias=None, p=0.0, scale=None):
        self._check(q, k, v)
        assert p == 0.0
        causal = isinstance(attn_bias, _LowerTriangularMask)
        self.calls.append(("forward", causal, scale, tuple(k.shape)))
        out, lse = reference.forward(q, k, v, causal, scale)
        pad = (-lse.shape[-1]) % 32            # cutlass pads the rows to a multiple of 32
        return out, torch.nn.functional.pad(lse.float(), (0, pad), value=math.inf)

    def memory_efficient_attention_backward(self, grad, output, lse, q, k, v, attn_bias=None, p=0.0, scale=None):
        self._check(q, k, v)
        s = q.shape[1]
        assert lse.dim() == 3 and lse.shape[:2] == (q.shape[0], q.shape[2]) and lse.shape[2] >= s
        causal = isinstance(attn_bias, _LowerTriangularMask)
        self.calls.append(("backward", causal, scale, tuple(k.shape)))
        delta = (grad.float() * output.float()).sum(-1).transpose(1, 2)   # what a stock kernel does
        lse = lse[:, :, :s]
        if not self.honour_lse:
            lse = reference.forward(q, k, v, causal, scale)[1]
        return reference.backward(grad, q, k, v, lse, delta, causal, scale)


@pytest.fixture
def fake(monkeypatch):
    f = FakeFmha()
    monkeypatch.setattr(X, "_fmha", lambda: f)
    X.available.cache_clear()
    yield f
    X.available.cache_clear()


def _run(q, k, v, do, causal, scale):
    out, lse = X.forward(q, k, v, causal, scale)
    dq, dk, dv = X.backward(do, q, k, v, lse, K.compute_delta(do, out), causal, scale)
    return dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (4, 1)])
def test_argument_mapping_matches_reference(fake, causal, heads):
    # 40 rows: not a multiple of 32, so the forward's padded lse must be cut back to (B, Z, 40)
    q, k, v, do = make_inputs(2, 40, *heads, 16, torch.float32)
    scale = 0.3
    got = _run(q, k, v, do, causal, scale)
    ref = attention_reference(q, k, v, do, causal, softmax_scale=scale)
    assert got["lse"].shape == (2, heads[0], 40) and got["lse"].dtype == torch.float32
    assert got["dk"].shape == k.shape and got["dv"].shape == v.shape     # kv-head gradients folded back
    for name in ref:
        # fp64 math inside the fake; the fp32 surrogate out and casts cost ~1e-6
        assert max_err(got[name], ref[name]) < 1e-4, name
    assert {c[1] for c in fake.calls} == {causal} and {c[2] for c in fake.calls} == {scale}
    assert all(c[3][2] == heads[0] for c in fake.calls), "kv heads expanded to the query heads"


def test_block_backward_uses_the_global_lse(fake):
    """Two key/value blocks of one query block: the block forwards merge to the full attention and the
    block backwards with the merged (global) lse and delta sum to the full gradients."""
    q, k, v, do = make_inputs(1, 48, 4, 2, 16, torch.float32)
    scale = 0.25
    kb, vb = k.split(24, dim=1), v.split(24, dim=1)
    parts = [X.forward(q, kj, vj, False, scale) for kj, vj in zip(kb, vb)]
    out, lse = parts[0][0].float().clone(), parts[0][1].clone()
    merge_partial(out, lse, *parts[1])
    ref = attention_reference(q, k, v, do, False, softmax_scale=scale)
    assert max_err(out, ref["out"]) < 1e-5 and max_err(lse, ref["lse"]) < 1e-5
    delta = K.compute_delta(do, out)
    grads = [X.backward(do, q, kj, vj, lse, delta, False, scale) for kj, vj in zip(kb, vb)]
    assert max_err(grads[0][0] + grads[1][0], ref["dq"]) < 1e-4
    assert max_err(torch.cat([g[1] for g in grads], 1), ref["dk"]) < 1e-4
    assert max_err(torch.cat([g[2] for g in grads], 1), ref["dv"]) < 1e-4


def test_probe_accepts_a_backward_that_uses_lse_and_rejects_one_that_recomputes(fake, monkeypatch):
    assert X.honours_lse("cpu")
    fake.honour_lse = False
    assert not X.honours_lse("cpu")
    # available() runs the probe where a GPU is: let the CPU stand in for one
    monkeypatch.setattr(X, "_probe_device", lambda: torch.device("cpu"))
    X.available.cache_clear()
    assert not X.available()
    assert "ignores the lse" in X.unavailable_reason()
    fake.honour_lse = True
    X.available.cache_clear()
    assert X.available() and X.unavailable_reason() == ""


def test_probe_covers_the_benchmarks_kernel_bf16_d128_causal(fake, monkeypatch):
    """Each (dtype, head dim, bias) may dispatch to another xformers kernel: the probe runs the one the
    benchmark uses too, and a fallback there alone makes the backend unavailable."""
    assert X.honours_lse("cpu", torch.bfloat16, head_dim=128, causal=True)
    assert any(c[:2] == ("backward", True) and c[3][-1] == 128 for c in fake.calls)
    monkeypatch.setattr(X, "_probe_device", lambda: torch.device("cpu"))
    real = fake.memory_efficient_attention_backward

    def recompute_when_causal(grad, output, lse, q, k, v, attn_bias=None, p=0.0, scale=None):
        fake.honour_lse = not isinstance(attn_bias, _LowerTriangularMask)
        return real(grad, output, lse, q, k, v, attn_bias=attn_bias, p=p, scale=scale)

    monkeypatch.setattr(fake, "memory_efficient_attention_backward", recompute_when_causal)
    X.available.cache_clear()
    assert not X.available() and "bfloat16, d = 128, causal" in X.unavailable_reason()


def test_unimportable_xformers_is_unavailable_with_the_reason(monkeypatch):
    def missing():
        raise ModuleNotFoundError("No module named 'xformers'")

    monkeypatch.setattr(X, "_fmha", missing)
    X.available.cache_clear()
    try:
        assert not X.available()
        assert "No module named 'xformers'" in X.unavailable_reason()
        with pytest.raises(ValueError, match="backend='xformers' needs a package"):
            K.check_backend("xformers", torch.device("cuda"), torch.bfloat16, 64)
    finally:
        X.available.cache_clear()


def test_registry_entry_and_checks():
    names = list(K.BACKENDS)
    assert names.index("flash_attn") < names.index("xformers") < names.index("cuda_sdpa")
    b = K.BACKENDS["xformers"]
    assert b.devices == ("cuda",) and torch.float64 not in b.dtypes
    with pytest.raises(ValueError, match="runs on cuda tensors"):
        K.check_backend("xformers", torch.device("cpu"), torch.float32, 64)
    with pytest.raises(ValueError, match="does not take dtype torch.float64"):
        K.check_backend("xformers", torch.device("cuda"), torch.float64, 64)
    assert "multiple of 8" in b.check(12) and b.check(64) is None


def test_every_cuda_backend_states_its_head_dim_rule():
    """One rule (common.head_dim_rule): multiples of 8, up to each kernel's limit, the backend named."""
    limits = {"flash_attn": 256, "cuda_flash": 256, "cuda_cudnn": 128, "xformers": None}
    for name, limit in limits.items():
        check = K.BACKENDS[name].check
        assert f"backend={name!r} needs head_dim a multiple of 8" in check(12) and check(64) is None
        if limit:
            assert check(limit) is None and f"up to {limit}, got {limit + 8}" in check(limit + 8)
        else:
            assert check(512) is None


def _with(monkeypatch, name, ok):
    monkeypatch.setitem(K.BACKENDS, name, dataclasses.replace(K.BACKENDS[name], available=lambda: ok))


@pytest.mark.parametrize("flash,xf,cap,dtype,head_dim,want", [
    (True, True, (9, 0), torch.bfloat16, 64, "flash_attn"),
    (False, True, (9, 0), torch.bfloat16, 64, "xformers"),
    (False, False, (9, 0), torch.bfloat16, 64, "cuda_cudnn"),     # Hopper: cuDNN's fused attention
    (False, False, (9, 0), torch.bfloat16, 256, "cuda_flash"),    # cuDNN's head_dim stops at 128
    (False, False, (8, 0), torch.bfloat16, 64, "cuda_flash"),     # before Hopper: PyTorch's FlashAttention-2
    (False, False, (9, 0), torch.float32, 64, "cuda_sdpa"),       # the only fp32 kernel of torch's
    (True, True, (9, 0), torch.float32, 64, "xformers"),          # flash-attn takes no fp32
    (True, True, (9, 0), torch.float16, 12, "cuda_sdpa"),         # none of the others takes head_dim 12
    (True, True, (9, 0), torch.float64, 64, "reference"),
])
def test_automatic_order_on_cuda(monkeypatch, flash, xf, cap, dtype, head_dim, want):
    _with(monkeypatch, "flash_attn", flash)
    _with(monkeypatch, "xformers", xf)
    _with(monkeypatch, "cuda_cudnn", True)          # a CPU build of torch has no cuDNN to ask
    monkeypatch.setattr(K, "cuda_capability", lambda device: cap)
    assert K.resolve_backend(torch.device("cuda"), None, dtype, head_dim) == want
    assert K.resolve_backend(torch.device("cpu"), None, dtype, head_dim) == "cpu_flash"


@pytest.mark.parametrize("flash,xf,cap,want", [
    (True, True, (9, 0), "flash_attn"),
    (False, False, (9, 0), "cuda_flash"),        # cuDNN has no masked path: its tiles would run in math
    (False, False, (8, 0), "cuda_flash"),
])
def test_automatic_choice_for_a_masked_tile(monkeypatch, flash, xf, cap, want):
    _with(monkeypatch, "flash_attn", flash)
    _with(monkeypatch, "xformers", xf)
    _with(monkeypatch, "cuda_cudnn", True)
    monkeypatch.setattr(K, "cuda_capability", lambda device: cap)
    assert K.resolve_backend(torch.device("cuda"), None, torch.bfloat16, 128, masked=True) == want
    assert K.resolve_backend(torch.device("cuda"), "cuda_cudnn", torch.bfloat16, 128, masked=True) == "cuda_cudnn"


@pytest.mark.parametrize("rows,want", [(1, "cuda_flash"), (K.CUDNN_MIN_ROWS - 1, "cuda_flash"),
                                       (K.CUDNN_MIN_ROWS, "cuda_cudnn"), (None, "cuda_cudnn")])
def test_few_query_rows_skip_cudnn_on_hopper(monkeypatch, rows, want):
    """A decode step's few new tokens go to FlashAttention-2 (measured: K.CUDNN_MIN_ROWS); named, cuDNN runs."""
    _with(monkeypatch, "flash_attn", False)
    _with(monkeypatch, "xformers", False)
    _with(monkeypatch, "cuda_cudnn", True)
    monkeypatch.setattr(K, "cuda_capability", lambda device: (9, 0))
    assert K.resolve_backend(torch.device("cuda"), None, torch.bfloat16, 128, rows=rows) == want
    assert K.resolve_backend(torch.device("cuda"), "cuda_cudnn", torch.bfloat16, 128, rows=1) == "cuda_cudnn"
