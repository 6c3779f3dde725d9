"""The BurstAttention operator (PAPER.md §1).

``burst_attn_func(q, k, v, *, causal, softmax_scale, group, layout, backward)``
takes the local shards (B, N/G, Z, d) of q and (B, N/G, Zkv, d) of k, v and
returns the local shard of the attention output, differentiably.

Forward: Q stays, K/V circulate G steps; each step's partial (O_ij, lse_ij)
merges into the running (O_i, lse_i) in fp32, fp64 for fp64 inputs (`merge_partial`).
Backward ``"burst"``: K, V, dK, dV stay; (Q, dO, lse, delta) circulate on one
ring and the dQ accumulator on a second ring that ends at the owner.
Backward ``"ring"``: Q, dO, lse, delta, dQ stay; (K, V) circulate and the dK,
dV accumulators follow on the second ring. ``"auto"`` takes whichever sends
fewer bytes (`volume.cheaper_backward`) and notes the choice in the byte
counters (``counts.notes["burst.backward"]``).

The ring loops themselves (``circulate``, ``AccumulatorRing``) live in
``burst_impl.comm``; they keep a rank whose block computation raises in the
ring until every transfer is done, then raise (see ``comm.circulate``).
They run on a transport built once per call before any byte is sent
(``burst_impl.topology.transport``): the flat ring, or the double ring
(``topology="double"``); the per-step compute only sees (q owner, kv owner).
"""
from __future__ import annotations

import math
import numbers

import torch
import torch.nn.functional as F

from . import comm, volume
from .comm import AccumulatorRing, circulate  # noqa: F401 - the ring helpers live in comm; re-exported
from .kernels import (FLOAT_DTYPES, attn_backward, attn_forward, compute_delta, default_scale,
                      resolve_backend, stats_dtype)
from .layout import block_plan, check_layout, chunks_per_rank
from .shape import AttnShape
from .topology import transport as topology_transport

Tensor = torch.Tensor
BACKWARDS = ("burst", "ring", "auto")
_DTYPE_NAMES = ", ".join(str(d).removeprefix("torch.") for d in FLOAT_DTYPES)

# ---------------------------------------------------------------- validation


def check_inputs(q: Tensor, k: Tensor, v: Tensor, *, layout: str = "contiguous",
                 backward: str = "burst", softmax_scale: float | None = None, backend: str | None = None,
                 grad_comm_dtype: torch.dtype | None = None, group=None) -> None:
    """Raise ValueError (naming parameter, value and rule) before any communication.

    The one validation every sequence-parallel method calls first: tensors,
    dtypes (float16, bfloat16, float32, float64), shapes, layout, backward
    scheme, ``softmax_scale`` (finite, positive), ``grad_comm_dtype`` (a
    floating dtype), ``backend`` (known, and able to run on the tensors'
    device and dtype) and membership of ``group``. With ``comm.check_shapes``
    on, the ranks of ``group`` also compare their shapes and outcomes (one
    small all-gather), so uneven shards, or bad input on one rank only, raise
    on every rank instead of hanging the first transfer.
    """
    comm.world(group)  # a non-member raises here, and must not join the shape check below
    problem = None
    try:
        _check_local(q, k, v, layout=layout, backward=backward, softmax_scale=softmax_scale,
                     backend=backend, grad_comm_dtype=grad_comm_dtype)
    except ValueError as e:
        problem = e
    if comm.shape_check_enabled():
        comm.agree_on_inputs(group, _signature(q, k, v), problem, _describe)
    if problem is not None:
        raise problem


def _check_local(q, k, v, *, layout, backward, softmax_scale, backend, grad_comm_dtype) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name}={type(t).__name__} must be a torch.Tensor (batch, seq_local, heads, head_dim)")
        if t.dtype not in FLOAT_DTYPES:
            raise ValueError(f"{name}.dtype={t.dtype} must be a floating dtype: one of {_DTYPE_NAMES}")
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
    if softmax_scale is not None:
        if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real) \
                or not math.isfinite(softmax_scale) or not softmax_scale > 0:
            raise ValueError(f"softmax_scale={softmax_scale!r} must be a finite positive number "
                             "(or None for 1/sqrt(head_dim))")
    if grad_comm_dtype is not None and grad_comm_dtype not in FLOAT_DTYPES:
        raise ValueError(f"grad_comm_dtype={grad_comm_dtype!r} must be a floating torch.dtype: one of "
                         f"{_DTYPE_NAMES} (or None: fp32, fp64 for fp64 inputs)")
    resolve_backend(q.device, backend, q.dtype, q.shape[-1])


def _signature(q, k, v) -> list[int]:
    """13 ints: the shapes of q, k, v (-1 where not a 4-D tensor) and the dtype's index."""
    sig: list[int] = []
    for t in (q, k, v):
        dims = list(t.shape) if isinstance(t, torch.Tensor) and t.dim() == 4 else []
        sig += dims + [-1] * (4 - len(dims))
    dt = getattr(q, "dtype", None)
    return sig + [FLOAT_DTYPES.index(dt) if dt in FLOAT_DTYPES else -1]


def _describe(sig: list[int]) -> str:
    shapes = ", ".join(f"{n} {tuple(sig[4 * i:4 * i + 4])}" for i, n in enumerate("qkv"))
    return f"{shapes}, dtype {FLOAT_DTYPES[sig[12]] if sig[12] >= 0 else '?'}"


# ---------------------------------------------------------------- numerics


def merge_partial(out: Tensor, lse: Tensor, out_blk: Tensor, lse_blk: Tensor) -> None:
    """In place: fold a block's (out_blk, lse_blk) into the running (out, lse).

    out (B, S, Z, d), lse (B, Z, S), both in the statistics dtype (fp32, or
    fp64 for fp64 inputs). PAPER.md §1 online-softmax rule in its stable form:
    lse' = lse - logsigmoid(lse - lse_blk) (= log(e^lse + e^lse_blk)),
    out' = out + sigmoid(lse_blk - lse) * (out_blk - out)
    (= e^(lse-lse') out + e^(lse_blk-lse') out_blk). Neither exponentiates a
    large positive number.
    """
    w = torch.sigmoid(lse_blk - lse).transpose(1, 2).unsqueeze(-1)  # (B, S, Z, 1)
    out.add_(w * (out_blk.to(out.dtype) - out))
    lse.sub_(F.logsigmoid(lse - lse_blk))


# ---------------------------------------------------------------- forward / backward


def ring_forward(q, k, v, *, causal, scale, ring, layout, backend):
    """-> (out (B,S,Z,d) in q.dtype, lse (B,Z,S) in the statistics dtype). ``ring``: the transport."""
    s_local = q.shape[1]
    acc = stats_dtype(q.dtype)
    state: dict[str, Tensor] = {}

    def on_block(step, owner, kv):
        plan = block_plan(layout, causal, ring.rank, owner, s_local)
        if plan.empty:
            return None
        o_blk, lse_blk = attn_forward(q[:, plan.q_rows], kv[0][:, plan.kv_cols], kv[1][:, plan.kv_cols],
                                      causal=plan.causal, scale=scale, backend=backend)
        if step == 0:  # the diagonal block covers every row: it initialises the state
            state["out"], state["lse"] = o_blk.to(acc), lse_blk.clone()
        else:
            merge_partial(state["out"][:, plan.q_rows], state["lse"][:, :, plan.q_rows], o_blk, lse_blk)
        return None

    circulate(ring, [k, v], "forward", ("k", "v"), on_block)
    return state["out"].to(q.dtype), state["lse"]


def _block_grads(plan, dout, q, k, v, lse, delta, scale, backend):
    """(dq, dk, dv) of the live part of one (q block, kv block) pair: rows ``plan.q_rows``
    of the query side, columns ``plan.kv_cols`` of the key/value side."""
    return attn_backward(
        dout[:, plan.q_rows], q[:, plan.q_rows], k[:, plan.kv_cols], v[:, plan.kv_cols],
        lse[:, :, plan.q_rows], delta[:, :, plan.q_rows],
        causal=plan.causal, scale=scale, backend=backend)


def _full_size(like: Tensor, part: Tensor, sl: slice, acc: torch.dtype) -> Tensor:
    """``part`` in ``acc``, zero-padded along the sequence to ``like``'s shape: only a
    travelling accumulator needs the full shard; home accumulators add the slice."""
    if sl == slice(None):
        return part.to(acc)
    full = torch.zeros_like(like, dtype=acc)
    full[:, sl] = part
    return full


def burst_backward(dout, q, k, v, out, lse, *, causal, scale, ring, layout, backend, grad_dtype):
    """Query side circulates; dK, dV accumulate at home; dQ rides the second ring."""
    acc = stats_dtype(q.dtype)
    delta = compute_delta(dout, out)  # (B, Z, S); travels instead of O
    dk, dv = torch.zeros_like(k, dtype=acc), torch.zeros_like(v, dtype=acc)
    dq_ring = AccumulatorRing(ring, ("dq",), [q], grad_dtype, acc)

    def on_block(step, owner, qside):
        q_j, do_j, lse_j, delta_j = qside
        plan = block_plan(layout, causal, owner, ring.rank, q.shape[1])
        if plan.empty:
            return None
        dq_b, dk_b, dv_b = _block_grads(plan, do_j, q_j, k, v, lse_j, delta_j, scale, backend)
        dk[:, plan.kv_cols] += dk_b
        dv[:, plan.kv_cols] += dv_b
        return [_full_size(q, dq_b, plan.q_rows, acc)]

    (dq,) = circulate(ring, [q, dout, lse, delta], "backward", ("q", "dout", "lse", "delta"), on_block,
                      acc=dq_ring)
    return dq, dk, dv


def kv_ring_backward(dout, q, k, v, out, lse, *, causal, scale, ring, layout, backend, grad_dtype):
    """Key/value side circulates; dQ accumulates at home; dK, dV ride the second ring."""
    acc = stats_dtype(q.dtype)
    delta = compute_delta(dout, out)
    dq = torch.zeros_like(q, dtype=acc)
    dkv_ring = AccumulatorRing(ring, ("dk", "dv"), [k, v], grad_dtype, acc)

    def on_block(step, owner, kv):
        plan = block_plan(layout, causal, ring.rank, owner, q.shape[1])
        if plan.empty:
            return None
        dq_b, dk_b, dv_b = _block_grads(plan, dout, q, kv[0], kv[1], lse, delta, scale, backend)
        dq[:, plan.q_rows] += dq_b
        return [_full_size(k, dk_b, plan.kv_cols, acc), _full_size(v, dv_b, plan.kv_cols, acc)]

    dk, dv = circulate(ring, [k, v], "backward", ("k", "v"), on_block, acc=dkv_ring)
    return dq, dk, dv


BACKWARD_FNS = {"burst": burst_backward, "ring": kv_ring_backward}


def resolve_backward(backward: str, q: Tensor, k: Tensor, world_size: int, grad_dtype) -> str:
    if backward != "auto":
        return backward
    return volume.cheaper_backward(AttnShape.from_tensors(q, k, world_size),
                                   torch.empty((), dtype=grad_dtype).element_size())


class _BurstAttnFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, scale, ring, layout, backward, backend, grad_dtype):
        out, lse = ring_forward(q, k, v, causal=causal, scale=scale, ring=ring, layout=layout,
                                backend=backend)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.cfg = dict(causal=causal, scale=scale, ring=ring, layout=layout, backend=backend,
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
                    grad_comm_dtype: torch.dtype | None = None, return_lse: bool = False,
                    topology: str = "flat", node_size: int | None = None, overlap: bool = True):
    """BurstAttention on local shards.

    q (B, N/G, Z, d), k and v (B, N/G, Zkv, d), Z a multiple of Zkv, each rank
    holding the shard of ``layout`` (see ``burst_impl.layout.shard``), in
    float16, bfloat16, float32 or float64, with any strides. Returns out
    (B, N/G, Z, d) in q's dtype, and with ``return_lse`` also the global
    log-sum-exp of the local rows, (B, Z, N/G), fp32 (fp64 for fp64 inputs).

    ``grad_comm_dtype`` is the dtype of the travelling gradient accumulators
    (dQ for "burst", dK/dV for "ring"); None (default) means fp32, or fp64 for
    fp64 inputs, so that G partial sums do not lose precision in bf16.

    Every rank of ``group`` must hold shards of the same shape. A rank cannot
    see a mismatch (e.g. N=10 over 3 ranks split 4/3/3) without asking the
    others, so by default it is not checked and the first transfer hangs until
    the process-group timeout; ``comm.check_shapes(True)`` turns on a check
    (one small all-gather per call) that raises ValueError on every rank.
    If a block computation raises on one rank, that rank finishes its part of
    the ring transfers and then raises; its peers complete without error (and
    without its contribution), and the group stays usable.

    ``topology``: "flat" (one ring over the group in rank order) or "double"
    (``burst_impl.topology``: an intra-node ring per node while the next
    round's block crosses to the same local rank of the next node; falls back
    to the flat ring, with a note, on one node or one rank per node).
    ``node_size``: ranks of the group per node (None: from ``LOCAL_WORLD_SIZE``,
    else one node); it also sets the link class of every counted send.
    ``overlap=False`` waits for each transfer before computing (no
    communication/computation overlap), to measure what overlap buys.
    """
    check_inputs(q, k, v, layout=layout, backward=backward, softmax_scale=softmax_scale, backend=backend,
                 grad_comm_dtype=grad_comm_dtype, group=group)
    ring = topology_transport(group, topology, node_size, overlap=overlap)
    world_size = ring.size
    scale = default_scale(q.shape[-1], softmax_scale)
    grad_dtype = grad_comm_dtype if grad_comm_dtype is not None else stats_dtype(q.dtype)
    chosen = resolve_backward(backward, q, k, world_size, grad_dtype)
    comm.note("burst.backward", chosen)
    out, lse = _BurstAttnFn.apply(q, k, v, causal, scale, ring, layout, chosen, backend, grad_dtype)
    return (out, lse) if return_lse else out
