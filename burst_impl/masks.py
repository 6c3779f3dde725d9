"""Attention masks as data (docs/papers.md §2, last bullet; §4 "Sparse masks").

A mask says which (query position, key position) pairs of the *global*
sequence attend. Every mask has

* ``allowed(q_pos, k_pos) -> (len q, len k) bool``: the dense definition,
  the single source of truth (the fp64 reference builds its mask from it);
* ``pieces(q_run, k_run) -> [Piece]``: an efficient classification of the
  pair of position runs (``Run``: ``start + stride * i``) into its live parts
  (full, causal diagonal, band, document diagonal or dense), without looking
  at every token; an empty list means the pair is fully masked.
  ``burst_impl.plan`` turns pieces into the tiles a ring step computes;
* ``row_counts(N)`` / ``col_counts(N)``: live keys per query position and
  live queries per key position (the work metric and the FLOPs' area);
* ``validate(N)``: ValueError naming the parameter, the value and the rule;
* ``with_causal()``: the mask intersected with the causal one, which is what
  ``causal=True`` next to a mask means (flash-attn's convention for causal +
  window).

Masks: ``Full``, ``Causal``, ``SlidingWindow(left, right)`` (key k attends
from query q iff q - left <= k <= q + right), ``Documents(cu_seqlens)``
(packed variable-length sequences: causal within each document, or with
``causal=False`` the whole document, nothing across documents) and ``BlockSparse(block_size, blocks)`` (a boolean
(N/bs, N/bs) mask over global token blocks, optionally intersected with
causal).

Spec strings (the ``mask`` sweep axis; ``parse(spec, N)``):
``"full"``, ``"causal"``, ``"window:L:R"``, ``"docs:MEAN[:SEED]"`` (same-document
attention, intersected with causal by the ``causal`` axis like the window; document
lengths drawn from a seeded long-tailed log-normal distribution of mean
MEAN tokens, the last one cut at N), ``"docs:NAME[:SEED]"`` (lengths from the
published distribution NAME of ``burst_impl.doc_lengths``, none above N/4),
``"bsparse:BS:DENSITY[:SEED]"`` (each off-diagonal block live with
probability DENSITY, the diagonal always live).
"""
from __future__ import annotations

import bisect
import functools
import hashlib
import itertools
import math
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from . import doc_lengths

Tensor = torch.Tensor

# A (q run, k run) pair with more documents than this becomes one "varlen" piece (diagonal) or a
# dense piece, instead of one causal piece per document: fewer kernel calls for many short documents.
MAX_DOC_PIECES = 8


# ---------------------------------------------------------------- runs and pieces


@dataclass(frozen=True)
class Run:
    """Global positions ``start + stride * i`` for i < ``count``, held at local indices
    ``offset .. offset + count`` of a shard (``burst_impl.layout.runs``)."""

    start: int
    stride: int
    count: int
    offset: int = 0

    def positions(self) -> Tensor:
        return torch.arange(self.count) * self.stride + self.start

    @property
    def contiguous(self) -> bool:
        return self.stride == 1 or self.count == 1


@dataclass(frozen=True, eq=False)
class Piece:
    """A live part of a (q run, k run) pair: rows ``r0:r1`` x cols ``c0:c1`` in run indices.

    ``kind``: "full"; "causal" (square, key index <= query index); "band"
    (``lo <= j - i <= hi`` in piece indices, None = unbounded); "varlen"
    (square, causal within each document, ``cu`` = boundaries in piece
    indices from 0 to the side); "varlen_full" (the same, every token of a
    document attending to all of it); "dense" (``rows_fn(a, b)`` gives the bool
    mask of piece rows a:b over all piece columns). ``entries``: live pairs.
    """

    r0: int
    r1: int
    c0: int
    c1: int
    kind: str
    entries: int
    lo: int | None = None
    hi: int | None = None
    cu: tuple[int, ...] | None = None
    rows_fn: Callable[[int, int], Tensor] | None = None

    def shifted(self, dr: int, dc: int) -> "Piece":
        return Piece(self.r0 + dr, self.r1 + dr, self.c0 + dc, self.c1 + dc, self.kind, self.entries,
                     self.lo, self.hi, self.cu, self.rows_fn)


def _band_rows(nq: int, nk: int, lo: int | None, hi: int | None) -> Tensor:
    """(nq,) live columns of each row of the band ``lo <= j - i <= hi`` (None: unbounded) on nq x nk."""
    i = torch.arange(nq)
    first = torch.zeros_like(i) if lo is None else (i + lo).clamp(min=0)
    last = torch.full_like(i, nk - 1) if hi is None else (i + hi).clamp(max=nk - 1)
    return (last - first + 1).clamp(min=0)


def band_pieces(nq: int, nk: int, lo: int | None, hi: int | None) -> list[Piece]:
    """Pieces of the band ``lo <= j - i <= hi`` (None: unbounded) on an nq x nk pair.

    Trimmed to the rows and columns that have live entries; a band that is
    unbounded below (causal-like, ``j <= i + h``) becomes at most three fused
    kernel calls: full columns ``[0, h)``, a causal square, full rows below it.
    """
    # rows with a live entry: i + hi >= 0 and i + lo <= nk - 1
    r0 = 0 if hi is None else max(0, -hi)
    r1 = nq if lo is None else min(nq, nk - lo)
    c0 = 0 if lo is None else max(0, lo)
    c1 = nk if hi is None else min(nk, nq + hi)
    if lo is not None and hi is not None and lo > hi or r0 >= r1 or c0 >= c1:
        return []
    n, m = r1 - r0, c1 - c0
    shift = r0 - c0                       # j' - i' = (j - c0) - (i - r0) = (j - i) + shift
    lo = None if lo is None or lo + shift <= -(n - 1) else lo + shift
    hi = None if hi is None or hi + shift >= m - 1 else hi + shift
    if lo is None and hi is None:
        return [Piece(r0, r1, c0, c1, "full", n * m)]
    if lo is None:
        # j <= i + h with 0 <= h < m - 1 (trimmed: row 0 reaches column h, the last row column m-1)
        h, out = hi, []
        if h > 0:
            out.append(Piece(r0, r1, c0, c0 + h, "full", n * h))
        side = m - h                      # <= n after trimming
        out.append(Piece(r0, r0 + side, c0 + h, c1, "causal", side * (side + 1) // 2))
        if side < n:
            out.append(Piece(r0 + side, r1, c0 + h, c1, "full", (n - side) * side))
        return out
    return [Piece(r0, r1, c0, c1, "band", int(_band_rows(n, m, lo, hi).sum()), lo=lo, hi=hi)]


def _dense_rows(mask: "Mask", qr: Run, kr: Run) -> Callable[[int, int], Tensor]:
    """``rows_fn`` of a dense piece over the whole (qr, kr) pair. The positions are made on the first
    call: most plans are built only to be costed or skipped, never computed."""
    pos: list[Tensor] = []

    def rows_fn(a: int, b: int) -> Tensor:
        if not pos:
            pos.extend((qr.positions(), kr.positions()))
        return mask.allowed(pos[0][a:b], pos[1])
    return rows_fn


def dense_pieces(mask: "Mask", qr: Run, kr: Run) -> list[Piece]:
    """The generic classification: evaluate ``allowed`` (row blocks of 1024) and keep the
    pair as one full or dense piece. For position patterns the efficient rules do not cover."""
    qpos, kpos = qr.positions(), kr.positions()
    entries = sum(int(mask.allowed(qpos[i:i + 1024], kpos).sum()) for i in range(0, qr.count, 1024))
    if entries == 0:
        return []
    if entries == qr.count * kr.count:
        return [Piece(0, qr.count, 0, kr.count, "full", entries)]
    return [Piece(0, qr.count, 0, kr.count, "dense", entries,
                  rows_fn=lambda a, b: mask.allowed(qpos[a:b], kpos))]


def _common_stride(qr: Run, kr: Run) -> int | None:
    if qr.count == 1 and kr.count == 1:
        return 1
    if qr.count == 1:
        return kr.stride
    if kr.count == 1 or qr.stride == kr.stride:
        return qr.stride
    return None


# ---------------------------------------------------------------- masks


class Mask:
    """Base of the mask descriptions (frozen dataclasses below)."""

    kind: str = ""

    @property
    def key(self) -> str:
        """A short string that identifies the mask (plan caches, labels, records)."""
        raise NotImplementedError

    def validate(self, seqlen: int) -> None:
        return None

    def allowed(self, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        raise NotImplementedError

    def pieces(self, qr: Run, kr: Run) -> list[Piece]:
        return dense_pieces(self, qr, kr)

    def row_counts(self, seqlen: int) -> Tensor:
        raise NotImplementedError

    def col_counts(self, seqlen: int) -> Tensor:
        raise NotImplementedError

    def with_causal(self) -> "Mask":
        raise NotImplementedError

    def area(self, seqlen: int) -> int:
        """Live (query, key) pairs over the whole N x N score matrix."""
        return int(self.row_counts(seqlen).sum())

    def __str__(self) -> str:
        return self.key


class _Band(Mask):
    """Masks of the form ``lo <= k_pos - q_pos <= hi`` (None = unbounded)."""

    def bounds(self) -> tuple[int | None, int | None]:
        raise NotImplementedError

    def allowed(self, q_pos, k_pos):
        lo, hi = self.bounds()
        diff = k_pos.reshape(1, -1) - q_pos.reshape(-1, 1)
        ok = torch.ones_like(diff, dtype=torch.bool)
        if lo is not None:
            ok &= diff >= lo
        if hi is not None:
            ok &= diff <= hi
        return ok

    def pieces(self, qr, kr):
        s = _common_stride(qr, kr)
        if s is None:
            return dense_pieces(self, qr, kr)
        lo, hi = self.bounds()
        d = kr.start - qr.start          # k_pos - q_pos = d + s * (j - i)
        jlo = None if lo is None else -((d - lo) // s)   # ceil((lo - d) / s)
        jhi = None if hi is None else (hi - d) // s
        return band_pieces(qr.count, kr.count, jlo, jhi)

    def row_counts(self, seqlen):
        lo, hi = self.bounds()
        return _band_rows(seqlen, seqlen, lo, hi)

    def col_counts(self, seqlen):
        lo, hi = self.bounds()          # key j is seen by queries q with -hi <= q - j <= -lo: the transposed band
        return _band_rows(seqlen, seqlen, None if hi is None else -hi, None if lo is None else -lo)


@dataclass(frozen=True)
class Full(_Band):
    kind = "full"

    @property
    def key(self):
        return "full"

    def bounds(self):
        return None, None

    def with_causal(self):
        return Causal()


@dataclass(frozen=True)
class Causal(_Band):
    kind = "causal"

    @property
    def key(self):
        return "causal"

    def bounds(self):
        return None, 0

    def with_causal(self):
        return self


@dataclass(frozen=True)
class SlidingWindow(_Band):
    """Query q attends to keys q - left .. q + right (both included); ``right=0`` is the
    causal sliding window. None means unbounded on that side."""

    left: int | None
    right: int | None
    kind = "window"

    @property
    def key(self):
        return f"window:{'inf' if self.left is None else self.left}:{'inf' if self.right is None else self.right}"

    def bounds(self):
        return (None if self.left is None else -self.left), self.right

    def validate(self, seqlen):
        for name, w in (("left", self.left), ("right", self.right)):
            if w is None:
                continue
            if isinstance(w, bool) or not isinstance(w, int) or w < 0:
                raise ValueError(f"sliding_window {name}={w!r} must be an integer >= 0 (tokens on that side "
                                 "of the query; None for unbounded)")
            if w > seqlen - 1:
                raise ValueError(f"sliding_window {name}={w} is wider than the sequence (N={seqlen}: at most "
                                 f"N-1={seqlen - 1}); use mask 'causal' or 'full', or None for unbounded")

    def with_causal(self):
        return SlidingWindow(self.left, 0)


@dataclass(frozen=True)
class Documents(Mask):
    """Packed documents: token t of document [cu[d], cu[d+1]) attends to tokens cu[d]..t (``causal``, the
    default: varlen-causal), or to every token of its document (``causal=False``: varlen-full, the
    bidirectional documents of MagiAttention's "full document" mask). A ``"docs:..."`` spec string is the
    second, so that the ``causal`` axis intersects it like any other mask (``with_causal``)."""

    cu_seqlens: tuple[int, ...]
    source: str = field(default="", compare=False)   # the spec string it was drawn from, if any
    causal: bool = True
    kind = "docs"

    @functools.cached_property
    def key(self):   # cached: every ring step's plan lookup asks for it, and it hashes every boundary
        if self.source:
            base = self.source
        else:
            digest = hashlib.sha1(repr(self.cu_seqlens).encode()).hexdigest()[:10]
            base = f"docs:{len(self.cu_seqlens) - 1}docs:{digest}"
        return base if self.causal else base + ":full"

    def validate(self, seqlen):
        cu = self.cu_seqlens
        if len(cu) < 2 or any(isinstance(c, bool) or not isinstance(c, int) for c in cu):
            raise ValueError(f"cu_seqlens={_short(cu)} must be a sequence of at least 2 integers "
                             "(document boundaries 0 = cu[0] < cu[1] < ... < cu[-1] = N)")
        if cu[0] != 0:
            raise ValueError(f"cu_seqlens={_short(cu)} must start at 0 (got cu_seqlens[0]={cu[0]})")
        bad = next((i for i in range(1, len(cu)) if cu[i] <= cu[i - 1]), None)
        if bad is not None:
            raise ValueError(f"cu_seqlens={_short(cu)} must be strictly increasing (documents of at least one "
                             f"token): cu_seqlens[{bad}]={cu[bad]} <= cu_seqlens[{bad - 1}]={cu[bad - 1]}")
        if cu[-1] != seqlen:
            raise ValueError(f"cu_seqlens={_short(cu)} must end at the sequence length N={seqlen} "
                             f"(got cu_seqlens[-1]={cu[-1]})")

    def _doc(self, pos: Tensor) -> Tensor:
        return torch.bucketize(pos, torch.tensor(self.cu_seqlens), right=True) - 1

    def allowed(self, q_pos, k_pos):
        q_pos, k_pos = q_pos.reshape(-1, 1), k_pos.reshape(1, -1)
        same = self._doc(q_pos) == self._doc(k_pos)
        return same & (k_pos <= q_pos) if self.causal else same

    def pieces(self, qr, kr):
        if not (qr.contiguous and kr.contiguous):
            return dense_pieces(self, qr, kr)
        cu = self.cu_seqlens
        qa, qb, ka, kb = qr.start, qr.start + qr.count, kr.start, kr.start + kr.count
        d0 = max(bisect.bisect_right(cu, qa), bisect.bisect_right(cu, ka)) - 1
        d1 = min(bisect.bisect_left(cu, qb), bisect.bisect_left(cu, kb)) - 1
        if d0 > d1:
            return []
        if d1 - d0 + 1 > MAX_DOC_PIECES:
            if not ka <= qa < qb <= kb:
                return dense_pieces(self, qr, kr)
            return self._varlen_pieces(qa, qb, ka, kb, d0, d1)
        out = []
        for d in range(d0, d1 + 1):
            q0, q1 = max(qa, cu[d]), min(qb, cu[d + 1])
            k0, k1 = max(ka, cu[d]), min(kb, cu[d + 1])
            if q0 < q1 and k0 < k1:
                # causal within the document: k0 + j <= q0 + i, i.e. j - i <= q0 - k0; else the whole block
                hi = q0 - k0 if self.causal else None
                out += [p.shifted(q0 - qa, k0 - ka) for p in band_pieces(q1 - q0, k1 - k0, None, hi)]
        return out

    def _varlen_pieces(self, qa: int, qb: int, ka: int, kb: int, d0: int, d1: int) -> list[Piece]:
        """Queries [qa, qb) of many documents against keys [ka, kb) that contain them (the same run, or the
        whole gathered sequence of an all-gather method): one varlen call on the square [qa, qb) x [qa, qb),
        plus, where the first document began before qa, its rows against its keys in [ka, qa), and (whole
        documents only) the last document's rows against its keys in [qb, kb): full blocks, never a dense
        tile over every key."""
        cu = self.cu_seqlens
        rel = tuple(b - qa for b in [qa] + [cu[d] for d in range(d0 + 1, d1 + 1)] + [qb])
        n, off = qb - qa, qa - ka
        if self.causal:
            entries = sum((b - a) * (b - a + 1) // 2 for a, b in zip(rel, rel[1:]))
            out = [Piece(0, n, off, off + n, "varlen", entries, cu=rel)]
        else:
            entries = sum((b - a) * (b - a) for a, b in zip(rel, rel[1:]))
            out = [Piece(0, n, off, off + n, "varlen_full", entries, cu=rel)]
        first_k = max(ka, cu[d0])
        if first_k < qa:                       # the first document's keys before the run
            rows = min(qb, cu[d0 + 1]) - qa
            out.append(Piece(0, rows, first_k - ka, off, "full", rows * (qa - first_k)))
        last_k = min(kb, cu[d1 + 1])
        if not self.causal and last_k > qb:    # whole documents: the last one's keys after the run
            r0 = max(qa, cu[d1]) - qa
            out.append(Piece(r0, n, qb - ka, last_k - ka, "full", (n - r0) * (last_k - qb)))
        return out

    def row_counts(self, seqlen):
        i = torch.arange(seqlen)
        cu = torch.tensor(self.cu_seqlens)
        return (i - cu[self._doc(i)] + 1) if self.causal else (cu[self._doc(i) + 1] - cu[self._doc(i)])

    def col_counts(self, seqlen):
        j = torch.arange(seqlen)
        cu = torch.tensor(self.cu_seqlens)
        return (cu[self._doc(j) + 1] - j) if self.causal else (cu[self._doc(j) + 1] - cu[self._doc(j)])

    def with_causal(self):
        return self if self.causal else Documents(self.cu_seqlens, self.source, True)


@dataclass(frozen=True, eq=False)
class BlockSparse(Mask):
    """A (N/bs, N/bs) boolean mask over global token blocks of ``block_size`` tokens; with
    ``causal`` also key <= query inside the live blocks."""

    block_size: int
    blocks: Tensor
    causal: bool = False
    source: str = ""
    kind = "bsparse"

    @functools.cached_property
    def key(self):
        if self.source:
            return self.source + (":causal" if self.causal else "")
        b = self.blocks.to(torch.bool).contiguous()
        digest = hashlib.sha1(b.numpy().tobytes() + str(tuple(b.shape)).encode()).hexdigest()[:10]
        return f"bsparse:{self.block_size}:{digest}" + (":causal" if self.causal else "")

    def __eq__(self, other):
        return isinstance(other, BlockSparse) and self.key == other.key

    def __hash__(self):
        return hash(self.key)

    def validate(self, seqlen):
        bs = self.block_size
        if isinstance(bs, bool) or not isinstance(bs, int) or bs <= 0:
            raise ValueError(f"block_size={bs!r} must be a positive integer (tokens per block)")
        if seqlen % bs:
            raise ValueError(f"block_size={bs} must divide the sequence length N={seqlen}")
        nb = seqlen // bs
        if not isinstance(self.blocks, torch.Tensor) or self.blocks.dim() != 2 \
                or tuple(self.blocks.shape) != (nb, nb):
            got = tuple(self.blocks.shape) if isinstance(self.blocks, torch.Tensor) else type(self.blocks).__name__
            raise ValueError(f"block mask shape {got} must be (N/block_size, N/block_size) = ({nb}, {nb}) "
                             f"for N={seqlen}, block_size={bs}")
        if self.blocks.dtype != torch.bool:
            raise ValueError(f"block mask dtype {self.blocks.dtype} must be torch.bool")

    def allowed(self, q_pos, k_pos):
        q_pos, k_pos = q_pos.reshape(-1), k_pos.reshape(-1)
        ok = self.blocks[(q_pos // self.block_size).unsqueeze(1), (k_pos // self.block_size).unsqueeze(0)]
        return ok & (k_pos.unsqueeze(0) <= q_pos.unsqueeze(1)) if self.causal else ok

    def pieces(self, qr, kr):
        bs = self.block_size
        aligned = all(r.contiguous and r.start % bs == 0 and r.count % bs == 0 for r in (qr, kr))
        if not aligned:
            return dense_pieces(self, qr, kr)
        qb0, kb0 = qr.start // bs, kr.start // bs
        # numpy, not torch: plans are built for every block pair of a ring (the performance model asks
        # for thousands), and on sub-blocks this small torch's per-op overhead dominates
        sub = self._blocks_np[qb0:qb0 + qr.count // bs, kb0:kb0 + kr.count // bs]
        n_diag = 0
        if self.causal:
            qi = np.arange(qb0, qb0 + sub.shape[0])[:, None]
            ki = np.arange(kb0, kb0 + sub.shape[1])[None, :]
            n_diag = int((sub & (ki == qi)).sum())
            sub = sub & (ki <= qi)
        live = int(sub.sum())
        if live == 0:
            return []
        if live == sub.size and n_diag == 0:
            return [Piece(0, qr.count, 0, kr.count, "full", qr.count * kr.count)]
        entries = (live - n_diag) * bs * bs + n_diag * bs * (bs + 1) // 2
        return [Piece(0, qr.count, 0, kr.count, "dense", entries, rows_fn=_dense_rows(self, qr, kr))]

    @functools.cached_property
    def _blocks_np(self) -> np.ndarray:
        return self.blocks.detach().to("cpu", torch.bool).numpy()

    def _counts(self, seqlen, blocks, causal_first):
        bs = self.block_size
        nb = seqlen // bs
        idx = torch.arange(nb)
        live = blocks.clone()
        if self.causal:
            live &= idx.unsqueeze(1) > idx.unsqueeze(0) if causal_first else idx.unsqueeze(1) < idx.unsqueeze(0)
        per_block = live.sum(1) * bs                                  # (nb,) full blocks
        t = torch.arange(seqlen)
        out = per_block[t // bs].clone()
        if self.causal:   # the diagonal block contributes a triangle
            d = blocks.diagonal()[t // bs]
            within = (t % bs + 1) if causal_first else (bs - t % bs)
            out += torch.where(d, within, torch.zeros_like(within))
        return out

    def row_counts(self, seqlen):
        return self._counts(seqlen, self.blocks, True)

    def col_counts(self, seqlen):
        return self._counts(seqlen, self.blocks.t(), False)

    def with_causal(self):
        return BlockSparse(self.block_size, self.blocks, True, self.source)


def _short(cu) -> str:
    cu = tuple(cu) if not isinstance(cu, torch.Tensor) else tuple(cu.tolist())
    return repr(cu) if len(cu) <= 8 else f"({', '.join(map(str, cu[:4]))}, ..., {', '.join(map(str, cu[-2:]))})"


# ---------------------------------------------------------------- constructors and spec strings


def sliding_window(left: int | None, right: int | None = 0) -> SlidingWindow:
    return SlidingWindow(left, right)


def documents(cu_seqlens, causal: bool = True) -> Documents:
    """Documents from boundaries ``cu_seqlens`` (a list, tuple or 1-D integer tensor); causal within each
    document, or (``causal=False``) every token of a document attending to all of it."""
    return Documents(tuple(cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else cu_seqlens),
                     causal=causal)


def block_sparse(block_size: int, blocks: Tensor, causal: bool = False) -> BlockSparse:
    return BlockSparse(block_size, blocks, causal)


def long_tailed_lengths(seqlen: int, mean: int, seed: int = 0, sigma: float = 1.2) -> list[int]:
    """Document lengths from a log-normal distribution (mean ``mean``, shape ``sigma``), seeded,
    drawn until they cover ``seqlen``; the last one is cut at ``seqlen``."""
    g = torch.Generator().manual_seed(seed)
    mu = math.log(mean) - sigma * sigma / 2
    out, total = [], 0
    while total < seqlen:
        draws = torch.exp(mu + sigma * torch.randn(64, generator=g, dtype=torch.float64))
        for x in draws.tolist():
            n = max(1, min(int(round(x)), seqlen - total))
            out.append(n)
            total += n
            if total >= seqlen:
                break
    return out


def random_block_mask(n_blocks: int, density: float, seed: int = 0) -> Tensor:
    """(n_blocks, n_blocks) bool: each off-diagonal block live with probability ``density``; diagonal live."""
    g = torch.Generator().manual_seed(seed)
    m = torch.rand(n_blocks, n_blocks, generator=g) < density
    m.fill_diagonal_(True)
    return m


def _ints(parts, spec, what, n=None):
    try:
        vals = [int(p) for p in parts]
    except ValueError:
        raise ValueError(f"mask={spec!r}: {what} must be integers") from None
    if n is not None and len(vals) != n:
        raise ValueError(f"mask={spec!r}: expected {what}")
    return vals


def check_spec(spec: str) -> str | None:
    """Why the spec string is malformed (syntax and signs only; sizes need N), else None."""
    try:
        _parse(spec, None)
    except ValueError as e:
        return str(e)
    return None


def parse(spec: str, seqlen: int) -> Mask:
    """The mask a spec string describes for a sequence of ``seqlen`` tokens (validated)."""
    m = _parse(spec, seqlen)
    m.validate(seqlen)
    return m


def _parse(spec: str, seqlen: int | None) -> Mask:
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"mask={spec!r} must be a non-empty string: one of 'full', 'causal', 'window:L:R', "
                         "'docs:MEAN[:SEED]', 'docs:NAME[:SEED]', 'bsparse:BS:DENSITY[:SEED]'")
    kind, *args = spec.split(":")
    if kind == "full" and not args:
        return Full()
    if kind == "causal" and not args:
        return Causal()
    if kind == "window":
        if len(args) != 2:
            raise ValueError(f"mask={spec!r}: a sliding window is 'window:LEFT:RIGHT' (tokens before and "
                             "after the query, integers >= 0)")
        left, right = _ints(args, spec, "LEFT and RIGHT", 2)
        m = SlidingWindow(left, right)
        m.validate(seqlen if seqlen is not None else max(left, right, 0) + 1)
        return m
    if kind == "docs":
        if len(args) not in (1, 2):
            raise ValueError(f"mask={spec!r}: documents are 'docs:MEAN[:SEED]' (mean document length in "
                             "tokens, seed of the long-tailed length distribution) or 'docs:NAME[:SEED]' "
                             f"(a published length distribution: {', '.join(doc_lengths.names())})")
        if not args[0].lstrip("-").isdigit():
            return _published_docs(spec, args[0], args[1:], seqlen)
        mean, *seed = _ints(args, spec, "MEAN and SEED")
        if mean <= 0 or (seed and seed[0] < 0):
            raise ValueError(f"mask={spec!r}: MEAN must be > 0 and SEED >= 0")
        if seqlen is None:
            return Documents((0, 1))
        lengths = long_tailed_lengths(seqlen, mean, seed[0] if seed else 0)
        return Documents(tuple([0] + torch.tensor(lengths).cumsum(0).tolist()), source=spec, causal=False)
    if kind == "bsparse":
        if len(args) not in (2, 3):
            raise ValueError(f"mask={spec!r}: block-sparse is 'bsparse:BLOCK:DENSITY[:SEED]'")
        try:
            bs, density, seed = int(args[0]), float(args[1]), int(args[2]) if len(args) == 3 else 0
        except ValueError:
            raise ValueError(f"mask={spec!r}: BLOCK and SEED must be integers, DENSITY a number") from None
        if bs <= 0 or not 0.0 <= density <= 1.0 or seed < 0:
            raise ValueError(f"mask={spec!r}: BLOCK must be > 0, DENSITY in [0, 1], SEED >= 0")
        if seqlen is None:
            return BlockSparse(bs, torch.ones(1, 1, dtype=torch.bool), source=spec)
        if seqlen % bs:
            raise ValueError(f"mask={spec!r}: block_size={bs} must divide the sequence length N={seqlen}")
        return BlockSparse(bs, random_block_mask(seqlen // bs, density, seed), source=spec)
    raise ValueError(f"mask={spec!r} is unknown; choose one of 'full', 'causal', 'window:L:R', "
                     "'docs:MEAN[:SEED]', 'docs:NAME[:SEED]', 'bsparse:BS:DENSITY[:SEED]'")


def _published_docs(spec: str, name: str, seed_arg: list, seqlen: int | None) -> Mask:
    """'docs:NAME[:SEED]': document lengths drawn from the published distribution NAME."""
    if name not in doc_lengths.names():
        raise ValueError(f"mask={spec!r}: {name!r} is neither a MEAN (an integer: the synthetic long-tailed "
                         f"lengths) nor a document-length distribution ({', '.join(doc_lengths.names())})")
    seed = _ints(seed_arg, spec, "SEED")[0] if seed_arg else 0
    if seed < 0:
        raise ValueError(f"mask={spec!r}: SEED must be >= 0")
    if seqlen is None:
        return Documents((0, 1))
    lengths = doc_lengths.sample_doc_lengths(seqlen, name, seed=seed)
    return Documents(tuple(itertools.accumulate(lengths, initial=0)), source=spec, causal=False)


def resolve(causal: bool, mask: "str | Mask | None", seqlen: int) -> Mask:
    """The one mask a call computes: ``mask`` (a spec string or a Mask; None or "" = no mask),
    intersected with the causal mask when ``causal`` is true; validated for ``seqlen`` tokens."""
    if mask is None or (isinstance(mask, str) and mask == ""):
        return Causal() if causal else Full()
    if isinstance(mask, str):
        m = parse(mask, seqlen)
    elif isinstance(mask, Mask):
        m = mask
        m.validate(seqlen)
    else:
        raise ValueError(f"mask={mask!r} must be a mask spec string or a burst_impl.masks.Mask "
                         "(Full, Causal, SlidingWindow, Documents, BlockSparse)")
    return m.with_causal() if causal else m


def label(spec: str) -> str:
    """The mask's part of a case name: '' for no mask, else the spec with ':' as '-'."""
    return "" if not spec else "mask-" + spec.replace(":", "-").replace(".", "p")
