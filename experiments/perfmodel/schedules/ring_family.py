"""BurstAttention and the blockwise ring: ``burst`` (auto backward), ``burst_qring``, ``ring``,
``ring_flash_attn``; and the ring part of ``usp``.

Forward (burst_impl.attention.ring_forward): K, V circulate for n steps; at
step s ring index i computes its queries against the block of owner (i-s) mod n,
only the tiles of the pair's plan under the case's mask (``burst_impl.plan``), then
merges (O, lse) in fp32 (HBM-bound). Backward: what travels is what the
registry's formula says travels for this shape (so ``burst``'s auto choice is
the registry's): the query side (Q, dO, lse, delta, with dQ on the
accumulator ring) or the key/value side (K, V, with dK, dV on it). Each step
runs the flash backward kernel on the live part of the pair and adds the block
gradients into fp32 accumulators. ``ring_flash_attn`` sends its dK/dV
accumulators at every one of the n steps (its registry formula has n sends).

``materialised=True`` is the paper's "Burst without LAO": each step's local
attention writes its (rows x cols) scores to HBM instead of running a flash
kernel (a model-only variant, not a registry method).
"""
from __future__ import annotations

from burst_impl.layout import group_layout
from burst_impl.plan import StepPlan, step_plan

from ..costs import FP32
from .common import Ctx, accumulate_bytes, hbm_step, merge_bytes, sequence_parallel
from .double_ring import pass_for
from .tiles import tile_cost, tile_size

QSIDE = ("q", "dout", "lse", "delta")
KVSIDE = ("k", "v")


def _plan(ctx: Ctx, q_idx: int, kv_idx: int, local: int, n: int) -> StepPlan:
    """The plan of a step between ring indices (``n`` ranks of ``local`` tokens; USP's ring level
    holds the union of a Ulysses group's shards)."""
    s = ctx.shape
    layout = s.resolved_layout
    if n != s.world_size:
        layout = group_layout(layout, s.world_size, s.world_size // n)
    return step_plan(s.attn_mask, layout, q_idx, kv_idx, local * n, n)


def _kernel(ctx: Ctx, *, heads: int, plan: StepPlan, local: int, mode: str, materialised: bool):
    """(seconds, FLOPs) of the tiles of one step: a flash kernel per tile on its live entries (a
    causal tile at the convention's half) under its tile mask (``tiles.tile_cost``), or materialised
    scores over each tile."""
    s = ctx.shape
    t = f = 0.0
    for tile in plan.tiles:
        if materialised:
            rows, cols = tile_size(tile.rows, local), tile_size(tile.cols, local)
            # forward: write S, read S (softmax), write P, read P (PV); backward adds dP, dS and rereads
            dt, df = ctx.cost.materialised_attention(s.batch, heads, s.head_dim, rows, cols, mode, elem=ctx.elem,
                                                     score_passes=4 if mode == "forward" else 8)
        else:
            dt, df, _, _ = tile_cost(ctx, tile, heads=heads, mode=mode, n_rows=local, n_cols=local, exact=False)
        t, f = t + dt, f + df
    return t, f


def _step_cost(ctx: Ctx, q_idx: int, kv_idx: int, *, local: int, n: int, heads: int, mode: str,
               materialised: bool) -> tuple[float, float, int, int] | None:
    """(seconds, FLOPs, live rows, live columns) of one ring step's kernel, None for a skipped pair.

    Memoised on the cost model: the plan and its cost depend only on the key below, and every
    method of a case (and the forward and backward of one) asks for the same pairs."""
    s = ctx.shape
    key = ("ring_step", s.attn_mask.key, s.resolved_layout, s.world_size, s.batch, s.head_dim, q_idx, kv_idx,
           local, n, heads, mode, materialised)
    memo = ctx.cost.memo
    if key not in memo:
        plan = _plan(ctx, q_idx, kv_idx, local, n)
        if plan.empty:
            memo[key] = None
        else:
            t, f = _kernel(ctx, heads=heads, plan=plan, local=local, mode=mode, materialised=materialised)
            memo[key] = (t, f, min(local, sum(tile_size(x.rows, local) for x in plan.tiles)),
                         min(local, sum(tile_size(x.cols, local) for x in plan.tiles)))
    return memo[key]


def ring_forward(ctx: Ctx, rings: list[list[int]], ready: dict, *, local: int, heads: int, kv_heads: int,
                 name: str = "ring_fwd", materialised: bool = False, topology: str = "flat",
                 overlap: bool = True) -> dict:
    s = ctx.shape
    n = len(rings[0])
    hop = ctx.take("forward", KVSIDE)

    def work(i, owner, step):
        cost = _step_cost(ctx, i, owner, local=local, n=n, heads=heads, mode="forward",
                          materialised=materialised)
        if cost is None:
            return []
        t, f, rows, _ = cost
        out = [("attn_fwd", t, f)]
        if step > 0:
            out.append(hbm_step(ctx, "merge", merge_bytes(s.batch, rows, heads, s.head_dim, ctx.elem)))
        return out

    per_send = sum(hop.values()) // max(1, n - 1)
    ctx.buffer("forward", "K/V blocks in flight (double buffer)", 2 * per_send)
    ctx.buffer("forward", "fp32 running output and lse", s.batch * local * heads * (s.head_dim + 1) * FP32)
    ctx.buffer("forward", "block output of the local kernel", s.batch * local * heads * s.head_dim * ctx.elem)
    if materialised:
        ctx.buffer("forward", "scores and probabilities of one block", 2 * s.batch * heads * local * local * ctx.elem)
    return pass_for(ctx, rings, topology=topology, overlap=overlap, phase="forward", name=name, hop=hop, work=work,
                    ready=ready)


def ring_backward(ctx: Ctx, rings: list[list[int]], ready: dict, *, local: int, heads: int, kv_heads: int,
                  default: str, name: str = "ring_bwd", materialised: bool = False, acc_sends: str = "n-1",
                  topology: str = "flat", overlap: bool = True) -> dict:
    """``default``: the scheme when the registry has no backward entries (world size 1)."""
    s = ctx.shape
    n = len(rings[0])
    if ("backward", "q") in ctx.table:
        scheme = "burst"
    elif ("backward", "k") in ctx.table:
        scheme = "ring"
    else:
        scheme = default
    if scheme == "burst":
        hop, acc = ctx.take("backward", QSIDE), ctx.take("backward", ("dq",))
        ctx.note("backward circulates the query side (Q, dO, lse, delta; dQ on the accumulator ring)")
    else:
        hop, acc = ctx.take("backward", KVSIDE), ctx.take("backward", ("dk", "dv"))
        ctx.note("backward circulates the key/value side (K, V; dK, dV on the accumulator ring)")
    b, d = s.batch, s.head_dim
    # delta = rowsum(dO * O) once per rank: read dO and O, write one fp32 per row and head
    delta = {g: ctx.compute(g, f"{name}.delta[r{g}]", ctx.cost.hbm(b * local * heads * (2 * d * ctx.elem + FP32)),
                            deps=[ready.get(g)], phase="backward") for r in rings for g in r}

    def work(i, owner, step):
        q_rank, kv_rank = (owner, i) if scheme == "burst" else (i, owner)
        cost = _step_cost(ctx, q_rank, kv_rank, local=local, n=n, heads=heads, mode="backward",
                          materialised=materialised)
        if cost is None:
            return []
        t, f, rows, cols = cost
        adds = accumulate_bytes(b, rows, heads, d) + 2 * accumulate_bytes(b, cols, kv_heads, d)
        return [("attn_bwd", t, f), hbm_step(ctx, "accumulate", adds)]

    end = pass_for(ctx, rings, topology=topology, overlap=overlap, phase="backward", name=name, hop=hop, work=work,
                   ready=delta, acc=acc, acc_sends=acc_sends)
    travelling = heads if scheme == "burst" else 2 * kv_heads
    per_send = sum(hop.values()) // max(1, n - 1)
    per_acc = sum(acc.values()) // max(1, n - (1 if acc_sends == "n-1" else 0))
    ctx.buffer("backward", "circulating blocks in flight (double buffer)", 2 * per_send)
    # the rank's own accumulator is among the home gradients below (counted once: measured on CPU,
    # tests/test_step_memory.py, the attention-backward moment)
    ctx.buffer("backward", "accumulators: outgoing, incoming", 2 * per_acc)
    ctx.buffer("backward", "fp32 home gradients and block gradients",
               2 * b * local * (heads + 2 * kv_heads) * d * FP32)
    if materialised:
        ctx.buffer("backward", "scores, probabilities, dP, dS of one block", 4 * b * heads * local * local * FP32)
    # the owner adds the accumulator that comes home after the last step
    return {g: ctx.compute(g, f"{name}.finish[r{g}]",
                           ctx.cost.hbm(accumulate_bytes(b, local, travelling, d)), deps=[end[g]], phase="backward")
            for g in end}


def flat(ctx: Ctx, *, default: str, materialised: bool = False, acc_sends: str = "n-1", topology: str = "flat",
         overlap: bool = True) -> dict:
    """The ring family (``Schedule("ring", ...)``): the flat or the double ring (``topology``), the
    query- or key/value-circulating backward by default (``default``: the registry's byte table says
    which travels), ``acc_sends="n"`` for an implementation that sends its accumulators at each of
    the G backward steps, ``materialised`` for a step that writes its block's scores to HBM."""
    if materialised:
        ctx.note("Burst without LAO (model-only variant): every ring step materialises its block's scores in HBM")
    if acc_sends == "n":
        ctx.note("ring-flash-attn sends its fp32 dK/dV accumulators at each of the G backward steps")
    s = ctx.shape
    rings = [list(range(s.world_size))]
    local = s.seqlen // s.world_size
    kw = dict(local=local, heads=s.heads, kv_heads=s.kv_heads, topology=topology, overlap=overlap)
    if s.world_size > 1 and topology == "flat":
        ctx.note("flat ring over all ranks in rank order; a synchronous step waits for its slowest hop "
                 "(the inter-node hop on multi-node runs)")
    if not overlap:
        ctx.note("overlap off: every transfer is waited for before the step computes")
    return sequence_parallel(
        ctx,
        lambda ready: ring_forward(ctx, rings, ready, materialised=materialised, **kw),
        lambda ready: ring_backward(ctx, rings, ready, default=default, materialised=materialised,
                                    acc_sends=acc_sends, **kw))
