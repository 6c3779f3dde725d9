"""The exact tiled path for tiles with a partial mask (band, documents, dense; ``TileMask``).

A tile's rows are cut into blocks of ``ROW_BLOCK`` rows. Each block computes
only the key columns where it has live entries: their span, or the live
columns gathered into one call when they fill less than half of the span
(block-sparse). A block whose entries are all live runs without a mask, the
others with an additive mask (0 / -inf). Row blocks with no live entry are
skipped. Rows with no live key at all get out = 0, lse = -inf and zero
gradients (never NaN). The segments are derived once per tile and cached on
the ``TileMask`` (plans are cached, so once per plan).

The attention of a segment runs in

* ``fused=cpu_flash.forward`` / ``cpu_flash.backward``: PyTorch's fused CPU flash kernel, which takes an additive
  ``attn_mask`` forward and backward (it returns lse = 0 for a fully masked
  row, fixed to -inf here; its backward is given lse = 0 for such rows, which
  with an all -inf mask row gives P = 0);
* ``fused=False``: plain math in the statistics dtype (fp32, fp64 for fp64),
  any device (the GPU path for dense tiles; FlexAttention is the fused
  option there, not written yet).

Why not FlexAttention on CPU: without ``torch.compile`` it materialises the
scores, and masked math on a whole tile is slower than the fused kernel with
the same mask (measured: docs/findings.md, masked tile kernels), so the fused
kernel with a mask on span-restricted segments is the exact path here.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .common import TileMask, stats_dtype

Tensor = torch.Tensor
ROW_BLOCK = 128
_NEG_INF = float("-inf")


@dataclass(frozen=True, eq=False)
class Segment:
    r0: int
    r1: int
    cols: slice | Tensor              # key columns computed (span, or gathered live columns)
    allowed: Tensor | None            # (r1 - r0, n cols) bool; None: every entry is live
    empty: Tensor | None              # rows (relative to r0) without any live key


def segments(tm: TileMask) -> list[Segment]:
    """The row blocks of ``tm`` and the columns each computes (cached on ``tm``)."""
    segs = tm.cache.get("segments")
    if segs is not None:
        return segs
    segs = []
    for a in range(0, tm.n_rows, ROW_BLOCK):
        b = min(tm.n_rows, a + ROW_BLOCK)
        m = tm.rows(a, b)
        if not tm.restrict:
            cols, sub = slice(0, tm.n_cols), m
        else:
            live = m.any(0)
            idx = torch.nonzero(live).flatten()
            if idx.numel() == 0:
                continue
            c0, c1 = int(idx[0]), int(idx[-1]) + 1
            if idx.numel() < (c1 - c0) // 2:
                cols, sub = idx, m.index_select(1, idx)
            else:
                cols, sub = slice(c0, c1), m[:, c0:c1]
        empty = torch.nonzero(~sub.any(1)).flatten()
        segs.append(Segment(a, b, cols, None if bool(sub.all()) else sub.contiguous(),
                            empty if empty.numel() else None))
    tm.cache["segments"] = segs
    return segs


def _on(tm: TileMask, seg_i: int, what: str, make, device, dtype=None):
    key = (what, seg_i, device, dtype)
    if key not in tm.cache:
        tm.cache[key] = make()
    return tm.cache[key]


def _cols(tm, i, seg, device):
    if isinstance(seg.cols, slice):
        return seg.cols
    return _on(tm, i, "cols", lambda: seg.cols.to(device), device)


def _bias(tm, i, seg, dtype, device):
    if seg.allowed is None:
        return None
    return _on(tm, i, "bias", lambda: torch.zeros(seg.allowed.shape, dtype=dtype, device=device)
               .masked_fill_(~seg.allowed.to(device), _NEG_INF), device, dtype)


def _allowed(tm, i, seg, device):
    if seg.allowed is None:
        return None
    return _on(tm, i, "allowed", lambda: seg.allowed.to(device), device)


def _take(x: Tensor, sel) -> Tensor:
    return x[:, sel] if isinstance(sel, slice) else x.index_select(1, sel)


# ---------------------------------------------------------------- segment kernels (plain math)


def _heads(q, k, acc):
    """q (B, r, Z, d) -> (B, Zkv, g, r, d); k (B, c, Zkv, d) -> (B, Zkv, 1, c, d), in ``acc``."""
    b, r, z, d = q.shape
    zkv = k.shape[2]
    return (q.to(acc).reshape(b, r, zkv, z // zkv, d).permute(0, 2, 3, 1, 4),
            k.to(acc).permute(0, 2, 1, 3).unsqueeze(2))


def _scores(qh, kh, allowed, scale):
    s = qh @ kh.transpose(-1, -2) * scale                      # (B, Zkv, g, r, c)
    return s if allowed is None else s.masked_fill(~allowed, _NEG_INF)


def _math_forward(q, k, v, allowed, scale):
    acc = stats_dtype(q.dtype)
    b, r, z, d = q.shape
    qh, kh = _heads(q, k, acc)
    vh = v.to(acc).permute(0, 2, 1, 3).unsqueeze(2)
    s = _scores(qh, kh, allowed, scale)
    lse = torch.logsumexp(s, dim=-1)                            # (B, Zkv, g, r); -inf for empty rows
    p = torch.exp(s - lse.unsqueeze(-1)).nan_to_num_(nan=0.0)
    out = (p @ vh).permute(0, 3, 1, 2, 4).reshape(b, r, z, d)
    return out.to(q.dtype), lse.reshape(b, z, r)


def _math_backward(dout, q, k, v, lse, delta, allowed, scale):
    acc = stats_dtype(q.dtype)
    b, r, z, d = q.shape
    zkv = k.shape[2]
    qh, kh = _heads(q, k, acc)
    vh = v.to(acc).permute(0, 2, 1, 3).unsqueeze(2)
    doh = _heads(dout, k, acc)[0]
    g = z // zkv
    lse = lse.to(acc).reshape(b, zkv, g, r)
    lse = torch.where(torch.isneginf(lse), torch.full_like(lse, float("inf")), lse)   # empty rows: P = 0
    p = torch.exp(_scores(qh, kh, allowed, scale) - lse.unsqueeze(-1))
    dv = (p.transpose(-1, -2) @ doh).sum(2)                     # (B, Zkv, c, d)
    ds = p * (doh @ vh.transpose(-1, -2) - delta.to(acc).reshape(b, zkv, g, r, 1))
    dq = (ds @ kh * scale).permute(0, 3, 1, 2, 4).reshape(b, r, z, d)
    dk = (ds.transpose(-1, -2) @ qh).sum(2) * scale
    return dq.to(q.dtype), dk.permute(0, 2, 1, 3).to(k.dtype), dv.permute(0, 2, 1, 3).to(v.dtype)


# ---------------------------------------------------------------- the tile


def forward(q: Tensor, k: Tensor, v: Tensor, tm: TileMask, scale: float, *, fused=None) -> tuple[Tensor, Tensor]:
    """q (B, Sq, Z, d), k/v (B, Sk, Zkv, d) of one tile -> out (B, Sq, Z, d), lse (B, Z, Sq).

    ``fused``: the fused kernel (``cpu_flash.forward``, which takes ``attn_mask``), or None/False: plain math."""
    acc = stats_dtype(q.dtype)
    b, sq, z, d = q.shape
    out = torch.zeros_like(q, memory_format=torch.contiguous_format)
    lse = torch.full((b, z, sq), _NEG_INF, dtype=acc, device=q.device)
    for i, seg in enumerate(segments(tm)):
        cols = _cols(tm, i, seg, q.device)
        qs, ks, vs = q[:, seg.r0:seg.r1], _take(k, cols), _take(v, cols)
        if fused:
            o, l = fused(qs, ks, vs, False, scale, attn_mask=_bias(tm, i, seg, q.dtype, q.device))
        else:
            o, l = _math_forward(qs, ks, vs, _allowed(tm, i, seg, q.device), scale)
        out[:, seg.r0:seg.r1] = o
        lse[:, :, seg.r0:seg.r1] = l
        if seg.empty is not None:
            rows = seg.empty.to(q.device) + seg.r0
            lse.index_fill_(2, rows, _NEG_INF)
            out.index_fill_(1, rows, 0.0)
    return out, lse


def backward(dout, q, k, v, lse, delta, tm: TileMask, scale: float, *, fused=None):
    """Gradients of one tile from the global lse and delta of its rows -> (dq, dk, dv) in input dtypes.

    ``fused``: the fused kernel (``cpu_flash.backward``, which takes ``attn_mask``), or None/False: plain math."""
    acc = stats_dtype(q.dtype)
    dq = torch.zeros_like(q, dtype=acc, memory_format=torch.contiguous_format)
    dk = torch.zeros_like(k, dtype=acc, memory_format=torch.contiguous_format)
    dv = torch.zeros_like(v, dtype=acc, memory_format=torch.contiguous_format)
    for i, seg in enumerate(segments(tm)):
        cols = _cols(tm, i, seg, q.device)
        rows = slice(seg.r0, seg.r1)
        ls, ds = lse[:, :, rows], delta[:, :, rows]
        args = (dout[:, rows], q[:, rows], _take(k, cols), _take(v, cols))
        if fused:
            ls = torch.where(torch.isneginf(ls), torch.zeros_like(ls), ls).contiguous()
            g = fused(*args, ls, ds, False, scale, attn_mask=_bias(tm, i, seg, q.dtype, q.device))
        else:
            g = _math_backward(*args, ls, ds, _allowed(tm, i, seg, q.device), scale)
        dq[:, rows] = g[0]
        if isinstance(cols, slice):
            dk[:, cols] += g[1]
            dv[:, cols] += g[2]
        else:
            dk.index_add_(1, cols, g[1].to(acc))
            dv.index_add_(1, cols, g[2].to(acc))
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
