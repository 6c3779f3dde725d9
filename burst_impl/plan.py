"""Plans as data: what one ring step computes (MagiAttention's plan-vs-runtime split).

A ring step pairs the query shard of rank ``a`` with the key/value shard of
rank ``b``. Its plan (``StepPlan``) is a short tuple of ``Tile``s: local query
rows x local key/value columns and the kernel-level mask of that rectangle
(``kernels.TileMask``: none, causal diagonal, band, documents or dense). The
tiles cover the live (query, key) pairs of the pair exactly once; a pair with
no tile is fully masked and is skipped (no compute; its block still travels
the ring, so bytes stay those of ``burst_impl.volume``).

Plans depend only on the mask, the global positions of the two shards
(layout, ranks, world size, N) and nothing else: not on the ring step, so
any transport (single ring, double ring) can use them, and they are built
without a process group and tested on their own (tests/test_masks.py). They
are cached per (mask, layout, a, b, N, G); the hot path looks a plan up and
loops over its tiles.

How a plan is made: each shard's positions are cut into runs
(``layout.runs``), every (q run, k run) pair is classified by the mask
(``Mask.pieces``: no per-token work for band, document and aligned
block-sparse masks), full pieces sharing their rows (then their columns) are
merged into one kernel call (columns gathered), and every other piece
becomes a tile with its own mask. Two shortcuts keep the common cases at one
kernel call per step: the full mask, and the causal mask on a rank's own
sorted shard (top-left causal on the whole shard, as before).
"""
from __future__ import annotations

import contextlib
from collections import OrderedDict, defaultdict
from dataclasses import dataclass, field

import torch

from .kernels.common import TileMask
from .layout import lengths, positions, runs, runs_of
from .masks import Causal, Full, Mask, Piece

Tensor = torch.Tensor
ALL = slice(None)
_CACHE_SIZE = 4096


@dataclass(frozen=True, eq=False)
class Tile:
    """One kernel call: local query ``rows`` x local key/value ``cols`` (a slice, or a LongTensor of
    indices gathered into one call), under ``mask`` (None: every pair attends)."""

    rows: slice | Tensor
    cols: slice | Tensor
    mask: TileMask | None
    entries: int                 # live (query, key) pairs
    on_device: dict = field(default_factory=dict, repr=False, compare=False)   # device -> (rows, cols)

    @property
    def kind(self) -> str:
        return "full" if self.mask is None else self.mask.kind

    def on(self, device: torch.device) -> tuple[slice | Tensor, slice | Tensor]:
        """(rows, cols) with their index tensors on ``device``, moved once per device: plans are cached
        and used at every ring step, where a host-to-device copy would also wait for the stream."""
        if isinstance(self.rows, slice) and isinstance(self.cols, slice):
            return self.rows, self.cols
        sel = self.on_device.get(device)
        if sel is None:
            sel = self.on_device[device] = tuple(x if isinstance(x, slice) else x.to(device)
                                                 for x in (self.rows, self.cols))
        return sel


@dataclass(frozen=True, eq=False)
class StepPlan:
    tiles: tuple[Tile, ...]
    n_rows: int
    n_cols: int

    @property
    def empty(self) -> bool:
        return not self.tiles

    @property
    def entries(self) -> int:
        return sum(t.entries for t in self.tiles)


# ---------------------------------------------------------------- building


def _ranges_to_sel(ranges: list[tuple[int, int]], n: int) -> slice | Tensor:
    ranges = sorted(ranges)
    merged: list[list[int]] = []
    for a, b in ranges:
        if merged and merged[-1][1] == a:
            merged[-1][1] = b
        else:
            merged.append([a, b])
    if len(merged) == 1:
        a, b = merged[0]
        return ALL if (a, b) == (0, n) else slice(a, b)
    return torch.cat([torch.arange(a, b) for a, b in merged])


def _size(sel, n: int) -> int:
    if isinstance(sel, slice):
        return len(range(*sel.indices(n)))
    return sel.numel()


def _tile_mask(p: Piece, restrict: bool = True) -> TileMask | None:
    nr, nc = p.r1 - p.r0, p.c1 - p.c0
    if p.kind == "full":
        return None
    return TileMask(p.kind, nr, nc, lo=p.lo, hi=p.hi, cu=p.cu, rows_fn=p.rows_fn, restrict=restrict)


def _merge_full(pieces: list[Piece], nq: int, nk: int) -> list[Tile]:
    """Full pieces: those with the same rows share one call (columns gathered), then those with
    the same column set share one call (rows gathered). Both steps keep every (row, col) full."""
    by_rows: dict[tuple[int, int], list[tuple[int, int]]] = defaultdict(list)
    for p in pieces:
        by_rows[(p.r0, p.r1)].append((p.c0, p.c1))
    by_cols: dict[tuple, list[tuple[int, int]]] = defaultdict(list)
    for rows, cols in by_rows.items():
        by_cols[tuple(sorted(cols))].append(rows)
    tiles = []
    for cols, rows in by_cols.items():
        n_r = sum(b - a for a, b in rows)
        n_c = sum(b - a for a, b in cols)
        tiles.append(Tile(_ranges_to_sel(rows, nq), _ranges_to_sel(list(cols), nk), None, n_r * n_c))
    return tiles


def build_plan(mask: Mask, q_runs, k_runs, nq: int, nk: int, *, same_shard: bool = False,
               skip: bool = True, q_pos: Tensor | None = None, k_pos: Tensor | None = None) -> StepPlan:
    """The plan of a (query shard, key/value shard) pair given their position runs.

    ``same_shard``: the two shards are the same positions (a rank's own step). ``skip=False``
    (benchmarks only) computes the whole pair under a dense mask, skipping nothing; it needs
    ``q_pos``/``k_pos``.
    """
    if not skip:
        def rows_fn(a, b, qp=q_pos, kp=k_pos):
            return mask.allowed(qp[a:b], kp)
        return StepPlan((Tile(ALL, ALL, TileMask("dense", nq, nk, rows_fn=rows_fn, restrict=False),
                              int(sum(int(rows_fn(i, i + 1024).sum()) for i in range(0, nq, 1024)))),), nq, nk)
    if isinstance(mask, Full):
        return StepPlan((Tile(ALL, ALL, None, nq * nk),), nq, nk)
    if isinstance(mask, Causal) and same_shard and _sorted(q_runs):
        # Both sides list the same positions in increasing order: top-left causal on the whole
        # shard is exactly the mask (contiguous, zigzag and striped own blocks).
        return StepPlan((Tile(ALL, ALL, TileMask("causal", nq, nk), nq * (nq + 1) // 2),), nq, nk)
    pieces = [p.shifted(qr.offset, kr.offset) for qr in q_runs for kr in k_runs for p in mask.pieces(qr, kr)]
    full = [p for p in pieces if p.kind == "full"]
    tiles = _merge_full(full, nq, nk)
    for p in pieces:
        if p.kind != "full":
            tiles.append(Tile(_ranges_to_sel([(p.r0, p.r1)], nq), _ranges_to_sel([(p.c0, p.c1)], nk),
                              _tile_mask(p), p.entries))
    return StepPlan(tuple(tiles), nq, nk)


def _sorted(rs) -> bool:
    return all(a.start + a.stride * (a.count - 1) < b.start for a, b in zip(rs, rs[1:]))


# ---------------------------------------------------------------- cached lookups

_plans: "OrderedDict[tuple, StepPlan]" = OrderedDict()
_skip = True


def _cached(key: tuple, make) -> StepPlan:
    plan = _plans.get(key)
    if plan is None:
        plan = _plans[key] = make()
        if len(_plans) > _CACHE_SIZE:
            _plans.popitem(last=False)
    else:
        _plans.move_to_end(key)
    return plan


def step_plan(mask: Mask, layout, a: int, b: int, seqlen: int, world_size: int) -> StepPlan:
    """Plan for the queries of rank ``a`` against the keys/values of rank ``b`` (``layout``
    resolved: a name or a ChunkLayout)."""
    key = ("step", mask.key, layout, a, b, seqlen, world_size, _skip)

    def make():
        sizes = lengths(layout, world_size, seqlen)   # the shards differ by a token where N does not split
        nq, nk = sizes[a], sizes[b]
        if not _skip:
            return build_plan(mask, None, None, nq, nk, skip=False, q_pos=positions(layout, a, world_size, seqlen),
                              k_pos=positions(layout, b, world_size, seqlen))
        return build_plan(mask, runs(layout, a, world_size, seqlen), runs(layout, b, world_size, seqlen), nq, nk,
                          same_shard=a == b)
    return _cached(key, make)


def local_plan(mask: Mask, seqlen: int) -> StepPlan:
    """Plan of the whole sequence in position order against itself (single-device attention,
    Ulysses after its all-to-all)."""
    key = ("local", mask.key, seqlen, _skip)

    def make():
        pos = torch.arange(seqlen)
        if not _skip:
            return build_plan(mask, None, None, seqlen, seqlen, skip=False, q_pos=pos, k_pos=pos)
        r = runs_of(pos)
        return build_plan(mask, r, r, seqlen, seqlen, same_shard=True)
    return _cached(key, make)


@contextlib.contextmanager
def no_skipping():
    """Inside the block every plan is the whole pair under a dense mask: nothing skipped, nothing
    trimmed (what computing masks without plans costs; the skip benchmark's baseline)."""
    global _skip
    old, _skip = _skip, False
    try:
        yield
    finally:
        _skip = old


def entries_matrix(mask: Mask, layout, seqlen: int, world_size: int) -> Tensor:
    """(G, G) live entries of every (q rank, kv rank) pair, from the plans."""
    g = world_size
    return torch.tensor([[step_plan(mask, layout, a, b, seqlen, g).entries for b in range(g)] for a in range(g)])
