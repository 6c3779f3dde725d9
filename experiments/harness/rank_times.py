"""The slowest rank's and the mean rank's time of a record, and TFLOP/s per rank from either (issue 37 item 3).

A distributed step is as slow as its slowest rank, so the suite's time (``time_median_s``: per round the maximum
over ranks, then the median over rounds) and its TFLOP/s (``tflops_per_rank``) are the slowest rank's. Every
timed record also carries the mean rank's (``time_mean_rank_s``: per round the mean over ranks, then the median;
the performance model: the mean of the ranks' last tasks), which is what codes that average over ranks report
(MagiAttention's CP benchmark divides by the ranks' summed time). ``SLOWEST`` is the default everywhere; tables
put ``MEAN`` beside it. A record measured before the field existed has no mean rank's time: None, never a
value made up from the slowest's.
"""
from __future__ import annotations

import math

SLOWEST, MEAN = "slowest", "mean"
WHICH = (SLOWEST, MEAN)
FIELD = {SLOWEST: "time_median_s", MEAN: "time_mean_rank_s"}


def _num(v) -> float | None:
    if v is None:
        return None
    v = float(v)
    return None if math.isnan(v) else v


def rank_time(rec, which: str = SLOWEST) -> float | None:
    """The record's time per step of the slowest rank (default) or of the mean rank; None where it has none."""
    if which not in FIELD:
        raise ValueError(f"which={which!r} must be one of {WHICH}")
    return _num(rec.get(FIELD[which]))


def tflops_per_rank(rec, which: str = SLOWEST) -> float | None:
    """TFLOP/s per rank: the record's FLOPs (the suite's one convention, burst_impl/flops.py) over the chosen
    rank's time and the world size. None where the record has no FLOPs or no such time."""
    t, flops = rank_time(rec, which), _num(rec.get("flops"))
    if not t or flops is None:
        return None
    return flops / t / int(rec.get("world_size") or 1) / 1e12


def spread(rec) -> float | None:
    """Slowest over mean rank's time (1 = every rank finished together); None without the mean rank's."""
    slow, mean = rank_time(rec, SLOWEST), rank_time(rec, MEAN)
    return slow / mean if slow and mean else None
