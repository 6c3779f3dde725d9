"""Modern blockwise ring attention (ring-flash-attn, Megatron/TransformerEngine CP, PyTorch CP).

Forward: Q stays, (K, V) travel G-1 hops; each step's block result (O_ij,
lse_ij) is folded into the running (O_i, lse_i) with ``torch.logaddexp``.
Backward: Q, dO, lse, delta and dQ stay; (K, V) travel again and the dK, dV
accumulators (fp32 by default) follow them on a second ring, ending one hop
later at their owner. Layouts contiguous and zigzag (``block_plan`` says which
rows and columns of a block pair are live under a causal mask).

This is the same algorithm as BurstAttention's ``backward="ring"`` path, but
written separately (merge rule, state handling) so the two cross-check each
other; it shares only the ring plumbing (``circulate``, ``AccumulatorRing``)
and the local kernels. Bytes per rank: ``volume.forward_bytes`` +
``volume.ring_backward_bytes``.
"""
from __future__ import annotations

import torch

from burst_impl import comm, volume
from burst_impl.attention import AccumulatorRing, check_inputs, circulate
from burst_impl.kernels import attn_backward, attn_forward, compute_delta, default_scale, resolve_backend
from burst_impl.layout import block_plan

Tensor = torch.Tensor


def _forward(q, k, v, causal, scale, group, layout, backend):
    ring = comm.Ring(group)
    b, s, z, d = q.shape
    out = torch.zeros(b, s, z, d, dtype=torch.float32, device=q.device)          # (B, S, Z, d)
    lse = torch.full((b, z, s), float("-inf"), dtype=torch.float32, device=q.device)  # (B, Z, S)

    def on_block(step, owner, kv):
        plan = block_plan(layout, causal, ring.rank, owner, s)
        if plan.empty:
            return
        rows = plan.q_rows
        o_blk, l_blk = attn_forward(q[:, rows], kv[0][:, plan.kv_cols], kv[1][:, plan.kv_cols],
                                    causal=plan.causal, scale=scale, backend=backend)
        l_old = lse[:, :, rows]
        l_new = torch.logaddexp(l_old, l_blk)
        # Both weights are exp of a non-positive number; exp(-inf) = 0 covers empty rows.
        w_old = torch.exp(l_old - l_new).transpose(1, 2).unsqueeze(-1)   # (B, s_rows, Z, 1)
        w_blk = torch.exp(l_blk - l_new).transpose(1, 2).unsqueeze(-1)
        out[:, rows] = out[:, rows] * w_old + o_blk.float() * w_blk
        lse[:, :, rows] = l_new

    circulate(ring, [k, v], "forward", ("k", "v"), on_block)
    return out.to(q.dtype), lse


def _backward(dout, q, k, v, out, lse, causal, scale, group, layout, backend, grad_dtype):
    ring = comm.Ring(group)
    s = q.shape[1]
    delta = compute_delta(dout, out)                              # (B, Z, S) fp32
    dq = torch.zeros_like(q, dtype=torch.float32)                 # (B, S, Z, d)
    acc = AccumulatorRing(ring, ("dk", "dv"), [k, v], grad_dtype)

    def on_block(step, owner, kv):
        plan = block_plan(layout, causal, ring.rank, owner, s)
        if plan.empty:
            acc.push(step, None)
            return
        rows, cols = plan.q_rows, plan.kv_cols
        dq_b, dk_b, dv_b = attn_backward(dout[:, rows], q[:, rows], kv[0][:, cols], kv[1][:, cols],
                                         lse[:, :, rows], delta[:, :, rows], causal=plan.causal,
                                         scale=scale, backend=backend)
        dq[:, rows] += dq_b.float()
        dk_full = torch.zeros_like(k, dtype=torch.float32)
        dv_full = torch.zeros_like(v, dtype=torch.float32)
        dk_full[:, cols] = dk_b.float()
        dv_full[:, cols] = dv_b.float()
        acc.push(step, [dk_full, dv_full])

    circulate(ring, [k, v], "backward", ("k", "v"), on_block)
    dk, dv = acc.finish()
    return dq, dk, dv


class _RingAttn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, scale, group, layout, backend, grad_dtype):
        out, lse = _forward(q, k, v, causal, scale, group, layout, backend)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.cfg = (causal, scale, group, layout, backend, grad_dtype)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _backward(dout.contiguous(), q, k, v, out, lse, *ctx.cfg)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None, None


def ring_attn_func(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False,
                   softmax_scale: float | None = None, group=None, layout: str = "contiguous",
                   backend: str | None = None, grad_comm_dtype: torch.dtype = torch.float32) -> Tensor:
    """Blockwise ring attention on local shards: q (B, N/G, Z, d), k/v (B, N/G, Zkv, d) -> (B, N/G, Z, d)."""
    check_inputs(q, k, v, layout=layout, softmax_scale=softmax_scale)
    resolve_backend(q.device, backend)
    return _RingAttn.apply(q, k, v, causal, default_scale(q.shape[-1], softmax_scale), group, layout,
                           backend, grad_comm_dtype)


def ring_comm_bytes(s) -> dict[tuple[str, str], int]:
    return volume.expected_bytes(s.batch, s.seqlen, s.heads, s.kv_heads, s.head_dim, s.world_size,
                                 s.elem_size, backward="ring")
