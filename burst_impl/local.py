"""Differentiable single-device attention with the shared local kernels.

Ulysses (after its all-to-all), USP with ring degree 1 and the TP layers run
attention on the full sequence of their local heads, in position order; this
is that call, with the same kernels (``burst_impl.kernels``) and the same
tiles (``burst_impl.plan.local_plan``: one kernel call for full and causal,
the live tiles of any other mask) as every ring method, so that methods differ
only in how they distribute work.
"""
from __future__ import annotations

import torch

from burst_impl import masks
from burst_impl.attention import GradAcc, RowState, backward_tiles, forward_tiles
from burst_impl.kernels import compute_delta, default_scale, resolve_backend, stats_dtype
from burst_impl.plan import local_plan

Tensor = torch.Tensor


class _LocalAttn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, scale, backend):
        plan = local_plan(mask, q.shape[1])
        state = RowState(q)
        forward_tiles(state, plan, q, k, v, scale, backend)
        out, lse = state.result()                               # (B,S,Z,d), (B,Z,S) statistics dtype
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.cfg = (plan, scale, backend)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        plan, scale, backend = ctx.cfg
        acc = stats_dtype(q.dtype)
        dout = dout.contiguous()
        grads = [GradAcc(t, acc, torch.zeros_like(t, dtype=acc)) for t in (q, k, v)]
        backward_tiles(plan, dout, q, k, v, lse, compute_delta(dout, out), scale, backend, *grads)
        dq, dk, dv = (g.t for g in grads)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


def local_attn(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False, softmax_scale: float | None = None,
               backend: str | None = None, mask=None) -> Tensor:
    """q (B, S, Z, d), k/v (B, S, Zkv, d) -> out (B, S, Z, d), tokens in position order 0..S-1.

    ``causal``: the plain k_pos <= q_pos mask; ``mask`` (a ``masks.Mask`` or spec string over the
    S positions) is intersected with it (``masks.resolve``)."""
    resolve_backend(q.device, backend)
    m = masks.resolve(causal, mask, q.shape[1])
    return _LocalAttn.apply(q, k, v, m, default_scale(q.shape[-1], softmax_scale), backend)
