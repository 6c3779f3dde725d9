"""The flash kernels of a plan: what each tile of a ``burst_impl.plan.StepPlan`` costs on the cost model.

A plan's tiles are the kernel calls the implementation makes (the ring methods per step, ``allgather_kv``
per rank, Ulysses and TP on the whole sequence through ``burst_impl.local``): each is costed with its tile
mask, so the cost model sees what the kernel runs (a varlen tile's documents, a band's width), read from
the plan and not derived again here.
"""
from __future__ import annotations

from burst_impl.masks import Causal, Full
from burst_impl.plan import StepPlan, Tile, local_plan

from .common import Ctx


def tile_size(sel, n: int) -> int:
    """Rows or columns a tile selects out of ``n`` (a slice, or a tensor of indices)."""
    return len(range(n)[sel]) if isinstance(sel, slice) else int(sel.numel())


def tile_cost(ctx: Ctx, tile: Tile, *, heads: int, mode: str, n_rows: int, n_cols: int,
              exact: bool) -> tuple[float, float, int, int]:
    """(seconds, FLOPs, rows, cols) of one tile's flash kernel. FLOPs: the tile's live entries where ``exact``
    or the tile is masked, else a full or causal tile at the convention (all its entries, or half)."""
    s = ctx.shape
    rows, cols = tile_size(tile.rows, n_rows), tile_size(tile.cols, n_cols)
    plain = tile.kind in ("full", "causal")
    t, f = ctx.cost.attention(s.batch, heads, s.head_dim, rows, cols, tile.kind == "causal", mode,
                              entries=tile.entries if exact or not plain else None, mask=tile.mask)
    return t, f, rows, cols


def plan_cost(ctx: Ctx, plan: StepPlan, *, heads: int, mode: str, exact: bool) -> tuple[float, float]:
    """(seconds, FLOPs) of every tile of ``plan``, one kernel call after another."""
    t = f = 0.0
    for tile in plan.tiles:
        dt, df, _, _ = tile_cost(ctx, tile, heads=heads, mode=mode, n_rows=plan.n_rows, n_cols=plan.n_cols,
                                 exact=exact)
        t, f = t + dt, f + df
    return t, f


def whole_sequence(ctx: Ctx, heads: int, mode: str) -> tuple[float, float]:
    """(seconds, FLOPs) of attention over the whole sequence for ``heads`` heads (Ulysses after its all-to-all,
    TP): the tiles of ``local_plan``, as ``burst_impl.local`` runs them; FLOPs sum to the mask's area
    (``burst_impl.flops.mask_area``: the convention for full and causal, the live entries otherwise)."""
    s = ctx.shape
    key = ("whole_sequence", s.attn_mask.key, s.seqlen, s.batch, s.head_dim, heads, mode)
    memo = ctx.cost.memo
    if key not in memo:
        plan = local_plan(s.attn_mask, s.seqlen)
        memo[key] = plan_cost(ctx, plan, heads=heads, mode=mode, exact=not isinstance(s.attn_mask, (Causal, Full)))
    return memo[key]
