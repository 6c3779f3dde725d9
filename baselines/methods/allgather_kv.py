"""All-gather context parallelism: ``allgather_kv`` (Llama 3's CP, TransformerEngine's ``all_gather`` CP mode,
ring-flash-attn's ``llama3_*varlen`` functions).

The field's most used baseline for document-packed (varlen) masks. Each rank keeps its query shard and
all-gathers K and V over the sequence group; the gathered blocks (rank order) are put into position order
by one local permutation, and the rank computes its queries against the whole sequence under the mask at
global positions: one plan (``burst_impl.plan.build_plan``) of its query runs against the single run
0..N-1, so any mask, any layout and any live-tile shape runs through the same local kernels as every
other method. Backward: dQ stays local; dK, dV of the whole sequence are accumulated (fp32), put back into
rank order and reduce-scattered, each rank keeping the sum of its own shard's rows.

The name says what travels rather than whose code it is (``llama3`` in ring-flash-attn, ``all_gather``
in TransformerEngine, "all-gather based CP" in the Llama 3 paper, arXiv 2407.21783 §3.3.2).

Backward K/V. ``regather=True`` (the default, what TransformerEngine's ``AttnFuncWithCPAndKVAllGather``
and ring-flash-attn's llama3 functions do) keeps only the local k, v shards for backward and all-gathers
them again there: the backward sends k, v again, and what a rank keeps is the ring family's
``volume.saved_bytes``. ``regather=False`` keeps the gathered (B, N, Zkv, d) K and V instead: no backward
all-gather, 2*B*N*Zkv*d elements kept. Either way the forward holds the gathered K, V, at least
2*B*N*Zkv*d elements, while it computes: the memory cost that bounds this method at long N.

Uneven N (shards differ by a token per chunk): NCCL's all-gather and reduce-scatter take equal pieces,
so every shard is padded to the longest, S_max, rows (zeros, never read: no tile reaches them) and the
padded pieces travel, as padded pieces do in the field's implementations; the bytes counted are those
sent. ``grad_comm_dtype`` (default fp32, fp64 for fp64 inputs, as the suite's rings) is the dtype of the
reduce-scatter; TransformerEngine reduce-scatters in the input dtype (``grad_comm_dtype=torch.bfloat16``).

Bytes per rank, with S_max = max shard length, e input bytes, f = grad_comm_dtype bytes:
    forward  k, v:   B*S_max*Zkv*d*e*(G-1) each        (all-gather)
    backward k, v:   the same, with ``regather``       (all-gather again)
    backward dk, dv: B*S_max*Zkv*d*f*(G-1) each        (reduce-scatter of B*G*S_max rows)
all on the rank's hop to the next rank of the group (NCCL's ring algorithm; ``burst_impl.collectives``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from burst_impl import comm, volume
from burst_impl.attention import GradAcc, RowState, backward_tiles, forward_tiles, validate_call
from burst_impl.collectives import all_gather_, reduce_scatter_
from burst_impl.kernels import compute_delta, default_scale, stats_dtype
from burst_impl.layout import LAYOUT_NAMES, lengths, positions, runs
from burst_impl.masks import Run
from burst_impl.method import Method, Schedule
from burst_impl.nodes import Nodes, formula_nodes
from burst_impl.plan import StepPlan, build_plan
from burst_impl.shape import AttnShape

ORDER = 90
Tensor = torch.Tensor

_PLANS: dict[tuple, StepPlan] = {}
_PLAN_CACHE = 1024


def gathered_plan(mask, layout, rank: int, world_size: int, seqlen: int) -> StepPlan:
    """The live tiles of ``rank``'s queries (local order) against all N keys in position order
    (``layout`` resolved). Cached: the plan depends on nothing else, and the performance model asks for it
    too (experiments/perfmodel/schedules/allgather_kv.py)."""
    key = (mask.key, layout, rank, world_size, seqlen)
    plan = _PLANS.get(key)
    if plan is None:
        if len(_PLANS) >= _PLAN_CACHE:
            _PLANS.clear()
        nq = lengths(layout, world_size, seqlen)[rank]
        plan = _PLANS[key] = build_plan(mask, runs(layout, rank, world_size, seqlen), (Run(0, 1, seqlen, 0),),
                                        nq, seqlen)
    return plan


def position_index(layout, world_size: int, seqlen: int) -> Tensor | None:
    """Index into the padded gather (rank j's shard at rows j*S_max ...) of each position 0..N-1;
    None when the gather already is position order (contiguous layout, even shards)."""
    sizes = lengths(layout, world_size, seqlen)
    s_max = max(sizes)
    idx = torch.empty(seqlen, dtype=torch.long)
    for j in range(world_size):
        idx[positions(layout, j, world_size, seqlen)] = j * s_max + torch.arange(sizes[j])
    if world_size * s_max == seqlen and bool((idx == torch.arange(seqlen)).all()):
        return None
    return idx


@dataclass(frozen=True, eq=False)
class _Cfg:
    """What one call settled before any byte: its plan, the gather's order and padding, the group."""

    plan: StepPlan
    index: Tensor | None          # position -> row of the padded gather (None: identity)
    s_max: int
    local: int                    # this rank's shard length
    scale: float
    backend: str | None
    group: object
    nodes: Nodes
    grad_dtype: torch.dtype
    regather: bool


def _gather(x: Tensor, cfg: _Cfg, phase: str, kind: str) -> Tensor:
    """(B, S, Zkv, d) local shard -> (B, N, Zkv, d) in position order, through a counted all-gather of the
    shard padded to S_max rows."""
    if x.shape[1] < cfg.s_max:
        pad = x.new_zeros((x.shape[0], cfg.s_max - x.shape[1]) + tuple(x.shape[2:]))
        x = torch.cat([x, pad], dim=1)
    full = all_gather_(x, 1, cfg.group, phase, kind, cfg.nodes)       # (B, G*S_max, Zkv, d), rank order
    return full if cfg.index is None else full.index_select(1, cfg.index.to(full.device))


def _scatter(g: Tensor, cfg: _Cfg, kind: str) -> Tensor:
    """(B, N, Zkv, d) gradient in position order -> this rank's (B, S, Zkv, d) rows summed over ranks,
    through a counted reduce-scatter in ``grad_dtype`` of the padded rank-order buffer."""
    g = g.to(cfg.grad_dtype)
    if cfg.index is not None:
        rows = cfg.s_max * comm.world(cfg.group)[1]
        padded = g.new_zeros((g.shape[0], rows) + tuple(g.shape[2:]))
        g = padded.index_copy_(1, cfg.index.to(g.device), g)
    return reduce_scatter_(g, 1, cfg.group, "backward", kind, cfg.nodes)[:, :cfg.local]


class _AllGatherKV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cfg: _Cfg):
        kf, vf = _gather(k, cfg, "forward", "k"), _gather(v, cfg, "forward", "v")
        state = RowState(q)
        forward_tiles(state, cfg.plan, q, kf, vf, cfg.scale, cfg.backend)
        out, lse = state.result()
        out = out.to(q.dtype)
        # regather: the local shards (backward gathers them again); else the gathered K, V themselves
        ctx.save_for_backward(q, *((k, v) if cfg.regather else (kf, vf)), out, lse)
        ctx.cfg, ctx.kv_dtype = cfg, k.dtype
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        cfg = ctx.cfg
        if cfg.regather:
            k, v = _gather(k, cfg, "backward", "k"), _gather(v, cfg, "backward", "v")
        acc = stats_dtype(q.dtype)
        dout = dout.contiguous()
        dq, dk, dv = (GradAcc(t, acc, torch.zeros_like(t, dtype=acc, memory_format=torch.contiguous_format))
                      for t in (q, k, v))
        backward_tiles(cfg.plan, dout, q, k, v, lse, compute_delta(dout, out), cfg.scale, cfg.backend, dq, dk, dv)
        dk_local, dv_local = _scatter(dk.t, cfg, "dk"), _scatter(dv.t, cfg, "dv")
        return dq.t.to(q.dtype), dk_local.to(ctx.kv_dtype), dv_local.to(ctx.kv_dtype), None


def allgather_kv_attn_func(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False, mask=None,
                           softmax_scale: float | None = None, group=None, layout="contiguous",
                           backend: str | None = None, grad_comm_dtype: torch.dtype | None = None,
                           regather: bool = True, return_lse: bool = False, node_size: int | None = None,
                           seqlen: int | None = None):
    """All-gather CP on local shards: q (B, N/G, Z, d), k/v (B, N/G, Zkv, d) -> out (B, N/G, Z, d), and with
    ``return_lse`` the global log-sum-exp of the local rows (B, Z, N/G) in the statistics dtype.

    Same inputs and rules as ``burst_impl.burst_attn_func`` (any mask of ``burst_impl.masks`` over global
    positions, any layout, any N >= the layout's chunks, GQA with Z a multiple of Zkv, any strides), all
    validated before the first byte (``validate_call``). ``regather``: all-gather K, V again in backward
    (True) or keep the gathered ones (False); ``grad_comm_dtype``: dtype of the dK, dV reduce-scatter
    (None: fp32, fp64 for fp64 inputs); ``node_size``: ranks per node, the link class of the counted bytes.
    """
    call = validate_call(q, k, v, layout=layout, softmax_scale=softmax_scale, backend=backend,
                         grad_comm_dtype=grad_comm_dtype, group=group, causal=causal, mask=mask,
                         method="allgather_kv", options={"regather": regather, "node_size": node_size},
                         seqlen=seqlen, checks=(lambda: check_regather(regather),))
    rank, world_size = comm.world(group)
    cfg = _Cfg(plan=gathered_plan(call.mask, call.layout, rank, world_size, call.seqlen),
               index=position_index(call.layout, world_size, call.seqlen), s_max=max(call.lengths),
               local=call.lengths[rank], scale=default_scale(q.shape[-1], softmax_scale), backend=backend,
               group=group, nodes=Nodes.of(group, node_size),
               grad_dtype=grad_comm_dtype if grad_comm_dtype is not None else stats_dtype(q.dtype),
               regather=regather)
    out, lse = _AllGatherKV.apply(q, k, v, cfg)
    return (out, lse) if return_lse else out


def check_regather(regather) -> None:
    if not isinstance(regather, bool):
        raise ValueError(f"regather={regather!r} must be True (all-gather K, V again in backward) or False "
                         "(keep the gathered K, V)")


# ---------------------------------------------------------------- closed forms


def allgather_kv_bytes(s: AttnShape, regather: bool = True, grad_elem_size: int | None = None, **_
                       ) -> dict[tuple[str, str], int]:
    """``{(phase, kind): bytes}`` one rank sends (the same on every rank: the pieces are padded to S_max)."""
    G = s.world_size
    if G == 1:
        return {}
    f = volume.stats_size(s.elem_size) if grad_elem_size is None else grad_elem_size
    piece = s.batch * max(s.lengths) * s.kv_heads * s.head_dim * (G - 1)     # elements per tensor
    out = {("forward", "k"): piece * s.elem_size, ("forward", "v"): piece * s.elem_size,
           ("backward", "dk"): piece * f, ("backward", "dv"): piece * f}
    if regather:
        out.update({("backward", "k"): piece * s.elem_size, ("backward", "v"): piece * s.elem_size})
    return out


def allgather_kv_link_bytes(s: AttnShape, rank: int, node_size=None, **options) -> dict[tuple[str, str, str], int]:
    """Ring collectives over the group: all of a rank's bytes on its hop to the next rank."""
    return volume.split_by_link(allgather_kv_bytes(s, **options),
                                volume.ring_hops(formula_nodes(s.world_size, node_size), rank))


def allgather_kv_memory(s: AttnShape, regather: bool = True, **_) -> int:
    """Activation bytes one rank keeps for backward: q, out, lse of its shard and, with ``regather``, its k, v
    shards (the ring family's ``volume.saved_bytes``); without, the gathered K, V (B, N, Zkv, d) instead."""
    kept = volume.saved_bytes(s)
    if regather:
        return kept
    kv = 2 * s.kv_heads * s.head_dim * s.elem_size
    return kept - s.rows * kv + s.batch * s.seqlen * kv


def _grad_elem(options: dict) -> int | None:
    dtype = options.get("grad_comm_dtype")
    return None if dtype is None else torch.empty((), dtype=dtype).element_size()


def _bytes(s, rank=0, regather=True, **options):
    return allgather_kv_bytes(s, regather, _grad_elem(options))


def _links(s, rank, node_size=None, regather=True, **options):
    return allgather_kv_link_bytes(s, rank, node_size, regather=regather, grad_elem_size=_grad_elem(options))


METHODS = (Method(
    name="allgather_kv", colour=26, marker="8", layouts=LAYOUT_NAMES, level="op", masks=True,
    fn=allgather_kv_attn_func, comm_bytes=_bytes, link_bytes=_links, memory_bytes=allgather_kv_memory,
    check=lambda s, regather=True, **_: check_regather(regather), schedule=Schedule("allgather_kv"),
    description="All-gather CP (Llama 3 CP, TransformerEngine all_gather, ring-flash-attn llama3): "
                "all-gather K, V, local attention of the rank's queries over all N under the mask, "
                "reduce-scatter dK, dV",
    travels="fwd: all-gather of K, V; bwd: all-gather of K, V again, reduce-scatter of dK, dV (fp32)",
    external="TransformerEngine AttnFuncWithCPAndKVAllGather, ring-flash-attn llama3 (not wrapped)",
),)
