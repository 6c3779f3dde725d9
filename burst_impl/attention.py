"""The BurstAttention operator (PAPER.md §1).

``burst_attn_func(q, k, v, *, causal, softmax_scale, group, layout, backward)``
takes the local shards (B, N/G, Z, d) of q and (B, N/G, Zkv, d) of k, v and
returns the local shard of the attention output, differentiably.

Forward: Q stays, K/V circulate G steps; each step's partial (O_ij, lse_ij)
merges into the running (O_i, lse_i) in fp32 (`merge_partial`).
Backward ``"burst"``: K, V, dK, dV stay; (Q, dO, lse, delta) circulate on one
ring and the dQ accumulator on a second ring that ends at the owner.
Backward ``"ring"``: Q, dO, lse, delta, dQ stay; (K, V) circulate and the dK,
dV accumulators follow on the second ring. ``"auto"`` takes whichever sends
fewer bytes (`volume.cheaper_backward`) and notes the choice in the byte
counters (``counts.notes["burst.backward"]``).
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from . import comm, volume
from .kernels import attn_backward, attn_forward, compute_delta, default_scale, resolve_backend
from .layout import block_plan, check_layout, chunks_per_rank
from .shape import AttnShape

Tensor = torch.Tensor
BACKWARDS = ("burst", "ring", "auto")

# ---------------------------------------------------------------- validation


def check_inputs(q: Tensor, k: Tensor, v: Tensor, *, layout: str = "contiguous",
                 backward: str = "burst", softmax_scale: float | None = None) -> None:
    """Raise ValueError (naming parameter, value and rule) before any communication."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"{name}.shape={tuple(t.shape)} must be 4-D (batch, seq_local, heads, head_dim)")
    if k.shape != v.shape:
        raise ValueError(f"k.shape={tuple(k.shape)} and v.shape={tuple(v.shape)} must be equal")
    if q.shape[0] != k.shape[0] or q.shape[1] != k.shape[1] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q.shape={tuple(q.shape)} and k.shape={tuple(k.shape)} must agree in batch, "
                         "seq_local and head_dim")
    if k.shape[2] == 0 or q.shape[2] % k.shape[2] != 0:
        raise ValueError(f"query heads q.shape[2]={q.shape[2]} must be a multiple of key/value heads "
                         f"k.shape[2]={k.shape[2]}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"dtypes of q, k, v must be equal, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"devices of q, k, v must be equal, got {q.device}, {k.device}, {v.device}")
    check_layout(layout)
    if backward not in BACKWARDS:
        raise ValueError(f"backward={backward!r} is unknown; choose one of {BACKWARDS}")
    per = chunks_per_rank(layout)
    if q.shape[1] == 0 or q.shape[1] % per != 0:
        raise ValueError(f"seq_local=q.shape[1]={q.shape[1]} must be a positive multiple of {per} "
                         f"for layout={layout!r} (the global sequence splits into {per}*G chunks)")
    if softmax_scale is not None and not softmax_scale > 0:
        raise ValueError(f"softmax_scale={softmax_scale} must be positive")


# ---------------------------------------------------------------- numerics


def merge_partial(out: Tensor, lse: Tensor, out_blk: Tensor, lse_blk: Tensor) -> None:
    """In place: fold a block's (out_blk, lse_blk) into the running (out, lse).

    out (B, S, Z, d) fp32, lse (B, Z, S) fp32. PAPER.md §1 online-softmax rule
    in its stable form: lse' = lse - logsigmoid(lse - lse_blk) (= log(e^lse + e^lse_blk)),
    out' = out + sigmoid(lse_blk - lse) * (out_blk - out)
    (= e^(lse-lse') out + e^(lse_blk-lse') out_blk). Neither exponentiates a
    large positive number.
    """
    w = torch.sigmoid(lse_blk - lse).transpose(1, 2).unsqueeze(-1)  # (B, S, Z, 1)
    out.add_(w * (out_blk.float() - out))
    lse.sub_(F.logsigmoid(lse - lse_blk))


# ---------------------------------------------------------------- ring building blocks


def circulate(ring: comm.Ring, bundle: list[Tensor], phase: str, kinds: Sequence[str],
              on_block: Callable[[int, int, list[Tensor]], None]) -> None:
    """Visit the G blocks of ``bundle``: ``on_block(step, owner, tensors)``.

    Step s holds the block of rank (rank - s) mod G. The next block's
    transfer is posted before computing on the current one (double buffering).
    """
    for step in range(ring.size):
        pending = ring.start(bundle, phase, kinds) if step < ring.size - 1 else None
        on_block(step, (ring.rank - step) % ring.size, bundle)
        if pending is not None:
            bundle = pending.wait()


class AccumulatorRing:
    """Gradient accumulators that follow a circulating bundle and end at its owner.

    The owner's own contribution (step 0) stays home. From step 1 the
    accumulator for the visiting block is this rank's contribution plus what
    the previous rank accumulated for the same block (sent at its step s-1);
    it is then sent on. After the last step it is one hop from its owner,
    which receives it in ``finish``. G-1 sends per rank in all.
    """

    def __init__(self, ring: comm.Ring, kinds: Sequence[str], like: Sequence[Tensor], dtype):
        self.ring, self.kinds, self.dtype = ring, kinds, dtype
        self.like = like
        self.own: list[Tensor] | None = None
        self.pending: comm.Pending | None = None

    def push(self, step: int, grads: list[Tensor] | None) -> None:
        """This rank's contribution to the block visiting at ``step`` (None: no work)."""
        if step == 0:
            self.own = grads
            return
        incoming = self.pending.wait() if self.pending is not None else None
        if incoming is None:
            acc = [g.to(self.dtype) for g in grads] if grads is not None else \
                [torch.zeros_like(t, dtype=self.dtype) for t in self.like]
        else:
            acc = incoming if grads is None else [a.add_(g) for a, g in zip(incoming, grads)]
        self.pending = self.ring.start(acc, "backward", self.kinds)

    def finish(self) -> list[Tensor]:
        """fp32 totals for this rank's own block."""
        own = self.own if self.own is not None else [torch.zeros_like(t, dtype=torch.float32) for t in self.like]
        own = [o.float() for o in own]
        if self.pending is not None:
            for o, r in zip(own, self.pending.wait()):
                o.add_(r.float())
        return own


# ---------------------------------------------------------------- forward / backward


def ring_forward(q, k, v, *, causal, scale, group, layout, backend):
    """-> (out (B,S,Z,d) in q.dtype, lse (B,Z,S) fp32)."""
    ring = comm.Ring(group)
    s_local = q.shape[1]
    state: dict[str, Tensor] = {}

    def on_block(step, owner, kv):
        plan = block_plan(layout, causal, ring.rank, owner, s_local)
        if plan.empty:
            return
        o_blk, lse_blk = attn_forward(q[:, plan.q_rows], kv[0][:, plan.kv_cols], kv[1][:, plan.kv_cols],
                                      causal=plan.causal, scale=scale, backend=backend)
        if step == 0:  # the diagonal block covers every row: it initialises the state
            state["out"], state["lse"] = o_blk.float(), lse_blk.clone()
        else:
            merge_partial(state["out"][:, plan.q_rows], state["lse"][:, :, plan.q_rows], o_blk, lse_blk)

    circulate(ring, [k, v], "forward", ("k", "v"), on_block)
    return state["out"].to(q.dtype), state["lse"]


def _block_grads(plan, dout, q, k, v, lse, delta, scale, backend):
    """(dq, dk, dv) of the live part of one (q block, kv block) pair: rows ``plan.q_rows``
    of the query side, columns ``plan.kv_cols`` of the key/value side."""
    return attn_backward(
        dout[:, plan.q_rows], q[:, plan.q_rows], k[:, plan.kv_cols], v[:, plan.kv_cols],
        lse[:, :, plan.q_rows], delta[:, :, plan.q_rows],
        causal=plan.causal, scale=scale, backend=backend)


def _full_size(like: Tensor, part: Tensor, sl: slice) -> Tensor:
    """``part`` in fp32, zero-padded along the sequence to ``like``'s shape: only a
    travelling accumulator needs the full shard; home accumulators add the slice."""
    if sl == slice(None):
        return part.float()
    full = torch.zeros_like(like, dtype=torch.float32)
    full[:, sl] = part
    return full


def burst_backward(dout, q, k, v, out, lse, *, causal, scale, group, layout, backend, grad_dtype):
    """Query side circulates; dK, dV accumulate at home; dQ rides the second ring."""
    ring = comm.Ring(group)
    delta = compute_delta(dout, out)  # (B, Z, S) fp32; travels instead of O
    dk, dv = torch.zeros_like(k, dtype=torch.float32), torch.zeros_like(v, dtype=torch.float32)
    dq_ring = AccumulatorRing(ring, ("dq",), [q], grad_dtype)

    def on_block(step, owner, qside):
        q_j, do_j, lse_j, delta_j = qside
        plan = block_plan(layout, causal, owner, ring.rank, q.shape[1])
        if plan.empty:
            dq_ring.push(step, None)
            return
        dq_b, dk_b, dv_b = _block_grads(plan, do_j, q_j, k, v, lse_j, delta_j, scale, backend)
        dk[:, plan.kv_cols] += dk_b
        dv[:, plan.kv_cols] += dv_b
        dq_ring.push(step, [_full_size(q, dq_b, plan.q_rows)])

    circulate(ring, [q, dout.contiguous(), lse, delta], "backward", ("q", "dout", "lse", "delta"), on_block)
    (dq,) = dq_ring.finish()
    return dq, dk, dv


def kv_ring_backward(dout, q, k, v, out, lse, *, causal, scale, group, layout, backend, grad_dtype):
    """Key/value side circulates; dQ accumulates at home; dK, dV ride the second ring."""
    ring = comm.Ring(group)
    delta = compute_delta(dout, out)
    dq = torch.zeros_like(q, dtype=torch.float32)
    dkv_ring = AccumulatorRing(ring, ("dk", "dv"), [k, v], grad_dtype)

    def on_block(step, owner, kv):
        plan = block_plan(layout, causal, ring.rank, owner, q.shape[1])
        if plan.empty:
            dkv_ring.push(step, None)
            return
        dq_b, dk_b, dv_b = _block_grads(plan, dout, q, kv[0], kv[1], lse, delta, scale, backend)
        dq[:, plan.q_rows] += dq_b
        dkv_ring.push(step, [_full_size(k, dk_b, plan.kv_cols), _full_size(v, dv_b, plan.kv_cols)])

    circulate(ring, [k, v], "backward", ("k", "v"), on_block)
    dk, dv = dkv_ring.finish()
    return dq, dk, dv


BACKWARD_FNS = {"burst": burst_backward, "ring": kv_ring_backward}


def resolve_backward(backward: str, q: Tensor, k: Tensor, world_size: int, grad_dtype) -> str:
    if backward != "auto":
        return backward
    return volume.cheaper_backward(AttnShape.from_tensors(q, k, world_size),
                                   torch.empty((), dtype=grad_dtype).element_size())


class _BurstAttnFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, scale, group, layout, backward, backend, grad_dtype):
        out, lse = ring_forward(q, k, v, causal=causal, scale=scale, group=group, layout=layout,
                                backend=backend)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.cfg = dict(causal=causal, scale=scale, group=group, layout=layout, backend=backend,
                       grad_dtype=grad_dtype)
        ctx.backward_name = backward
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = BACKWARD_FNS[ctx.backward_name](dout, q, k, v, out, lse, **ctx.cfg)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None, None, None


def burst_attn_func(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False,
                    softmax_scale: float | None = None, group=None, layout: str = "contiguous",
                    backward: str = "auto", backend: str | None = None,
                    grad_comm_dtype: torch.dtype = torch.float32, return_lse: bool = False):
    """BurstAttention on local shards.

    q (B, N/G, Z, d), k and v (B, N/G, Zkv, d), Z a multiple of Zkv, each rank
    holding the shard of ``layout`` (see ``burst_impl.layout.shard``).
    Returns out (B, N/G, Z, d) in q's dtype, and with ``return_lse`` also the
    global log-sum-exp of the local rows, (B, Z, N/G) fp32.

    ``grad_comm_dtype`` is the dtype of the travelling gradient accumulators
    (dQ for "burst", dK/dV for "ring"); fp32 by default so that G partial sums
    do not lose precision in bf16.
    """
    check_inputs(q, k, v, layout=layout, backward=backward, softmax_scale=softmax_scale)
    resolve_backend(q.device, backend)  # validates the name before any communication
    _, world_size = comm.world(group)
    scale = default_scale(q.shape[-1], softmax_scale)
    chosen = resolve_backward(backward, q, k, world_size, grad_comm_dtype)
    comm.note("burst.backward", chosen)
    out, lse = _BurstAttnFn.apply(q, k, v, causal, scale, group, layout, chosen, backend, grad_comm_dtype)
    return (out, lse) if return_lse else out
