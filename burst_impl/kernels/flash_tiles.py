"""What the FlashAttention-2 kernels (the flash-attn package's, ``flash_attn.py``; PyTorch's own copy,
``cuda_flash.py``) share about partial-mask tiles: their window convention, their lse on a row with no
live key, and the cumulative lengths of a document tile.

* ``flash_window``: the (left, right) window of a band tile, bottom-right aligned as the kernels read it;
* ``our_lse`` / ``flash_lse``: a row with no live key has lse +inf in the kernels (their backward's
  exp(s - lse) is then 0) and -inf in the suite (the merge's neutral element);
* ``varlen_args``: a ``varlen`` / ``varlen_full`` tile's documents as the varlen entry points take them,
  every batch row packed after the previous one with the same boundaries;
* ``masked_pair``: a backend's ``masked_forward`` / ``masked_backward`` from its dense pair (a band as the
  window) and its varlen pair (a document tile), any other tile in the exact path.
"""
from __future__ import annotations

from typing import Callable

import torch

from . import masked
from .common import VARLEN, TileMask

UNBOUNDED = (-1, -1)        # the kernels' window of an unmasked call


def flash_window(n_rows: int, n_cols: int, lo: int | None, hi: int | None) -> tuple[int, int] | None:
    """The kernels' (left, right) window for the band ``lo <= j - i <= hi`` on an (n_rows, n_cols) tile.

    They align the window to the bottom-right corner: key j is live for query i iff
    i + (Sk - Sq) - left <= j <= i + (Sk - Sq) + right, -1 meaning unbounded. But a size >= Sk is
    reset to -1, and a -1 beside a bounded side means Sk, not unbounded (in the forward; the
    backward's clamp differs). So the window returned never relies on either: both sides -1, or
    both in [0, Sk). An unbounded side gets the smallest size that reaches every column, which is
    below Sk except for the right side of a tall tile (Sq > Sk): that band, and any needing a
    negative size, gives None (not expressible; the exact path runs it)."""
    shift = n_cols - n_rows
    if lo is not None and lo <= 1 - n_rows:     # the bound excludes no column of any row
        lo = None
    if hi is not None and hi >= n_cols - 1:
        hi = None
    if lo is None and hi is None:
        return -1, -1
    left = n_cols - 1 if lo is None else shift - lo
    right = n_rows - 1 if hi is None else hi - shift
    if not (0 <= left < n_cols and 0 <= right < n_cols):
        return None
    return left, right


def band_window(tm: TileMask) -> tuple[int, int] | None:
    """``flash_window`` of a band tile; None for any other kind (or a band the kernels cannot express)."""
    return flash_window(tm.n_rows, tm.n_cols, tm.lo, tm.hi) if tm.kind == "band" else None


def our_lse(lse):
    """The kernels give a row with no live key lse = +inf (so their backward's exp(s - lse) is 0); ours is
    -inf (the merge's neutral element: +inf would take over the row and give NaN)."""
    return lse.masked_fill(torch.isposinf(lse), float("-inf"))


def flash_lse(lse):
    """Our global lse for the kernels' backward: a row no block gives a live key, -inf, as their +inf."""
    return lse.masked_fill(torch.isneginf(lse), float("inf"))


def varlen_args(tm: TileMask, b: int, s: int, device) -> tuple[torch.Tensor, int]:
    """(cumulative lengths (int32, on ``device``), the longest document) of ``tm``'s documents in each of
    ``b`` batch rows of ``s`` tokens packed end to end: built once per tile, batch and device and kept
    on the device (``tm.cache``), so a timed tile copies nothing from the host."""
    key = ("varlen.cu", b, s, str(device))
    if key not in tm.cache:
        cu = torch.tensor(tm.cu, dtype=torch.int32)
        packed = torch.cat([cu[:-1] + i * s for i in range(b)] + [torch.tensor([b * s], dtype=torch.int32)])
        tm.cache[key] = (packed.to(device), int((cu[1:] - cu[:-1]).max()))
    return tm.cache[key]


def masked_pair(forward: Callable, backward: Callable, varlen_forward: Callable,
                varlen_backward: Callable) -> tuple[Callable, Callable]:
    """(masked_forward, masked_backward) of a FlashAttention-2 backend (``Backend``): a band tile through the
    dense pair with its window (``band_window``), a document tile through the varlen pair, any other tile
    (dense, or a band the window cannot express) in the exact path's math (``kernels.masked``)."""

    def masked_forward(q, k, v, tm, scale):
        window = band_window(tm)
        if window is not None:
            return forward(q, k, v, False, scale, window)
        if tm.kind in VARLEN:
            return varlen_forward(q, k, v, tm, scale)
        return masked.forward(q, k, v, tm, scale, fused=False)

    def masked_backward(dout, q, k, v, lse, delta, tm, scale):
        window = band_window(tm)
        if window is not None:
            return backward(dout, q, k, v, lse, delta, False, scale, window)
        if tm.kind in VARLEN:
            return varlen_backward(dout, q, k, v, lse, delta, tm, scale)
        return masked.backward(dout, q, k, v, lse, delta, tm, scale, fused=False)

    return masked_forward, masked_backward
