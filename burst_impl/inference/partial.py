"""Partial attention over one rank's cache shard, and the log-sum-exp merge of the ranks' partials.

A shard holds tokens at arbitrary global positions (``kv_cache``), so the mask of a (queries,
shard) pair is built from the positions themselves (``Mask.allowed``: the masks' single source of
truth) and handed to the shared kernels as a dense tile mask, or none where every key is live; a
shard with no live key for a row gives out = 0, lse = -inf there, which the merge weighs zero
(``attention.merge_partial``).
"""
from __future__ import annotations

import math
import numbers

import torch

from .. import masks
from ..attention import merge_partial
from ..kernels import TileMask, attn_forward, resolve_backend, stats_dtype

Tensor = torch.Tensor


def decode_mask(window: int | None) -> masks.Mask:
    """Causal, or a query at q attends keys q - window .. q (``masks.SlidingWindow(window, 0)``)."""
    if window is None:
        return masks.Causal()
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise ValueError(f"window={window!r} must be a non-negative int (keys q - window .. q) or None (causal)")
    return masks.SlidingWindow(window, 0)


def decode_all_live(window: int | None, owners: list[int], rank: int) -> bool:
    """Whether every key of ``rank``'s shard is live for every new query of a decode step whose new tokens
    went to ``owners``, known on the host: causal (no window), and this rank holds no new token but
    perhaps the first (the cached ones all precede every new query; new token j is live for query i
    only from i = j on)."""
    return window is None and all(j == 0 for j, o in enumerate(owners) if o == rank)


def check_attention_args(q: Tensor, softmax_scale, backend) -> None:
    """``softmax_scale`` finite and positive (or None), ``backend`` able to run on q (or None), checked
    before a call appends to the cache or sends."""
    if softmax_scale is not None and (isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real)
                                      or not math.isfinite(softmax_scale) or not softmax_scale > 0):
        raise ValueError(f"softmax_scale={softmax_scale!r} must be a finite positive number (or None: 1/sqrt(d))")
    resolve_backend(q.device, backend, q.dtype, q.shape[-1])


def partial_attention(q: Tensor, q_pos: Tensor, k: Tensor, v: Tensor, k_pos: Tensor, mask: masks.Mask,
                      scale: float, backend: str | None = None, *, all_live: bool = False) -> tuple[Tensor, Tensor]:
    """One sequence: q (Sq, Z, d) at positions q_pos (Sq,) against k/v (Sk, Zkv, d) at k_pos (Sk,) ->
    (out (Sq, Z, d), lse (Z, Sq)), both in the statistics dtype. ``all_live``: the caller knows every
    key is live for every query (``decode_all_live``), so the mask is not built: building it, and asking
    whether it is all live, waits for the device."""
    acc = stats_dtype(q.dtype)
    sq, z, d = q.shape
    if k.shape[0] == 0:
        return (torch.zeros((sq, z, d), dtype=acc, device=q.device),
                torch.full((z, sq), float("-inf"), dtype=acc, device=q.device))
    # every key live (one new token over a causal cache): the fused kernel without a mask, which reads
    # the cache once (on an H200 PyTorch's FlashAttention-2 reaches 0.75-0.90 of the HBM rate from 256K
    # keys, docs/gpu_check.md); else the tile's dense mask, on the host where the exact path reads it
    tile = None
    if not all_live:
        live = mask.allowed(q_pos.to(k_pos.device), k_pos)             # (Sq, Sk) bool
        if not bool(live.all()):
            tile = TileMask("dense", sq, k.shape[0], rows_fn=lambda a, b, m=live.cpu(): m[a:b])
    # every key live and GQA (Z = g Zkv): a KV head's g query heads as g x Sq rows of that head, one read of
    # each KV head instead of one per query head (FlashAttention-2's decode path does the same,
    # ``seqlenq_ngroups_swapped``; measured: docs/findings.md, "GQA rows in a decode step"); the callers check
    # that Zkv divides Z
    zkv = k.shape[1]
    g = z // zkv if tile is None else 1
    rows = q.reshape(sq, zkv, g, d).permute(2, 0, 1, 3).reshape(g * sq, zkv, d) if g > 1 else q   # row j Sq + i
    out, lse = attn_forward(rows.unsqueeze(0), k.unsqueeze(0).to(q.dtype), v.unsqueeze(0).to(q.dtype),
                            scale=scale, backend=backend, mask=tile)
    out, lse = out[0], lse[0]
    if g > 1:   # back to (Sq, Z, d); query head h = kv g + j reads KV head h // g, as the kernels' GQA does
        out = out.reshape(g, sq, zkv, d).permute(1, 2, 0, 3).reshape(sq, z, d)
        lse = lse.reshape(z, sq)            # (Zkv, g Sq) in row-major order is (Z, Sq)
    return out.to(acc), lse


def merge_all(outs: Tensor, lses: Tensor) -> tuple[Tensor, Tensor]:
    """Merge G partials in rank order: outs (G, ..., S, Z, d), lses (G, ..., Z, S) -> the merged pair,
    in the statistics dtype of ``outs`` (every rank merging the same partials gets the same bits)."""
    acc = stats_dtype(outs.dtype)
    out, lse = outs[0].to(acc).clone(), lses[0].to(acc).clone()
    for j in range(1, outs.shape[0]):
        merge_partial(out, lse, outs[j], lses[j].to(acc))
    return out, lse
