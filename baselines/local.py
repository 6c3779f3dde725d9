"""Differentiable single-device attention with the shared local kernels.

Ulysses (after its all-to-all), USP with ring degree 1 and the TP layers run
attention on the full sequence of their local heads; this is that call, with
the same kernels (``burst_impl.kernels``) as every ring method so that
methods differ only in how they distribute work.
"""
from __future__ import annotations

import torch

from burst_impl.kernels import attn_backward, attn_forward, compute_delta, default_scale, resolve_backend

Tensor = torch.Tensor


class _LocalAttn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, scale, backend):
        out, lse = attn_forward(q, k, v, causal=causal, scale=scale, backend=backend)  # (B,S,Z,d), (B,Z,S)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.cfg = (causal, scale, backend)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        causal, scale, backend = ctx.cfg
        dq, dk, dv = attn_backward(dout.contiguous(), q, k, v, lse, compute_delta(dout, out),
                                   causal=causal, scale=scale, backend=backend)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


def local_attn(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False, softmax_scale: float | None = None,
               backend: str | None = None) -> Tensor:
    """q (B, S, Z, d), k/v (B, S, Zkv, d) -> out (B, S, Z, d); causal is the plain k_pos <= q_pos mask."""
    resolve_backend(q.device, backend)
    return _LocalAttn.apply(q, k, v, causal, default_scale(q.shape[-1], softmax_scale), backend)
