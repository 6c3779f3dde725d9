"""The CUDA kernels against the fp64 reference; skipped on machines without a GPU.

CI has no GPU; these run on GPU machines (``make test`` or ``make gpu-check``
there) and check every CUDA block kernel that is importable (``cuda_sdpa``
always; ``flash_attn`` and ``xformers`` where installed): out, lse, dq, dk, dv
in bf16 and fp16 (and fp32 where the kernel takes it), causal and not, MHA and
GQA, and the use a ring makes of them: blocks of unequal length whose
backward gets the GLOBAL lse and delta (through the surrogate ``out``); and
the ring-flash-attn adapter at world size 1 where that package is installed; the
tiles of window and document masks (``mask=``: flash-attn's and cuda_flash's window and
varlen paths, square and tall band tiles, rows without a live key), and the operator with
those masks on the automatic kernels; xformers' lse probe at the
benchmark's shape (bf16, d = 128, causal).

Error budget, the same as the distributed low-precision tests: twice the
error of plain single-process attention in the same dtype (PyTorch's CPU
flash kernels) plus half an ulp of the dtype at the tensor's scale: a CUDA
kernel may round differently, not worse.
"""
from __future__ import annotations

import math

import pytest
import torch

from burst_impl import burst_attn_func
from burst_impl.attention import merge_partial
from burst_impl.kernels import BACKENDS as _ALL
from burst_impl.kernels import TileMask, attn_backward, attn_forward, compute_delta, default_scale
from tests.refs import attention_reference, make_inputs, max_err

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
CUDA_BACKENDS = [n for n, b in _ALL.items() if b.devices == ("cuda",)]
CASES = [(b, dt) for b in CUDA_BACKENDS for dt in (torch.bfloat16, torch.float16, torch.float32)
         if dt in _ALL[b].dtypes]


def _need(backend: str | None) -> None:
    """Skip, naming the reason, when the backend's package is missing (the GPU check reports it too)."""
    if backend is not None and not _ALL[backend].available():
        from burst_impl.kernels import xformers

        why = xformers.unavailable_reason() if backend == "xformers" else _ALL[backend].requirement
        pytest.skip(f"backend {backend!r} is unavailable here: {why}")


def _budget(plain, ref, dtype, terms: int = 1) -> float:
    """Twice the CPU flash kernel's error, one rounding of the output's dtype, and the fp32 accumulation
    of ``terms`` products in an order of the CUDA kernel's own (blocked sums: up to about log2(terms)
    fp32 roundings, the pairwise-summation bound, relative to the largest entry). That last term is what
    fp32 inputs need (measured on an H200: cuda_sdpa's GQA dK off by 1.57e-6 where the first two gave
    1.40e-6); in bf16/fp16 it is below the output's own rounding."""
    scale = max(ref.abs().max().item(), 1.0)
    accumulate = torch.finfo(torch.float32).eps * math.log2(max(terms, 2)) * scale
    return 2 * max_err(plain, ref) + torch.finfo(dtype).eps / 2 * scale + accumulate


@cuda
@pytest.mark.parametrize("backend,dtype", CASES, ids=[f"{b}-{str(d)[6:]}" for b, d in CASES])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads", [(8, 8), (8, 2)], ids=["mha", "gqa"])
def test_cuda_block_kernels(backend, dtype, causal, heads):
    _need(backend)
    inputs = make_inputs(2, 200, *heads, 64, dtype)      # 200 rows: not a multiple of any kernel's tile
    ref = attention_reference(*(t.double() for t in inputs), causal)
    got = attention_reference(*(t.cuda() for t in inputs), causal, backend=backend)
    plain = attention_reference(*inputs, causal, backend="cpu_flash")
    for name in ref:
        assert got[name].shape == ref[name].shape, (backend, name)
        # dK, dV sum over every query row of the heads sharing a kv head: the most terms of any output
        terms = 200 * heads[0] // heads[1]
        assert max_err(got[name].cpu(), ref[name]) <= _budget(plain[name], ref[name], dtype, terms), (backend, name)


def _ring_like(q, k, v, do, backend, split):
    """A query block against kv blocks of lengths ``split`` (non-causal, as off-diagonal ring steps):
    forwards merged with the online-softmax rule, backwards from the merged (global) lse and delta."""
    scale = default_scale(q.shape[-1], None)
    kb, vb = k.split(split, dim=1), v.split(split, dim=1)
    out = lse = None
    for kj, vj in zip(kb, vb):
        o, l = attn_forward(q, kj, vj, causal=False, scale=scale, backend=backend)
        if out is None:
            out, lse = o.to(l.dtype).clone(), l.clone()      # accumulate in the statistics dtype
        else:
            merge_partial(out, lse, o, l)
    delta = compute_delta(do, out)
    grads = [attn_backward(do, q, kj, vj, lse, delta, causal=False, scale=scale, backend=backend)
             for kj, vj in zip(kb, vb)]
    return dict(out=out, lse=lse, dq=sum(g[0].float() for g in grads),
                dk=torch.cat([g[1] for g in grads], 1), dv=torch.cat([g[2] for g in grads], 1))


@cuda
@pytest.mark.parametrize("backend", CUDA_BACKENDS)
@pytest.mark.parametrize("heads", [(8, 8), (8, 2)], ids=["mha", "gqa"])
def test_cuda_block_backward_with_global_lse(backend, heads):
    """What a ring asks of a kernel: P = exp(S - lse_global) on each block (a kernel that recomputes
    its own softmax, or ignores the surrogate out, gives block gradients that do not sum up)."""
    _need(backend)
    dtype = torch.bfloat16
    q, k, v, do = make_inputs(1, 192, *heads, 64, dtype)
    split = [120, 72]                                  # unequal blocks, as zigzag's half blocks are
    ref = attention_reference(*(t.double() for t in (q, k, v, do)), False)
    got = _ring_like(*(t.cuda() for t in (q, k, v, do)), backend, split)
    plain = _ring_like(q, k, v, do, "cpu_flash", split)
    for name in ref:
        assert max_err(got[name].cpu(), ref[name]) <= _budget(plain[name], ref[name], dtype), (backend, name)


@cuda
@pytest.mark.parametrize("backend", CUDA_BACKENDS + [None])
def test_operator_on_cuda_world_size_one(backend):
    _need(backend)
    q, k, v, do = (t.cuda().requires_grad_(i < 3) for i, t in
                   enumerate(make_inputs(1, 256, 8, 2, 64, torch.bfloat16)))
    out = burst_attn_func(q, k, v, causal=True, backend=backend)
    out.backward(do)
    ref = attention_reference(*(t.detach().double().cpu() for t in (q, k, v, do)), True)
    # bf16: outputs within a few ulps of values of order 1; gradients of order 1-3
    assert max_err(out.detach().cpu(), ref["out"]) < 3e-2
    assert max_err(q.grad.cpu(), ref["dq"]) < 6e-2
    assert max_err(k.grad.cpu(), ref["dk"]) < 6e-2
    assert max_err(v.grad.cpu(), ref["dv"]) < 6e-2


@cuda
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads", [(8, 8), (8, 2)], ids=["mha", "gqa"])
def test_ring_flash_attn_adapter_world_size_one(causal, heads):
    """The ring-flash-attn package through our adapter, alone (G = 1: no hop, its kernels and its
    bookkeeping), against the fp64 reference; the adapter starts a one-rank group for it."""
    import torch.distributed as dist

    from baselines.registry import get

    m = get("ring_flash_attn")
    if not m.available():
        pytest.skip(f"ring_flash_attn is unavailable here (needs {m.external} and flash-attn)")
    had_group = dist.is_initialized()
    inputs = make_inputs(1, 256, *heads, 64, torch.bfloat16)
    q, k, v, do = (t.cuda().requires_grad_(i < 3) for i, t in enumerate(inputs))
    try:
        out = m.call(q, k, v, causal=causal)
        out.backward(do)
    finally:
        if dist.is_initialized() and not had_group:
            dist.destroy_process_group()
    ref = attention_reference(*(t.double() for t in inputs), causal)
    plain = attention_reference(*inputs, causal, backend="cpu_flash")
    for name, got in (("out", out), ("dq", q.grad), ("dk", k.grad), ("dv", v.grad)):
        assert max_err(got.detach().cpu(), ref[name]) <= _budget(plain[name], ref[name], torch.bfloat16), name


# (n_rows, n_cols, lo, hi) band tiles, square and tall (Sq > Sk), as the window masks' plans make them;
# the last two: a tall band open on the right (flash-attn cannot express it: the exact path runs it) and
# a tall band whose top rows have no live key (flash-attn's lse +inf there, ours -inf)
TILES = [TileMask("band", 128, 128, lo=-40, hi=0), TileMask("band", 128, 128, lo=-300, hi=8),
         TileMask("band", 192, 96, lo=-150, hi=-96), TileMask("band", 192, 96, lo=-150, hi=None),
         TileMask("band", 192, 64, lo=-140, hi=-128), TileMask("varlen", 160, 160, cu=(0, 40, 100, 160)),
         TileMask("varlen_full", 160, 160, cu=(0, 40, 100, 160))]


def _tile_grads(q, k, v, do, tm, backend):
    scale = default_scale(q.shape[-1], None)
    out, lse = attn_forward(q, k, v, scale=scale, backend=backend, mask=tm)
    ref_out, ref_lse = attn_forward(*(t.double().cpu() for t in (q, k, v)), scale=scale, backend="reference", mask=tm)
    delta = compute_delta(do.double().cpu(), ref_out)   # the global statistics a ring hands the backward
    grads = attn_backward(do, q, k, v, ref_lse.to(device=q.device, dtype=torch.float32), delta.to(q.device).float(),
                          scale=scale, backend=backend, mask=tm)
    return dict(out=out, lse=lse, dq=grads[0], dk=grads[1], dv=grads[2])


@cuda
@pytest.mark.parametrize("backend", CUDA_BACKENDS)
@pytest.mark.parametrize("tm", TILES, ids=lambda t: f"{t.kind}-{t.n_rows}x{t.n_cols}-{t.lo}-{t.hi}")
def test_cuda_window_and_varlen_tiles(backend, tm):
    """The tiles of a sliding-window or document mask (``mask=``) on CUDA: flash-attn's window and varlen
    paths, the others' exact path, against the fp64 reference; rows without a live key give lse -inf."""
    _need(backend)
    g = torch.Generator().manual_seed(tm.n_rows + tm.n_cols)
    q, do = (torch.randn(2, tm.n_rows, 8, 128, generator=g).to(torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(2, tm.n_cols, 2, 128, generator=g).to(torch.bfloat16) for _ in range(2))
    got = _tile_grads(*(t.cuda() for t in (q, k, v, do)), tm, backend)
    ref = _tile_grads(q, k, v, do, tm, "reference")
    plain = _tile_grads(q, k, v, do, tm, "cpu_flash")
    empty = torch.isneginf(ref["lse"])
    assert torch.equal(torch.isneginf(got["lse"].cpu()), empty), "rows without a live key must have lse -inf"
    for name in ref:
        g_, r, p = (x[name].cpu().double() for x in (got, ref, plain))
        if name == "lse":
            g_, r, p = (x.masked_fill(empty, 0.0) for x in (g_, r, p))
        assert torch.isfinite(g_).all(), (backend, name)
        assert max_err(g_, r) <= _budget(p, r, torch.bfloat16), (backend, name)


@cuda
@pytest.mark.parametrize("mask", ["docs:48:0", "window:100:0"])
def test_operator_with_a_mask_on_cuda_automatic_kernels(mask):
    """The automatic choice at G = 1 with a partial mask: masked tiles go to a kernel with a masked path
    (``resolve_backend(masked=True)``), the others to the first automatic one; against fp64."""
    inputs = make_inputs(1, 384, 8, 2, 64, torch.bfloat16)
    q, k, v, do = (t.cuda().requires_grad_(i < 3) for i, t in enumerate(inputs))
    out = burst_attn_func(q, k, v, causal=True, mask=mask)
    out.backward(do)
    ref = attention_reference(*(t.double() for t in inputs), True, mask=mask)
    plain = attention_reference(*inputs, True, backend="cpu_flash", mask=mask)
    for name, got in (("out", out), ("dq", q.grad), ("dk", k.grad), ("dv", v.grad)):
        assert max_err(got.detach().cpu(), ref[name]) <= _budget(plain[name], ref[name], torch.bfloat16, 384), name


@cuda
def test_xformers_probe_at_the_benchmarks_shape():
    """The lse probe on the kernel the benchmark runs (bf16, d = 128, causal), not only fp16 d = 64."""
    _need("xformers")
    from burst_impl.kernels import xformers

    assert xformers.honours_lse(torch.device("cuda"), torch.bfloat16, head_dim=128, causal=True)


def test_every_cuda_backend_is_listed():
    """The GPU check covers every registered CUDA kernel (runs everywhere: no GPU needed)."""
    assert {"flash_attn", "xformers", "cuda_sdpa"} <= set(CUDA_BACKENDS)
