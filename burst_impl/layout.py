"""Sequence layouts: how the N tokens are split over G devices (PAPER.md §2, workload balance).

* ``contiguous``: rank r holds tokens [r*N/G, (r+1)*N/G). With a causal mask
  the work is unbalanced: rank G-1 attends to everything, rank 0 to one block.
* ``zigzag``: the sequence is cut into 2G chunks; rank r holds chunks r and
  2G-1-r (in that order), so every rank has the same causal work.
* ``striped``: token t lives on rank t mod G (BurstEngine's striped layout);
  every block pair is (almost) a triangle, so causal work is balanced too.

``block_plan`` says, for a query shard owned by rank ``a`` and a key/value
shard owned by rank ``b``, which rows and columns interact under a causal
mask, so forward and both backward schemes share one source of truth.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

LAYOUTS = ("contiguous", "zigzag", "striped")


def check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} is unknown; choose one of {LAYOUTS}")


def chunks_per_rank(layout: str) -> int:
    check_layout(layout)
    return 2 if layout == "zigzag" else 1


def check_seqlen(seqlen: int, layout: str, world_size: int, *, name: str = "seqlen") -> None:
    """ValueError unless a global sequence of ``seqlen`` splits as ``layout`` needs."""
    n_chunks = chunks_per_rank(layout) * world_size
    if seqlen % n_chunks != 0 or seqlen <= 0:
        raise ValueError(
            f"{name}={seqlen} must be a positive multiple of {n_chunks} "
            f"({chunks_per_rank(layout)} chunk(s) per rank x world_size={world_size}) for layout={layout!r}"
        )


def chunk_ids(layout: str, rank: int, world_size: int) -> list[int]:
    """Global chunk indices held by ``rank`` in local order (chunked layouts only)."""
    check_layout(layout)
    if layout == "striped":
        raise ValueError("layout='striped' is not made of chunks; use positions()")
    if layout == "contiguous":
        return [rank]
    return [rank, 2 * world_size - 1 - rank]


def positions(layout: str, rank: int, world_size: int, seqlen: int) -> torch.Tensor:
    """Global token positions of ``rank``'s shard in local order, shape (seqlen/G,)."""
    check_seqlen(seqlen, layout, world_size)
    if layout == "striped":
        return torch.arange(rank, seqlen, world_size)
    c = seqlen // (chunks_per_rank(layout) * world_size)
    return torch.cat([torch.arange(i * c, (i + 1) * c) for i in chunk_ids(layout, rank, world_size)])


def shard(x: torch.Tensor, layout: str, rank: int, world_size: int, dim: int = 1) -> torch.Tensor:
    """The local shard of the full-sequence tensor ``x`` held by ``rank`` (a copy)."""
    idx = positions(layout, rank, world_size, x.shape[dim]).to(x.device)
    return x.index_select(dim, idx).contiguous()


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


@dataclass(frozen=True)
class BlockPlan:
    """What part of (q shard of rank a) x (kv shard of rank b) is computed.

    ``q_rows``/``kv_cols`` are slices of the local shards; ``causal`` says the
    remaining block is a diagonal block (top-left causal mask). ``None`` for
    q_rows means the pair does no work (fully masked).
    """

    q_rows: slice | None
    kv_cols: slice
    causal: bool

    @property
    def empty(self) -> bool:
        return self.q_rows is None


_ALL = slice(None)


def block_plan(layout: str, causal: bool, a: int, b: int, local_len: int) -> BlockPlan:
    """Plan for queries of rank ``a`` against keys/values of rank ``b`` (``local_len`` = N/G)."""
    if not causal:
        return BlockPlan(_ALL, _ALL, False)
    if a == b:
        # Contiguous: one diagonal chunk. Zigzag: chunks (a, 2G-1-a) against
        # themselves; top-left causal on the concatenation is exactly the
        # global mask, because both q and k are in increasing chunk order.
        return BlockPlan(_ALL, _ALL, True)
    if layout == "contiguous":
        return BlockPlan(_ALL, _ALL, False) if b < a else BlockPlan(None, _ALL, False)
    if layout == "striped":
        # q token i*G+a sees k token j*G+b iff j*G+b <= i*G+a: for b < a iff
        # j <= i (top-left causal, diagonal included); for b > a iff j < i,
        # i.e. q rows 1.. against k columns ..S-2 with a top-left causal mask.
        if b < a:
            return BlockPlan(_ALL, _ALL, True)
        if local_len == 1:
            return BlockPlan(None, _ALL, False)
        return BlockPlan(slice(1, local_len), slice(0, local_len - 1), True)
    half = local_len // 2
    if b < a:
        # kv chunk b precedes both q chunks; kv chunk 2G-1-b follows both.
        return BlockPlan(_ALL, slice(0, half), False)
    # b > a: q chunk a precedes both kv chunks; q chunk 2G-1-a follows both.
    return BlockPlan(slice(half, local_len), _ALL, False)
