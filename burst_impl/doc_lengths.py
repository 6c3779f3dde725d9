"""Document lengths drawn from published corpus length distributions (issue 37, item 1).

The field's varlen context-parallel benchmarks pack each sequence with documents drawn from a corpus's
length histogram: MagiAttention's CP benchmark and LongCA-bench (arXiv 2510.17896). Their histograms
are transcribed, each with its source and transcription rule, in ``burst_impl/doc_lengths_data/*.yaml``
(one file per distribution; its file name is the distribution's name). The suite's synthetic seeded
log-normal (``masks.long_tailed_lengths``, mask ``"docs:MEAN[:SEED]"``) stays the default of the
``docs`` mask; a distribution here is named as ``"docs:NAME[:SEED]"``.

A pack of N tokens (``sample_doc_lengths``) is a window of the stream MagiAttention packs from:

1. documents drawn independently from the histogram: a bin with its probability, then a length
   uniform over the bin's integers (LongCA-bench's rule; MagiAttention reads a bin as its midpoint,
   which gives the same bin frequencies);
2. a document longer than the cap, floor(max_frac * N), becomes pieces of the cap and one shorter
   remainder: MagiAttention's rule (``chunk_ratio = 0.25``), which keeps every drawn token where a
   rejection would thin out the long documents' tokens, and keeps the mask from turning into plain
   causal ("no sample exceeds 16K when measuring with a 64K total sequence length");
3. all pieces shuffled and packed end to end, so that "the probability of tokens from long and short
   samples within each pack matches the dataset" (their words). Over a whole corpus that makes the
   pieces of a pack independent draws from the pieces' distribution, which is how they are drawn
   here (a cap-long piece with its odds, else a document's remainder), until they reach N; the one
   that crosses N is cut there. Drawing whole documents per pack instead would put a document far
   longer than N (Pile's reach 9.3M tokens) in few packs, and fill those with its pieces: the packs'
   tokens would then follow the documents' counts, not the corpus's tokens.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import yaml

DATA_DIR = Path(__file__).resolve().parent / "doc_lengths_data"


@dataclass(frozen=True)
class LengthHistogram:
    """Document counts over length bins: bin i holds the lengths ``lo[i]..hi[i]`` (both included),
    with probability ``prob[i]`` (normalised); the bins are increasing and do not overlap."""

    name: str
    lo: tuple[int, ...]
    hi: tuple[int, ...]
    prob: tuple[float, ...]
    source: str = ""   # repository, path and commit (or paper table), for the record

    @property
    def mean(self) -> float:
        """The mean document length (uniform within each bin), tokens."""
        return float(sum(p * (a + b) / 2 for a, b, p in zip(self.lo, self.hi, self.prob)))

    def draw(self, rng: np.random.Generator, count: int) -> np.ndarray:
        """``count`` document lengths (int64): a bin by its probability, a length uniform in it."""
        b = rng.choice(len(self.prob), size=count, p=np.asarray(self.prob))
        return rng.integers(np.asarray(self.lo)[b], np.asarray(self.hi)[b], endpoint=True, dtype=np.int64)

    def counts(self, lengths) -> np.ndarray:
        """How many of ``lengths`` fall in each bin (a length outside every bin is not counted)."""
        x = np.asarray(lengths, dtype=np.int64)
        i = np.searchsorted(np.asarray(self.lo), x, side="right") - 1
        inside = (i >= 0) & (x <= np.asarray(self.hi)[np.clip(i, 0, None)])
        return np.bincount(i[inside], minlength=len(self.prob))


def names() -> tuple[str, ...]:
    """The distributions in ``doc_lengths_data/``, sorted."""
    return tuple(sorted(p.stem for p in DATA_DIR.glob("*.yaml")))


@functools.lru_cache(maxsize=None)
def load(name: str) -> LengthHistogram:
    """The distribution ``name`` (a file of ``doc_lengths_data/``), validated."""
    if name not in names():
        raise ValueError(f"distribution={name!r} is not a document-length distribution; choose one of "
                         f"{', '.join(names())} (files in {DATA_DIR})")
    path = DATA_DIR / f"{name}.yaml"
    raw = yaml.safe_load(path.read_text())
    bins = raw.get("bins") if isinstance(raw, dict) else None
    if not bins or any(not isinstance(b, list) or len(b) != 3 for b in bins):
        raise ValueError(f"{path}: 'bins' must be a non-empty list of [lo, hi, weight]")
    lo, hi, weight = (tuple(col) for col in zip(*bins))
    _check_bins(path, lo, hi, weight)
    src = raw.get("source", {})
    source = f"{src.get('repository', '')}:{src.get('path', '')}@{src.get('commit', '')}" if src else ""
    total = float(sum(weight))
    return LengthHistogram(name, lo, hi, tuple(w / total for w in weight), source)


def _check_bins(path, lo, hi, weight) -> None:
    for i, (a, b, w) in enumerate(zip(lo, hi, weight)):
        if not (isinstance(a, int) and isinstance(b, int) and 1 <= a <= b):
            raise ValueError(f"{path}: bin {i} [{a}, {b}] must be integers with 1 <= lo <= hi")
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not w > 0:
            raise ValueError(f"{path}: bin {i} weight={w!r} must be a number > 0")
        if i and a <= hi[i - 1]:
            raise ValueError(f"{path}: bin {i} starts at {a}, inside or before bin {i - 1} (ends at {hi[i - 1]}); "
                             "bins must increase without overlapping")


def _check_args(n_tokens, distribution, seed, max_frac) -> LengthHistogram:
    if isinstance(n_tokens, bool) or not isinstance(n_tokens, int) or n_tokens < 1:
        raise ValueError(f"n_tokens={n_tokens!r} must be an integer >= 1 (tokens in the pack)")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed={seed!r} must be an integer >= 0")
    if isinstance(max_frac, bool) or not isinstance(max_frac, (int, float)) or not 0 < max_frac <= 1:
        raise ValueError(f"max_frac={max_frac!r} must be a number in (0, 1] (the longest document over n_tokens)")
    if math.floor(n_tokens * max_frac) < 1:
        raise ValueError(f"max_frac={max_frac!r} leaves no room for a document in n_tokens={n_tokens}: "
                         "max_frac * n_tokens must be >= 1")
    if isinstance(distribution, LengthHistogram):
        return distribution
    if isinstance(distribution, str):
        return load(distribution)
    raise ValueError(f"distribution={distribution!r} must be a name ({', '.join(names())}) "
                     "or a burst_impl.doc_lengths.LengthHistogram")


def _floor_sum(x: int, cap: int) -> int:
    """sum of floor(L / cap) over L = 0..x."""
    q = x // cap
    return cap * q * (q - 1) // 2 + q * (x - q * cap + 1)


def _piece_odds(hist: LengthHistogram, cap: int) -> tuple[float, float]:
    """Per document (step 2): the expected number of cap-long pieces, and the probability that a
    shorter remainder is left (the length is not a multiple of the cap); exact over each bin."""
    full = rest = 0.0
    for a, b, p in zip(hist.lo, hist.hi, hist.prob):
        width = b - a + 1
        full += p * (_floor_sum(b, cap) - _floor_sum(a - 1, cap)) / width
        rest += p * (1 - (b // cap - (a - 1) // cap) / width)
    return full, rest


def _draw_pieces(hist: LengthHistogram, cap: int, p_cap: float, rng: np.random.Generator,
                 count: int) -> np.ndarray:
    """``count`` pieces of the shuffled stream: cap-long with probability ``p_cap``, else the
    remainder of a drawn document (drawn again while the remainder is 0)."""
    out = np.full(count, cap, dtype=np.int64)
    need = np.flatnonzero(rng.random(count) >= p_cap)
    while need.size:
        rest = hist.draw(rng, need.size) % cap
        out[need[rest > 0]] = rest[rest > 0]
        need = need[rest == 0]
    return out


def sample_doc_lengths(n_tokens: int, distribution: "str | LengthHistogram", *, seed: int,
                       max_frac: float = 0.25) -> list[int]:
    """Document lengths of one pack of ``n_tokens`` tokens drawn from ``distribution`` (a name of
    ``names()`` or a ``LengthHistogram``): they sum to ``n_tokens`` exactly, none is longer than
    floor(max_frac * n_tokens), and the same arguments give the same list. The steps are the module's."""
    hist = _check_args(n_tokens, distribution, seed, max_frac)
    cap = math.floor(n_tokens * max_frac)
    full, rest = _piece_odds(hist, cap)
    piece_mean = hist.mean / (full + rest)
    rng = np.random.default_rng(seed)
    pools, total = [], 0
    while total < n_tokens:
        # enough pieces for the rest in one draw, usually
        count = max(64, math.ceil(1.25 * (n_tokens - total) / piece_mean))
        pieces = _draw_pieces(hist, cap, full / (full + rest), rng, count)
        pools.append(pieces)
        total += int(pieces.sum())
    pool = np.concatenate(pools)
    ends = np.cumsum(pool)
    last = int(np.searchsorted(ends, n_tokens))   # the first piece whose end reaches n_tokens
    out = pool[:last + 1].tolist()
    out[-1] -= int(ends[last]) - n_tokens
    return out
