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


def local_forward(q: Tensor, k: Tensor, v: Tensor, mask: masks.Mask, scale: float,
                  backend: str | None = None) -> tuple[Tensor, Tensor]:
    """(out (B,S,Z,d) in q's dtype, lse (B,Z,S) statistics dtype) of ``mask`` over the S positions, no
    autograd: the tiles of ``local_plan``. Callers that keep (out, lse) themselves (sequence-level
    checkpointing, ``burst_impl.model.checkpoint``) pair it with ``local_backward``."""
    state = RowState(q)
    forward_tiles(state, local_plan(mask, q.shape[1]), q, k, v, scale, backend)
    out, lse = state.result()
    return out.to(q.dtype), lse


def local_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, mask: masks.Mask,
                   scale: float, backend: str | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) in the inputs' dtypes of ``local_forward``'s attention, from its (out, lse)."""
    acc = stats_dtype(q.dtype)
    dout = dout.contiguous()
    grads = [GradAcc(t, acc, torch.zeros_like(t, dtype=acc)) for t in (q, k, v)]
    backward_tiles(local_plan(mask, q.shape[1]), dout, q, k, v, lse, compute_delta(dout, out), scale, backend,
                   *grads)
    dq, dk, dv = (g.t for g in grads)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _LocalAttn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, scale, backend):
        out, lse = local_forward(q, k, v, mask, scale, backend)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.cfg = (mask, scale, backend)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        return (*local_backward(dout, q, k, v, out, lse, *ctx.cfg), None, None, None)


def local_attn(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False, softmax_scale: float | None = None,
               backend: str | None = None, mask=None) -> Tensor:
    """q (B, S, Z, d), k/v (B, S, Zkv, d) -> out (B, S, Z, d), tokens in position order 0..S-1.

    ``causal``: the plain k_pos <= q_pos mask; ``mask`` (a ``masks.Mask`` or spec string over the
    S positions) is intersected with it (``masks.resolve``)."""
    resolve_backend(q.device, backend)
    m = masks.resolve(causal, mask, q.shape[1])
    return _LocalAttn.apply(q, k, v, m, default_scale(q.shape[-1], softmax_scale), backend)
