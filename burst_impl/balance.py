"""Work balance of a layout under a mask, and balanced layouts (docs/papers.md §2, last bullet).

Work metric. A rank's work is the number of live (query, key) score entries
it computes over a whole ring pass: those of its query rows in the forward
and in the key/value-circulating backward (queries stay), those of its key
columns in Burst's query-circulating backward (keys stay). ``work_per_rank``
gives both; the imbalance of a layout is max/mean over ranks (the slowest
rank sets the step time; 1.0 is perfect).

Balanced layout (``"balanced"``, or ``"balanced:K"``): the sequence is cut
into K*G equal chunks (K per rank, default ``DEFAULT_CHUNKS_PER_RANK``) and
the chunks are assigned to ranks, K each, so that both the row work and the
column work are as even as possible:

1. greedy, longest processing time first: chunks by decreasing (normalised
   row + column) work, each to the rank with room whose load stays lowest
   (MagiAttention's min-heap dispatch, ``dispatch_solver.py``, with the
   equal-count constraint and two work vectors);
2. local search: swap a chunk of the worst rank with any chunk of another
   rank while that lowers max(row max/mean, column max/mean); every candidate
   swap of a chunk is evaluated at once (vectorised), so G=32, K=8 takes
   milliseconds.

Chunks keep their position order within a rank (fewer, longer runs for the
plans). The layout is a ``layout.ChunkLayout``, cached per (mask, N, G, K).
"""
from __future__ import annotations

import functools

import torch

from .layout import BALANCED, ChunkLayout, check_layout, chunk_bounds, is_balanced_name, positions
from .masks import Mask

Tensor = torch.Tensor
DEFAULT_CHUNKS_PER_RANK = 8
_SEARCH_ROUNDS = 500


def work_per_rank(mask: Mask, layout, seqlen: int, world_size: int) -> dict[str, list[int]]:
    """``{"rows": [...], "cols": [...]}``: live score entries of each rank's query rows and key columns."""
    rows, cols = mask.row_counts(seqlen), mask.col_counts(seqlen)
    out: dict[str, list[int]] = {"rows": [], "cols": []}
    for r in range(world_size):
        p = positions(layout, r, world_size, seqlen)
        out["rows"].append(int(rows[p].sum()))
        out["cols"].append(int(cols[p].sum()))
    return out


def imbalance(work) -> float:
    """max/mean of per-rank work (1.0 = perfectly even; 1.0 for no work at all)."""
    w = torch.as_tensor(work, dtype=torch.float64)
    mean = float(w.mean())
    return float(w.max()) / mean if mean > 0 else 1.0


def balance_report(mask: Mask, layout, seqlen: int, world_size: int) -> dict:
    """The per-rank work and its imbalance, as recorded with every result."""
    w = work_per_rank(mask, layout, seqlen, world_size)
    return {"work_rows_per_rank": w["rows"], "work_cols_per_rank": w["cols"],
            "work_imbalance_rows": imbalance(w["rows"]), "work_imbalance_cols": imbalance(w["cols"])}


def chunk_work(mask: Mask, seqlen: int, n_chunks: int) -> tuple[Tensor, Tensor]:
    """(row work, column work) of each of ``n_chunks`` chunks (``layout.chunk_bounds``: lengths differ by at
    most one token), float64."""
    sizes = [b - a for a, b in chunk_bounds(seqlen, n_chunks)]
    rows = torch.stack([c.sum() for c in mask.row_counts(seqlen).double().split(sizes)])
    cols = torch.stack([c.sum() for c in mask.col_counts(seqlen).double().split(sizes)])
    return rows, cols


def _objective(r_load: Tensor, c_load: Tensor, r_mean: float, c_mean: float) -> float:
    return max(float(r_load.max()) / r_mean, float(c_load.max()) / c_mean)


def assign(rows: Tensor, cols: Tensor, world_size: int, per_rank: int, *, search: bool = True
           ) -> list[list[int]]:
    """Chunks -> ranks (``per_rank`` each) minimising max(row max/mean, column max/mean).
    ``search=False``: the greedy step alone (the min-heap dispatch, for comparison)."""
    n = rows.numel()
    r_mean = max(float(rows.sum()) / world_size, 1e-30)
    c_mean = max(float(cols.sum()) / world_size, 1e-30)
    rn, cn = rows / r_mean, cols / c_mean
    # 1. greedy LPT with the equal-count constraint
    owner = torch.empty(n, dtype=torch.long)
    r_load = torch.zeros(world_size, dtype=torch.float64)
    c_load = torch.zeros(world_size, dtype=torch.float64)
    count = [0] * world_size
    for x in torch.argsort(rn + cn, descending=True, stable=True).tolist():
        room = [g for g in range(world_size) if count[g] < per_rank]
        g = min(room, key=lambda g: (max(r_load[g] + rn[x], c_load[g] + cn[x]), g))
        owner[x] = g
        count[g] += 1
        r_load[g] += rn[x]
        c_load[g] += cn[x]
    # 2. local search: best swap of a chunk of the worst rank with a chunk elsewhere
    for _ in range(_SEARCH_ROUNDS if world_size > 1 and search else 0):
        cur = _objective(r_load, c_load, 1.0, 1.0)
        w = int(torch.argmax(torch.maximum(r_load, c_load)))
        others = torch.nonzero(owner != w).flatten()
        s = owner[others]                                           # the rank of each candidate partner
        best, best_pair = cur - 1e-12, None
        for x in torch.nonzero(owner == w).flatten().tolist():
            dr, dc = rn[others] - rn[x], cn[others] - cn[x]         # what moves into w
            nr_w, nc_w = r_load[w] + dr, c_load[w] + dc
            nr_s, nc_s = r_load[s] - dr, c_load[s] - dc
            # the largest load among ranks other than w and s
            rest_r = _max_excluding(r_load, w, s)
            rest_c = _max_excluding(c_load, w, s)
            obj = torch.stack([nr_w, nc_w, nr_s, nc_s, rest_r, rest_c]).max(0).values
            i = int(torch.argmin(obj))
            if float(obj[i]) < best:
                best, best_pair = float(obj[i]), (x, int(others[i]))
        if best_pair is None:
            break
        x, y = best_pair
        gx, gy = int(owner[x]), int(owner[y])
        owner[x], owner[y] = gy, gx
        for load, v in ((r_load, rn), (c_load, cn)):
            load[gx] += v[y] - v[x]
            load[gy] += v[x] - v[y]
    return [sorted(torch.nonzero(owner == g).flatten().tolist()) for g in range(world_size)]


def _max_excluding(load: Tensor, w: int, s: Tensor) -> Tensor:
    """For each rank s[i]: the largest load over ranks other than w and s[i]."""
    masked = load.clone()
    masked[w] = float("-inf")
    top2 = torch.topk(masked, min(2, masked.numel())).indices
    first = top2[0]
    second_val = masked[top2[1]] if top2.numel() > 1 else torch.tensor(float("-inf"), dtype=load.dtype)
    return torch.where(s == first, second_val, masked[first])


@functools.lru_cache(maxsize=256)
def _balanced(mask: Mask, seqlen: int, world_size: int, per_rank: int) -> ChunkLayout:
    rows, cols = chunk_work(mask, seqlen, world_size * per_rank)
    chunks = assign(rows, cols, world_size, per_rank)
    return ChunkLayout(tuple(tuple(c) for c in chunks), name=f"{BALANCED}:{per_rank}")


def balanced_layout(mask: Mask, seqlen: int, world_size: int, per_rank: int = DEFAULT_CHUNKS_PER_RANK
                    ) -> ChunkLayout:
    """The balanced ChunkLayout of ``mask`` for N=``seqlen`` tokens on ``world_size`` ranks."""
    if isinstance(per_rank, bool) or not isinstance(per_rank, int) or per_rank <= 0:
        raise ValueError(f"layout='balanced:{per_rank}': chunks per rank must be a positive integer")
    n = world_size * per_rank
    if seqlen < n:
        raise ValueError(f"layout='balanced:{per_rank}' cannot split seqlen={seqlen}: the rule is seqlen >= number "
                         f"of chunks = {n} ({per_rank} chunks per rank x world_size={world_size}), so that every "
                         f"chunk holds a token; choose a longer N or 'balanced:K' with K*G <= N")
    return _balanced(mask, seqlen, world_size, per_rank)


def chunks_of(layout: str) -> int:
    """K of ``"balanced:K"`` (``DEFAULT_CHUNKS_PER_RANK`` for ``"balanced"``)."""
    if layout == BALANCED:
        return DEFAULT_CHUNKS_PER_RANK
    try:
        return int(layout.split(":", 1)[1])
    except ValueError:
        raise ValueError(f"layout={layout!r}: expected 'balanced' or 'balanced:K' with K chunks per rank") from None


def resolve_layout(layout, mask: Mask, seqlen: int, world_size: int):
    """A named layout or ChunkLayout as is (checked); ``"balanced[:K]"`` -> the balanced ChunkLayout."""
    if is_balanced_name(layout):
        return balanced_layout(mask, seqlen, world_size, chunks_of(layout))
    check_layout(layout)
    return layout
