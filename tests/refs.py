"""Single-process references and input builders shared by the operator and baseline tests."""
from __future__ import annotations

import torch

from burst_impl import masks
from burst_impl.kernels import TileMask, attn_backward, attn_forward, compute_delta, default_scale


def make_inputs(batch, seqlen, heads, kv_heads, head_dim, dtype=torch.float32, seed=0):
    """Full-sequence q, k, v, dout (B, N, *, d), identical on every rank for the same seed."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seqlen, heads, head_dim, generator=g)
    k = torch.randn(batch, seqlen, kv_heads, head_dim, generator=g)
    v = torch.randn(batch, seqlen, kv_heads, head_dim, generator=g)
    do = torch.randn(batch, seqlen, heads, head_dim, generator=g)
    return tuple(t.to(dtype) for t in (q, k, v, do))


def attention_reference(q, k, v, do, causal, softmax_scale=None, backend="reference", mask=None):
    """Full attention and its gradients: dict(out, lse, dq, dk, dv).

    ``backend="reference"`` computes in fp64; another backend name gives the
    plain single-process result in the inputs' precision (for error budgets).
    ``mask`` (a ``burst_impl.masks`` mask or spec, intersected with ``causal``): the reference
    applies its dense definition ``allowed`` over the N x N positions, nothing else.
    """
    scale = default_scale(q.shape[-1], softmax_scale)
    if backend == "reference":
        q, k, v, do = (t.double() for t in (q, k, v, do))
    tile = None
    if mask is not None:
        n = q.shape[1]
        m = masks.resolve(causal, mask, n)
        tile = TileMask("dense", n, n, rows_fn=lambda a, b: m.allowed(torch.arange(a, b), torch.arange(n)))
        causal = False
    out, lse = attn_forward(q, k, v, causal=causal, scale=scale, backend=backend, mask=tile)
    dq, dk, dv = attn_backward(do, q, k, v, lse, compute_delta(do, out), causal=causal, scale=scale,
                               backend=backend, mask=tile)
    return dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv)


def max_err(a, b) -> float:
    """Largest absolute difference; entries that are -inf on both sides (lse of a row with no live
    key) count as equal, a -inf on one side only as infinite."""
    a, b = a.double(), b.double()
    both = torch.isneginf(a) & torch.isneginf(b)
    d = (a - b).abs().masked_fill(both, 0.0)
    return d.nan_to_num(nan=float("inf")).max().item() if d.numel() else 0.0
