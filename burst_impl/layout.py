"""Sequence layouts: how the N tokens are split over G devices (docs/papers.md §2, workload balance).

Named layouts:

* ``contiguous``: rank r holds tokens [r*N/G, (r+1)*N/G). With a causal mask
  the work is unbalanced: rank G-1 attends to everything, rank 0 to one block.
* ``zigzag``: the sequence is cut into 2G chunks; rank r holds chunks r and
  2G-1-r (in that order), so every rank has the same causal work.
* ``striped``: token t lives on rank t mod G (BurstEngine's striped layout);
  every block pair is (almost) a triangle, so causal work is balanced too.

``ChunkLayout``: an explicit assignment of N/C-token chunks to ranks (what a
balanced layout for a document, window or block-sparse mask is;
``burst_impl.balance``). The name ``"balanced"`` (or ``"balanced:K"``, K
chunks per rank) stands for the balanced ChunkLayout of the call's mask and
is resolved by ``burst_impl.balance.resolve_layout``; every function here
takes a named layout or a ChunkLayout.

``runs`` cuts a rank's positions into arithmetic runs (``masks.Run``), which
is what the masks classify (``burst_impl.plan``).

Any N. A sequence of N tokens cut into C chunks gives chunk i
``N // C + (1 if i < N % C else 0)`` tokens (``chunk_bounds``: the
``torch.tensor_split`` rule), so chunk lengths differ by at most one token
and every layout is defined for every N >= C (C = chunks per rank x G; G for
striped, where rank r holds ``ceil((N - r) / G)`` tokens). Zigzag's extra
tokens go to chunks 0, 1, ... (ranks 0, 1, ..., then ranks G-1, G-2, ... for
their second chunk), so rank lengths differ by at most one as well.
N < C (a chunk, or a rank, without tokens) is a ValueError naming the rule
``seqlen >= C``. ``lengths`` gives every rank's length for N: what each
rank of a ring needs to know to receive a block of another rank.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from .masks import Run

LAYOUTS = ("contiguous", "zigzag", "striped")          # named, mask-independent
BALANCED = "balanced"
LAYOUT_NAMES = LAYOUTS + (BALANCED,)                    # what a spec / AttnShape may name


@dataclass(frozen=True)
class ChunkLayout:
    """Rank r holds the chunks ``chunks[r]`` (global chunk ids, in local order) of a sequence cut
    into ``sum(len(c) for c in chunks)`` equal chunks; every rank holds the same number."""

    chunks: tuple[tuple[int, ...], ...]
    name: str = "chunks"

    @property
    def world_size(self) -> int:
        return len(self.chunks)

    @property
    def n_chunks(self) -> int:
        return sum(len(c) for c in self.chunks)

    @property
    def per_rank(self) -> int:
        return len(self.chunks[0])

    def validate(self) -> None:
        ids = sorted(i for c in self.chunks for i in c)
        if not self.chunks or ids != list(range(len(ids))) or len({len(c) for c in self.chunks}) != 1:
            raise ValueError(f"layout={self!r}: every rank must hold the same number of chunks and the chunks "
                             f"must be 0..C-1, each once")

    def __str__(self) -> str:
        return self.name


def is_balanced_name(layout) -> bool:
    return isinstance(layout, str) and (layout == BALANCED or layout.startswith(BALANCED + ":"))


def check_layout(layout) -> None:
    if isinstance(layout, GroupedLayout):
        check_layout(layout.base)
        return
    if isinstance(layout, ChunkLayout):
        layout.validate()
        return
    if is_balanced_name(layout):
        raise ValueError(f"layout={layout!r} depends on the mask; resolve it first "
                         "(burst_impl.balance.resolve_layout)")
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} is unknown; choose one of {LAYOUT_NAMES} or a ChunkLayout")


def chunks_per_rank(layout) -> int:
    if isinstance(layout, GroupedLayout):
        return chunks_per_rank(layout.base) * layout.degree
    check_layout(layout)
    if isinstance(layout, ChunkLayout):
        return layout.per_rank
    return 2 if layout == "zigzag" else 1


def check_seqlen(seqlen: int, layout, world_size: int, *, name: str = "seqlen") -> None:
    """ValueError unless a global sequence of ``seqlen`` splits as ``layout`` needs: every chunk (every
    rank, for striped) gets at least one token, ``seqlen >= chunks per rank x world_size``."""
    if isinstance(layout, (ChunkLayout, GroupedLayout)) and layout.world_size != world_size:
        raise ValueError(f"layout={layout} assigns chunks to {layout.world_size} ranks, not world_size={world_size}")
    if isinstance(layout, GroupedLayout):
        check_seqlen(seqlen, layout.base, layout.base_world_size, name=name)
        return
    n_chunks = chunks_per_rank(layout) * world_size
    if isinstance(seqlen, bool) or not isinstance(seqlen, int) or seqlen < n_chunks:
        raise ValueError(
            f"{name}={seqlen} must be >= {n_chunks} ({chunks_per_rank(layout)} chunk(s) per rank x "
            f"world_size={world_size}) for layout={str(layout)!r}: the rule is seqlen >= number of chunks, "
            "so that every chunk (and every rank) holds at least one token"
        )


def check_even(seqlen: int, layout, world_size: int, *, who: str, name: str = "seqlen") -> None:
    """ValueError unless ``seqlen`` splits into the layout's chunks exactly: for the methods whose
    collectives take equal shards (TP-V3's all-gather, the peer adapters), not for the ring and
    all-to-all methods, which take any N >= the chunks (issue 22)."""
    check_seqlen(seqlen, layout, world_size, name=name)
    n_chunks = chunks_per_rank(layout) * world_size
    if seqlen % n_chunks:
        raise ValueError(f"{name}={seqlen} must be a multiple of {n_chunks} ({chunks_per_rank(layout)} chunk(s) per "
                         f"rank x world_size={world_size}) for {who}: its collectives take equal shards (burst, "
                         f"ring, ring_rsa, ulysses and usp take any N >= {n_chunks})")


def chunk_bounds(seqlen: int, n_chunks: int) -> list[tuple[int, int]]:
    """[start, end) of each of ``n_chunks`` chunks of ``seqlen`` tokens: the first ``seqlen % n_chunks``
    chunks hold one token more (``torch.tensor_split``'s rule)."""
    base, extra = divmod(seqlen, n_chunks)
    out, start = [], 0
    for i in range(n_chunks):
        end = start + base + (i < extra)
        out.append((start, end))
        start = end
    return out


@functools.lru_cache(maxsize=4096)
def lengths(layout, world_size: int, seqlen: int) -> tuple[int, ...]:
    """Tokens held by each rank (rank order) for a global sequence of ``seqlen`` tokens."""
    return tuple(int(positions(layout, r, world_size, seqlen).numel()) for r in range(world_size))


def offsets(layout, world_size: int, seqlen: int) -> tuple[int, ...]:
    """Where each rank's shard starts in the concatenation of the shards in rank order (G+1 entries)."""
    out = [0]
    for n in lengths(layout, world_size, seqlen):
        out.append(out[-1] + n)
    return tuple(out)


def chunk_ids(layout, rank: int, world_size: int) -> list[int]:
    """Global chunk indices held by ``rank`` in local order (chunked layouts only)."""
    check_layout(layout)
    if isinstance(layout, ChunkLayout):
        return list(layout.chunks[rank])
    if layout == "striped":
        raise ValueError("layout='striped' is not made of chunks; use positions()")
    if layout == "contiguous":
        return [rank]
    return [rank, 2 * world_size - 1 - rank]


def positions(layout, rank: int, world_size: int, seqlen: int) -> torch.Tensor:
    """Global token positions of ``rank``'s shard in local order, shape (about seqlen/G,): chunk lengths
    from ``chunk_bounds`` (equal when the chunks divide N)."""
    check_seqlen(seqlen, layout, world_size)
    if isinstance(layout, GroupedLayout):
        return layout.positions(rank, seqlen)
    if layout == "striped":
        return torch.arange(rank, seqlen, world_size)
    bounds = chunk_bounds(seqlen, chunks_per_rank(layout) * world_size)
    return torch.cat([torch.arange(*bounds[i]) for i in chunk_ids(layout, rank, world_size)])


def runs_of(pos: torch.Tensor) -> tuple[Run, ...]:
    """Cut positions (local order) into maximal runs of consecutive tokens; a strided shard whose
    runs would all be single tokens (striped) is one run with its stride."""
    n = pos.numel()
    if n == 0:
        return ()
    diff = pos[1:] - pos[:-1]
    if n > 2 and bool((diff == diff[0]).all()) and int(diff[0]) > 1:
        return (Run(int(pos[0]), int(diff[0]), n, 0),)
    cuts = [0] + (torch.nonzero(diff != 1).flatten() + 1).tolist() + [n]
    return tuple(Run(int(pos[a]), 1, b - a, a) for a, b in zip(cuts, cuts[1:]))


@functools.lru_cache(maxsize=4096)
def runs(layout, rank: int, world_size: int, seqlen: int) -> tuple[Run, ...]:
    """``runs_of(positions(...))``, cached per (layout, rank, world size, N)."""
    return runs_of(positions(layout, rank, world_size, seqlen))


@dataclass(frozen=True)
class GroupedLayout:
    """Ring rank i of ``world_size`` = G/degree holds the union of the ``base`` shards of ranks
    i*degree .. i*degree+degree-1 of G, in position order (USP's ring level when N does not split
    evenly: the union of u uneven shards is not itself a named shard of the ring level)."""

    base: object
    base_world_size: int
    degree: int

    @property
    def world_size(self) -> int:
        return self.base_world_size // self.degree

    def positions(self, rank: int, seqlen: int) -> torch.Tensor:
        members = [positions(self.base, rank * self.degree + m, self.base_world_size, seqlen)
                   for m in range(self.degree)]
        return torch.cat(members).sort().values

    def __str__(self) -> str:
        return f"{self.base}/{self.degree}"


def group_layout(layout, world_size: int, degree: int, seqlen: int | None = None):
    """The layout at ring level when groups of ``degree`` consecutive ranks gather their shards
    (USP): ring rank i holds the union of ranks i*degree .. i*degree+degree-1. Named layouts keep
    their name when ``seqlen`` splits into the chunks of both levels (contiguous and zigzag then
    regroup exactly; ``burst_impl.reorder`` checks it), else become a ``GroupedLayout``; a
    ChunkLayout becomes the ChunkLayout of the unions, chunks in position order."""
    if not isinstance(layout, ChunkLayout):
        # a ChunkLayout's unions cut N into the same chunks at both levels, whatever N; named layouts
        # cut it into chunks of the ring level, which only nest in the G-level ones when they divide N
        if seqlen is not None and degree > 1 and seqlen % (chunks_per_rank(layout) * world_size):
            return GroupedLayout(layout, world_size, degree)
        return layout
    r = world_size // degree
    merged = tuple(tuple(sorted(c for m in range(degree) for c in layout.chunks[i * degree + m])) for i in range(r))
    return ChunkLayout(merged, name=f"{layout.name}/{degree}")


def shard(x: torch.Tensor, layout: str, rank: int, world_size: int, dim: int = 1) -> torch.Tensor:
    """The local shard of the full-sequence tensor ``x`` held by ``rank`` (a copy)."""
    idx = positions(layout, rank, world_size, x.shape[dim]).to(x.device)
    return x.index_select(dim, idx).contiguous()   # (.., len(idx), ..): lengths(...)[rank] tokens


def unshard(shards: list[torch.Tensor], layout: str, dim: int = 1) -> torch.Tensor:
    """Reassemble the full sequence from the list of all ranks' shards (rank order)."""
    world_size = len(shards)
    seqlen = sum(s.shape[dim] for s in shards)
    shape = list(shards[0].shape)
    shape[dim] = seqlen
    out = shards[0].new_empty(shape)
    for r, s in enumerate(shards):
        out.index_copy_(dim, positions(layout, r, world_size, seqlen).to(s.device), s)
    return out
