"""Grouped-query attention: the one place where key/value heads meet query heads.

With Z query heads and Z_kv key/value heads (Z a multiple of Z_kv), query
head h uses kv head h // (Z/Z_kv). Kernels that take equal head counts get
the kv heads repeated (``expand_kv``); the gradients of the repeated heads
are summed back per kv head (``fold_kv``), which is the transpose of the
repeat.
"""
from __future__ import annotations

import torch

Tensor = torch.Tensor


def expand_kv(x: Tensor, heads: int, dim: int = 2) -> Tensor:
    """(..., Z_kv, ...) -> (..., Z, ...) along ``dim``, repeating each kv head Z/Z_kv times."""
    groups = heads // x.shape[dim]
    return x if groups == 1 else x.repeat_interleave(groups, dim=dim)


def fold_kv(x: Tensor, kv_heads: int, dim: int = 2) -> Tensor:
    """(..., Z, ...) -> (..., Z_kv, ...) along ``dim``: sum the query heads that share a kv head."""
    z = x.shape[dim]
    if z == kv_heads:
        return x
    shape = x.shape[:dim] + (kv_heads, z // kv_heads) + x.shape[dim + 1:]
    return x.reshape(shape).sum(dim + 1)
