"""The speedup of one record over another, with its interval: the one definition that the run
summaries (``summary.py``), the figures (``plots.py``), the emulator's reports (``cluster/report.py``)
and the claims page (``report/compare.py``) all use.

``speedup(rec, base)`` is median(base's step times) / median(rec's): > 1 means ``rec`` is faster. Its
interval is the percentile bootstrap of that ratio of medians (``timing.ratio_interval``):

* **paired** where the two records were timed in the same interleaved rounds (``interleaved_with``
  names the other case and both have one sample per round): rounds are resampled, both sides of a
  round together, so a drift of the machine that slowed both methods alike does not widen it;
* **unpaired** otherwise (each side resampled on its own; e.g. a record against itself, or two runs);
* **no interval** where either side has fewer samples than its median's own 95% interval needs
  (``timing.median_ci``: 6 at 95%; older records have no samples at all): a bootstrap of 1 to 5
  samples claims more than they hold (with 5, all of them fall on one side of the median 6% of the
  time). Such a ratio decides nothing;
* **modelled, exact** where both records are the performance model's (one predicted time each, no
  samples): the ratio is exact, with no interval, and decides by its value.

A modelled record against a measured one is not a speedup: ValueError.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Mapping

from .timing import median_ci, ratio_interval

PAIRED, UNPAIRED, MODELLED, NO_INTERVAL = "paired bootstrap", "unpaired bootstrap", "modelled, exact", "no interval"
HOWS = (PAIRED, UNPAIRED, MODELLED, NO_INTERVAL)


@dataclass(frozen=True)
class Speedup:
    """t(base) / t(rec) and its interval at ``level`` (lo = hi = None without one)."""
    value: float | None       # None: a median time is missing
    lo: float | None
    hi: float | None
    how: str                  # one of HOWS
    n_rec: int                # samples behind each median (0: none recorded)
    n_base: int
    level: float = 0.95

    @property
    def has_interval(self) -> bool:
        return self.lo is not None and self.hi is not None

    def faster(self) -> bool | None:
        """Whether ``rec`` is resolved faster (True) or not (False); None when the ratio decides nothing:
        its interval contains 1, or a measured ratio has no interval. An exact (modelled) ratio decides
        by its value: equal times are not faster."""
        if self.value is None:
            return None
        if self.how == MODELLED:
            return self.value > 1
        if not self.has_interval or self.lo <= 1.0 <= self.hi:
            return None
        return self.lo > 1

    @property
    def resolved(self) -> bool:
        """The measurement (or the model) tells the two apart."""
        return self.faster() is not None


def _list(v) -> list:
    """A record's list field, read from JSON (a list) or a DataFrame row (a list or an array); [] when absent."""
    if isinstance(v, (list, tuple)) or getattr(v, "ndim", 0) > 0:
        return list(v)
    return []


def _samples(rec: Mapping) -> list[float]:
    """The raw step times; none for a record written without them (a modelled one, an old one)."""
    return [float(x) for x in _list(rec.get("time_samples_s"))]


def _median(rec: Mapping, samples: list[float]) -> float | None:
    """The recorded median (a modelled record's one predicted time), else the samples'."""
    v = rec.get("time_median_s")
    if v is not None and v == v:         # v != v: NaN, a DataFrame row's missing value
        return float(v)
    return statistics.median(samples) if samples else None


def _timed_together(rec: Mapping, base: Mapping, a: list[float], b: list[float]) -> bool:
    """Sample j of each was taken in round j: one lists the other as timed in its rounds, and both have
    one sample per round."""
    return len(a) == len(b) and (base.get("case_id") in _list(rec.get("interleaved_with"))
                                 or rec.get("case_id") in _list(base.get("interleaved_with")))


def speedup(rec: Mapping, base: Mapping, *, level: float = 0.95) -> Speedup:
    """How much faster ``rec`` is than ``base``, median(base) / median(rec), with its interval (see the
    module's docstring for which interval). ``rec`` and ``base`` are result records (dicts or rows)."""
    if not 0 < level < 1:
        raise ValueError(f"level={level} must be between 0 and 1")
    modelled = (rec.get("source") == "modelled", base.get("source") == "modelled")
    if modelled[0] != modelled[1]:
        raise ValueError(f"speedup: rec {rec.get('case_id')!r} is {'modelled' if modelled[0] else 'measured'} and "
                         f"base {base.get('case_id')!r} is not: a prediction over a measurement is not a speedup")
    a, b = _samples(rec), _samples(base)
    t_rec, t_base = _median(rec, a), _median(base, b)
    value = t_base / t_rec if t_rec and t_base is not None else None
    if all(modelled):
        return Speedup(value, None, None, MODELLED, len(a), len(b), level)
    if median_ci(a, level) is None or median_ci(b, level) is None:
        return Speedup(value, None, None, NO_INTERVAL, len(a), len(b), level)
    paired = _timed_together(rec, base, a, b)
    # num = base, den = rec: the bootstrap's ratio median(num) / median(den) is this speedup
    r = ratio_interval(b, a, level=level, paired=paired)
    return Speedup(r["ratio"], r["lo"], r["hi"], PAIRED if paired else UNPAIRED, len(a), len(b), level)
