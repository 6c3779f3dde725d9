"""``allgather_kv`` (baselines/methods/allgather_kv.py): all-gather K, V; local attention; reduce-scatter dK, dV.

Forward: two blocking ring all-gathers over the group (K, then V: NCCL's ring algorithm, G-1 steps each,
``common.ring_collective``), the permutation of the gathered blocks into position order (an HBM read and
write of both, skipped where the gather already is position order), then on each rank the tiles of its
own plan (``gathered_plan``: its queries against all N keys under the mask, the plan the implementation
runs), each tile after the first merged into the fp32 running output. Backward: with ``regather`` (the
registry's byte table has backward k, v) the two all-gathers again, delta, the backward kernel on the
same tiles with its fp32 accumulation, then the two reduce-scatters of dK, dV (G-1 steps each).
Nothing overlaps the collectives, as in the implementation (blocking calls). The rank with the most
live entries paces the step: its peers wait for it in the next collective.
"""
from __future__ import annotations

from baselines.methods.allgather_kv import gathered_plan, position_index
from burst_impl.masks import Causal, Full

from ..costs import FP32
from .common import Ctx, accumulate_bytes, merge_bytes, ring_collective, sequence_parallel
from .tiles import tile_cost


def _tiles(ctx: Ctx, rank: int, mode: str) -> tuple[float, float, float]:
    """(kernel seconds, FLOPs, HBM seconds of merges or accumulation) of ``rank``'s plan; memoised on the
    cost model like the ring steps (the forward and backward of every mode ask for the same plan)."""
    s = ctx.shape
    key = ("allgather_kv", s.attn_mask.key, s.resolved_layout, s.world_size, s.seqlen, s.batch, s.heads,
           s.kv_heads, s.head_dim, rank, mode)
    memo = ctx.cost.memo
    if key not in memo:
        plan = gathered_plan(s.attn_mask, s.resolved_layout, rank, s.world_size, s.seqlen)
        b, d, z, n = s.batch, s.head_dim, s.heads, s.seqlen
        # the plain causal mask counts at the suite's convention (half of each diagonal tile: N^2/2 in all,
        # burst_impl.flops); any other mask at its exact live entries, which is what its area counts
        plain = isinstance(s.attn_mask, (Causal, Full))
        t = f = hbm = 0.0
        for i, tile in enumerate(plan.tiles):
            dt, df, rows, cols = tile_cost(ctx, tile, heads=z, mode=mode, n_rows=plan.n_rows, n_cols=n, exact=not plain)
            t, f = t + dt, f + df
            if mode == "forward" and i > 0:
                hbm += ctx.cost.hbm(merge_bytes(b, rows, z, d, ctx.elem))
            elif mode == "backward":
                hbm += ctx.cost.hbm(accumulate_bytes(b, rows, z, d) + 2 * accumulate_bytes(b, cols, s.kv_heads, d))
        memo[key] = (t, f, hbm)
    return memo[key]


def _collectives(ctx: Ctx, ready: dict, *, phase: str, algo: str, kinds: tuple[str, ...]) -> dict:
    group = list(ctx.ranks)
    for kind in kinds:
        ready = ring_collective(ctx, group, phase=phase, name=f"{algo}_{kind}", nbytes=ctx.take(phase, (kind,)),
                                steps=len(group) - 1, ready=ready)
    return ready


def _local(ctx: Ctx, ready: dict, *, phase: str) -> dict:
    """Each rank's kernel over its plan and the HBM work around it."""
    mode = "forward" if phase == "forward" else "backward"
    out = {}
    for g in ctx.ranks:
        t, f, hbm = _tiles(ctx, g, mode)
        out[g] = ctx.compute(g, f"attn_{mode}[r{g}]", t, deps=[ready[g]], phase=phase, flops=f)
        if hbm > 0:     # one tile forward: it initialises the running output, no merge
            out[g] = ctx.compute(g, f"{'merge' if mode == 'forward' else 'accumulate'}[r{g}]", hbm,
                                 deps=[out[g]], phase=phase)
    return out


def _reorder(ctx: Ctx, ready: dict, *, phase: str, gathered: int) -> dict:
    s = ctx.shape
    if position_index(s.resolved_layout, s.world_size, s.seqlen) is None:
        return ready
    return {g: ctx.compute(g, f"reorder_kv.{phase}[r{g}]", ctx.cost.hbm(2 * gathered), deps=[ready[g]], phase=phase)
            for g in ready}


def allgather_kv(ctx: Ctx) -> dict:
    """``Schedule("allgather_kv")``. Whether the backward gathers K, V again is read from the registry's
    byte table (its backward k, v entries), as the ring family reads which side its backward circulates."""
    s = ctx.shape
    regather = ("backward", "k") in ctx.table
    b, n, d, e = s.batch, s.seqlen, s.head_dim, ctx.elem
    local = s.seqlen // s.world_size
    gathered = 2 * b * n * s.kv_heads * d * e               # K and V over all N tokens
    ctx.note("all-gather CP: blocking all-gathers of K, V; each rank's queries against all N keys; "
             "reduce-scatters of dK, dV" + ("; K, V gathered again in backward" if regather else
                                            "; the gathered K, V kept for backward"))

    def forward(ready):
        ready = _collectives(ctx, ready, phase="forward", algo="all_gather", kinds=("k", "v"))
        ready = _reorder(ctx, ready, phase="forward", gathered=gathered)
        ctx.buffer("forward", "gathered K, V (B, N, Zkv, d), and their rank-order copy", 2 * gathered)
        ctx.buffer("forward", "fp32 running output and lse", b * local * s.heads * (d + 1) * FP32)
        return _local(ctx, ready, phase="forward")

    def backward(ready):
        if regather:
            ready = _collectives(ctx, ready, phase="backward", algo="all_gather", kinds=("k", "v"))
            ready = _reorder(ctx, ready, phase="backward", gathered=gathered)
            ctx.buffer("backward", "gathered K, V again, and their rank-order copy", 2 * gathered)
        # delta = rowsum(dO * O): read dO and O, write one fp32 per row and head
        ready = {g: ctx.compute(g, f"delta[r{g}]", ctx.cost.hbm(b * local * s.heads * (2 * d * e + FP32)),
                                deps=[ready[g]], phase="backward") for g in ctx.ranks}
        ready = _local(ctx, ready, phase="backward")
        ctx.buffer("backward", "fp32 dK, dV over all N tokens, and the reduce-scatter's input (fp32 default)",
                   2 * 2 * b * n * s.kv_heads * d * FP32)
        ctx.buffer("backward", "fp32 dQ of the rank's rows", b * local * s.heads * d * FP32)
        return _collectives(ctx, ready, phase="backward", algo="reduce_scatter", kinds=("dk", "dv"))

    return sequence_parallel(ctx, forward, backward)
