"""Local permutations that put gathered sequence shards back in a layout's order.

When a collective gathers the sequence shards of several ranks (Ulysses'
all-to-all, TP-V3's all-gather), the result is the ranks' shards concatenated
in rank order. With the contiguous layout that is already position order;
with zigzag it is not (rank r holds chunks r and 2G-1-r). Rather than teach
the attention kernels a permuted causal mask, we permute the gathered tokens
locally (no communication) into the order the next stage expects, and apply
the inverse permutation on the way back.
"""
from __future__ import annotations

import functools

import torch

from burst_impl.layout import positions

Tensor = torch.Tensor


@functools.lru_cache(maxsize=64)
def gather_perm(layout, world_size: int, seqlen: int, members: tuple[int, ...],
                inner_rank: int, inner_size: int, inner_layout=None) -> tuple[int, ...] | None:
    """Index list ``perm`` such that ``gathered[:, perm]`` is the ``inner_layout`` (default:
    ``layout``; position order when ``inner_size`` is 1) shard of ``inner_rank`` among ``inner_size`` ranks.

    ``gathered`` is the concatenation (in ``members`` order) of the ``layout``
    shards of ``members`` among ``world_size`` ranks, for a global sequence of
    ``seqlen`` tokens. ``None`` when the permutation is the identity.
    ValueError if the gathered tokens are not exactly that inner shard.
    """
    if inner_layout is None:
        inner_layout = "contiguous" if inner_size == 1 else layout
    got = torch.cat([positions(layout, m, world_size, seqlen) for m in members])
    want = positions(inner_layout, inner_rank, inner_size, seqlen)
    if got.numel() != want.numel() or not torch.equal(got.sort().values, want.sort().values):
        raise ValueError(f"ranks {members} of {world_size} do not together hold the {str(inner_layout)!r} shard "
                         f"of rank {inner_rank} of {inner_size}; cannot reorder")
    where = {int(p): i for i, p in enumerate(got)}
    perm = tuple(where[int(p)] for p in want)
    return None if perm == tuple(range(len(perm))) else perm


def inverse(perm: tuple[int, ...]) -> tuple[int, ...]:
    inv = [0] * len(perm)
    for i, p in enumerate(perm):
        inv[p] = i
    return tuple(inv)


def apply(x: Tensor, perm: tuple[int, ...] | None, dim: int = 1) -> Tensor:
    """``x`` reordered along ``dim`` (differentiable; identity when ``perm`` is None)."""
    if perm is None:
        return x
    return x.index_select(dim, torch.tensor(perm, device=x.device))
