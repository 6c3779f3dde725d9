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


class Perm:
    """A permutation of token slots: ``apply(x, perm)`` is ``x[:, perm.order]``. Built once per
    (layout, group, length) by ``gather_perm`` and reused by every call, so its index tensor per
    device and its inverse are made once too (not a pass over N indices per forward)."""

    __slots__ = ("order", "_inverse", "_index")

    def __init__(self, order: Tensor):
        self.order = order                     # int64, CPU
        self._inverse: Perm | None = None
        self._index: dict[torch.device, Tensor] = {}

    def inverse(self) -> "Perm":
        if self._inverse is None:
            self._inverse = Perm(torch.argsort(self.order))
            self._inverse._inverse = self
        return self._inverse

    def index(self, device: torch.device) -> Tensor:
        if device not in self._index:
            self._index[device] = self.order.to(device)
        return self._index[device]


@functools.lru_cache(maxsize=64)
def gather_perm(layout, world_size: int, seqlen: int, members: tuple[int, ...],
                inner_rank: int, inner_size: int, inner_layout=None) -> Perm | None:
    """``perm`` such that ``gathered[:, perm.order]`` is the ``inner_layout`` (default:
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
    got_sorted, got_at = got.sort()
    if got.numel() != want.numel() or not torch.equal(got_sorted, want.sort().values):
        raise ValueError(f"ranks {members} of {world_size} do not together hold the {str(inner_layout)!r} shard "
                         f"of rank {inner_rank} of {inner_size}; cannot reorder")
    order = got_at[torch.searchsorted(got_sorted, want)]          # where each wanted position sits in got
    return None if torch.equal(order, torch.arange(order.numel())) else Perm(order)


def inverse(perm: Perm) -> Perm:
    return perm.inverse()


def apply(x: Tensor, perm: Perm | None, dim: int = 1) -> Tensor:
    """``x`` reordered along ``dim`` (differentiable; identity when ``perm`` is None)."""
    if perm is None:
        return x
    return x.index_select(dim, perm.index(x.device))
