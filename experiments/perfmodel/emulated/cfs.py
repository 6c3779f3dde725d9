"""A CPU rank's compute under CFS bandwidth control, as a fluid: an opt-in schedule for the emulated validation.

The emulated cluster caps each rank's cgroup at ``cap`` of a core: a quota of ``cap x period`` CPU seconds in each
CFS period (``harness.cpuquota``: 100 ms by default), on a machine of ``cores`` cores. The default model prices a
rank's compute at the cap's rate throughout (the kernel table's CPU seconds over the cap). The kernel does not run
a rank at that rate: a runnable rank with quota left runs at its share of the cores (all of one where its
neighbours wait), until its period's quota is spent, and then waits for the next period. So a rank that waits on a
link spends none of its quota there, and its compute after the wait runs faster than the cap's rate: a wait and
compute at the cap can overlap within a period. A trace of the ranks' posts, waits and kernels in a run shows it
(docs/findings.md, "Waits inside the quota's periods").

``SharedCpu.finish`` gives a compute task's end from its start and its seconds at the cap (CPU = seconds x cap):
the rank runs at ``min(1, cores / running ranks)`` while its period's quota lasts. The running ranks are read from
the previous pass's run segments, so ``CfsShare.schedules`` builds the schedule ``passes + 1`` times: the first at
the cap's rate (the default model's times), each later one with the running count of the one before. Every rank's
periods start with the call, its quota whole (the ranks leave the barrier before the call idle).

Opt-in (``burst-bench cluster history <experiment> --cfs``; ``validate.compare(cfs=True)``): docs/findings.md says
why it is not the default.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass

from ...harness import cpuquota
from ..simulator import Schedule

EPS = 1e-12


@dataclass(frozen=True)
class CfsShare:
    """CFS bandwidth control of a run's ranks: ``cores`` of the machine, ``cap`` of a core each, ``period_s``."""

    cores: float
    cap: float
    period_s: float
    passes: int = 3

    def __post_init__(self):
        for name in ("cores", "cap", "period_s"):
            v = getattr(self, name)
            if not v > 0:
                raise ValueError(f"{name}={v!r} must be > 0")
        if self.passes < 1:
            raise ValueError(f"passes={self.passes!r} must be >= 1")

    @classmethod
    def of(cls, cluster: dict, world_size: int) -> "CfsShare | None":
        """The share a record's cluster ran its ranks at (``cpu_quota``, ``ranks_per_core``); None uncapped."""
        quota = cluster.get("cpu_quota") or {}
        per_core = cluster.get("ranks_per_core")
        if not quota.get("applied") or not quota.get("cpus_per_rank") or not per_core:
            return None
        return cls(cores=world_size / float(per_core), cap=float(quota["cpus_per_rank"]),
                   period_s=cpuquota.period_s(cluster))

    def schedules(self):
        """The schedules a prediction is built on in turn; the last one is the prediction."""
        sch = Schedule(cpu=SharedCpu(self, None))
        yield sch
        for _ in range(self.passes):
            sch = Schedule(cpu=SharedCpu(self, running(sch.cpu.segments)))
            yield sch


def running(segments: list[tuple[float, float, int]]) -> tuple[list[float], list[int]]:
    """(times, counts): how many ranks run from each time on (``segments``: (start, end, rank))."""
    events = sorted(e for a, b, _ in segments if b > a for e in ((a, 1), (b, -1)))
    times: list[float] = []
    counts: list[int] = []
    n = 0
    for x, d in events:
        n += d
        if times and x - times[-1] <= EPS:
            counts[-1] = n
        else:
            times.append(x)
            counts.append(n)
    return times, counts


class SharedCpu:
    """One pass's CPU: each rank's quota spent per period, and the segments its compute ran in."""

    def __init__(self, share: CfsShare, profile: tuple[list[float], list[int]] | None):
        self.share, self.profile = share, profile
        self.used: dict[tuple[int, int], float] = {}
        self.segments: list[tuple[float, float, int]] = []

    def _speed(self, now: float) -> tuple[float, float]:
        """(cores a running rank gets at ``now``, until when); without a profile, the cap's rate throughout."""
        if self.profile is None:
            return self.share.cap, float("inf")
        times, counts = self.profile
        i = bisect.bisect_right(times, now + EPS) - 1
        n = counts[i] if i >= 0 else 0
        until = times[i + 1] if i + 1 < len(times) else float("inf")
        return min(1.0, self.share.cores / max(1, n)), until

    def finish(self, rank: int, start: float, seconds: float) -> float:
        """The end of ``seconds`` of compute at the cap (CPU ``seconds x cap``) that ``rank`` starts at ``start``."""
        s = self.share
        quota = s.cap * s.period_s
        now, cpu = start, seconds * s.cap
        while cpu > EPS:
            k = int(now / s.period_s + 1e-9)
            bound = (k + 1) * s.period_s
            left = quota - self.used.get((rank, k), 0.0)
            if left <= EPS:
                now = bound
                continue
            speed, until = self._speed(now)
            lim = min(bound, until)
            if lim - now <= EPS:
                now = lim if lim > now else now + EPS
                continue
            run = min(cpu, left, (lim - now) * speed)
            end = lim if run >= (lim - now) * speed else now + run / speed
            self.segments.append((now, end, rank))
            self.used[(rank, k)] = quota - left + run
            now, cpu = end, cpu - run
        return now
