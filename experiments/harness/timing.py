"""The one place where time is measured, and the statistics of the times.

``time_steps`` runs warm-up steps, then ``repeats`` timed steps. Before each
timed step every rank synchronises its device and meets the others at a
barrier, so all ranks start the step together; each rank times its own step
(CUDA events on GPU, ``perf_counter`` on CPU) and the step's time is the
MAXIMUM over ranks (a distributed step is as slow as its slowest rank). Raw
per-step samples are returned; ``summarize`` gives median, quantiles and the
95% confidence interval of the median.

``time_interleaved`` times several steps (methods sharing one case shape) in
rounds, A B C A B C ..., one sample of each per round, until the confidence
interval of every median is within ``RepeatPolicy.target`` (relative
half-width, e.g. +-5%), or a cap (``max_repeats``, or the wall-clock budget)
is reached. Interleaving spreads slow drifts of the machine (other load,
clocks, thermals) over every method alike, and pairs the samples by round, so
``ratio_interval(..., paired=True)`` gives the ratio of two methods with an
interval that such drifts do not widen.

The interval of a median is the distribution-free order-statistic interval
(``median_ci``): with n samples it is [x_(k), x_(n+1-k)] for the largest k
whose binomial coverage is at least the level; it exists from n = 6 on at 95%.

An optional ``setup`` runs before each step and is not timed (e.g. the forward
whose backward is being timed).

``autorange`` says how many calls of a short step one sample should run back to
back so that it lasts a minimum time (``timeit.autorange``'s rule, 0.2 s there):
a decode step of a few ms, timed alone after a barrier, meets neither the
preceding step's cache nor, on a CPU rank capped by CFS bandwidth control, the
quota that the steps before it spent (docs/inference.md). ``Interleaved.per_call``
turns such samples back into per-call times.
"""
from __future__ import annotations

import math
import random
import statistics
import time
from dataclasses import dataclass, replace
from typing import Callable

import torch
import torch.distributed as dist

from burst_impl import comm


def _dist_on() -> bool:
    return dist.is_available() and dist.is_initialized()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def barrier(group=None, device: torch.device | None = None) -> None:
    if not _dist_on():
        return
    if device is not None and device.type == "cuda":
        dist.barrier(group=group, device_ids=[device.index or 0])
    else:
        dist.barrier(group=group)


def max_over_ranks(values: list[float], device: torch.device, group=None) -> list[float]:
    """Element-wise maximum of a per-rank list of floats (identity at world size 1)."""
    return [max(col) for col in zip(*over_ranks(values, device, group))]


def over_ranks(values: list[float], device: torch.device, group=None) -> list[list[float]]:
    """Every rank's list of floats, in rank order (one all-gather; ``[values]`` at world size 1): the slowest
    rank's and the mean rank's times come from one collective."""
    if not _dist_on():
        return [list(values)]
    # gloo gathers CPU tensors, NCCL CUDA tensors.
    where = device if device.type == "cuda" else torch.device("cpu")
    t = torch.tensor(values, dtype=torch.float64, device=where)
    out = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, t, group=group)
    return [o.cpu().tolist() for o in out]


def _warm_up(step: Callable[[], object], setup: Callable[[], object] | None, warmup: int,
             device: torch.device) -> None:
    for _ in range(warmup):
        if setup is not None:
            setup()
        step()
    synchronize(device)


def _sample(step: Callable[[], object], setup: Callable[[], object] | None, device: torch.device,
            group) -> tuple[float, float, float]:
    """One timed step on this rank: its setup untimed, then every rank synchronised and met at the
    barrier, then the step alone between the two clock readings. -> (wall seconds, this process's CPU
    seconds over the step: every thread's, gloo's included, the work a capped CPU rank pays for at its
    cap; on a GPU the host's share, whose queueing the events do not see; the calling thread's CPU
    seconds: the kernels (one intra-op thread on an emulated rank) and the Python and dispatcher work,
    while the process group's worker threads, which run the transfers, make the rest)."""
    if setup is not None:
        setup()
    synchronize(device)
    barrier(group, device)
    c0, m0 = time.process_time(), time.thread_time()
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize(device)
        return start.elapsed_time(end) / 1e3, time.process_time() - c0, time.thread_time() - m0
    t0 = time.perf_counter()
    step()
    return time.perf_counter() - t0, time.process_time() - c0, time.thread_time() - m0


def time_steps(step: Callable[[], object], *, warmup: int, repeats: int, device: torch.device,
               setup: Callable[[], object] | None = None, group=None) -> list[float]:
    """Per-step wall times in seconds, each the maximum over ranks; ``repeats`` samples."""
    if repeats < 1:
        raise ValueError(f"repeats={repeats} must be at least 1")
    with comm.agree_once():   # the warm-up agrees on the inputs; the timed calls reuse it
        _warm_up(step, setup, warmup, device)
        local = [_sample(step, setup, device, group)[0] for _ in range(repeats)]
    return max_over_ranks(local, device, group)


def quantile(samples: list[float], q: float) -> float:
    """Linear-interpolation quantile (numpy's default), no numpy needed."""
    xs = sorted(samples)
    if not xs:
        return float("nan")
    pos = q * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def median_ci(samples: list[float], level: float = 0.95) -> tuple[float, float] | None:
    """Distribution-free confidence interval of the median: order statistics (x_(k), x_(n+1-k)) with
    the largest k such that P(k <= rank of the median < n+1-k) >= ``level`` under Binomial(n, 1/2).
    None when n is too small for any interval at that level (n < 6 at 95%)."""
    if not 0 < level < 1:
        raise ValueError(f"level={level} must be between 0 and 1")
    xs = sorted(samples)
    n = len(xs)
    tail = 0.0          # P(B <= k-1), B ~ Binomial(n, 1/2)
    best = None
    for k in range(1, n // 2 + 1):
        tail += math.comb(n, k - 1) / 2 ** n
        if 1 - 2 * tail < level:
            break
        best = k
    return (xs[best - 1], xs[n - best]) if best else None


def ci_halfwidth(samples: list[float], level: float = 0.95) -> float:
    """Relative half-width of the median's interval: max(median - lo, hi - median) / median; inf when
    there is no interval yet (too few samples) or the median is not positive."""
    ci = median_ci(samples, level)
    med = statistics.median(samples) if samples else 0.0
    if ci is None or med <= 0:
        return math.inf
    return max(med - ci[0], ci[1] - med) / med


@dataclass(frozen=True)
class RepeatPolicy:
    """When to stop timing: at least ``min_repeats`` samples, then until the median's interval at
    ``level`` is within +-``target`` (relative half-width) for every step, at most ``max_repeats``
    samples, and no round started after ``budget_s`` seconds of timing (the case's wall-clock budget
    must cover the memory and byte steps that follow)."""

    min_repeats: int
    max_repeats: int
    target: float = 0.05
    level: float = 0.95
    budget_s: float = math.inf

    def __post_init__(self):
        if self.min_repeats < 1:
            raise ValueError(f"min_repeats={self.min_repeats} must be at least 1")
        if self.max_repeats < self.min_repeats:
            raise ValueError(f"max_repeats={self.max_repeats} must be >= min_repeats={self.min_repeats}")
        if not self.target > 0:
            raise ValueError(f"target={self.target} must be a positive relative half-width (0.05 = +-5%)")

    def stop(self, samples: list[list[float]], elapsed_s: float, round_s: float) -> str | None:
        """Why to stop after these samples (one list per step, equal lengths), else None."""
        n = len(samples[0])
        if n < self.min_repeats:
            return None
        if all(ci_halfwidth(s, self.level) <= self.target for s in samples):
            return "converged"
        if n >= self.max_repeats:
            return "max_repeats"
        if elapsed_s + round_s > self.budget_s:
            return "time_budget"
        return None


@dataclass(frozen=True)
class Interleaved:
    samples: list[list[float]]      # per step, one sample per round (max over ranks), round order
    stop: str                       # converged | max_repeats | time_budget
    rounds: int
    mean_samples: list[list[float]] | None = None   # the same rounds' mean over ranks
    # per step, per rank: the rank's process CPU seconds in each round (``_sample``), round order
    cpu_samples: list[list[list[float]]] | None = None
    # the same, the timing thread's CPU alone (its kernels and host work; the transfers' threads excluded)
    cpu_main_samples: list[list[list[float]]] | None = None

    def per_call(self, calls: list[int]) -> "Interleaved":
        """The same rounds with step i's every sample (wall, mean over ranks, each rank's CPU) divided by
        ``calls[i]``, the calls it ran back to back (``autorange``): per-call times."""
        if len(calls) != len(self.samples) or any(c < 1 for c in calls):
            raise ValueError(f"calls={calls}: one count >= 1 per step ({len(self.samples)} steps)")

        def per_step(rows):      # step i's nested lists of seconds, each divided by calls[i]
            return None if rows is None else [_divided(r, c) for r, c in zip(rows, calls)]
        return replace(self, samples=per_step(self.samples), mean_samples=per_step(self.mean_samples),
                       cpu_samples=per_step(self.cpu_samples), cpu_main_samples=per_step(self.cpu_main_samples))


def _divided(x, c: int):
    """Seconds ``x`` (a number or nested lists of them) over ``c`` calls."""
    return [_divided(y, c) for y in x] if isinstance(x, list) else x / c


def autorange(call: Callable[[], object], setup: Callable[[], object] | None, min_s: float, *, cap: int,
              device: torch.device, group=None, pilots: int = 3) -> int:
    """Calls of ``call`` one sample runs back to back so that it lasts at least ``min_s`` seconds: ``min_s``
    over the fastest of ``pilots`` timed calls (each the maximum over ranks; one untimed call first), rounded
    up, between 1 and ``cap``. The same on every rank. ``min_s`` <= 0: 1, nothing run."""
    if cap < 1:
        raise ValueError(f"cap={cap} must be at least 1")
    if min_s <= 0:
        return 1
    with comm.agree_once():   # the first call agrees on the inputs; the pilots reuse it, as the timed calls will
        _warm_up(call, setup, 1, device)
        fastest = min(max_over_ranks([_sample(call, setup, device, group)[0] for _ in range(pilots)], device, group))
    return max(1, min(cap, math.ceil(min_s / max(fastest, 1e-9))))


def time_interleaved(steps: list[tuple[Callable[[], object], Callable[[], object] | None]], *, warmup: int,
                     policy: RepeatPolicy, device: torch.device, group=None,
                     on_step: Callable[[int], None] | None = None, judged: int | None = None) -> Interleaved:
    """Time ``steps`` ((step, setup) pairs) in rounds A B C A B C ... until ``policy`` says stop.

    After each round every rank holds the same numbers (the round's samples and the elapsed time,
    maximum over ranks), so every rank takes the same stop decision. ``on_step(i)`` is called before
    step i runs (the worker's watchdog names the case that hangs). ``judged``: the policy's interval
    target judges the first ``judged`` steps only (the rest, a reference timed beside them, still costs
    its time in the rounds); None: every step."""
    if not steps:
        raise ValueError("time_interleaved needs at least one step")
    judged = len(steps) if judged is None else judged
    if not 1 <= judged <= len(steps):
        raise ValueError(f"judged={judged} must be between 1 and the {len(steps)} steps")
    with comm.agree_once():   # each method's warm-up agrees on its inputs; its timed calls reuse it
        return _interleave(steps, warmup, policy, device, group, on_step, judged)


def _interleave(steps, warmup: int, policy: "RepeatPolicy", device: torch.device, group, on_step,
                judged: int) -> Interleaved:
    t0 = time.perf_counter()
    for i, (step, setup) in enumerate(steps):
        if on_step is not None:
            on_step(i)
        _warm_up(step, setup, warmup, device)
    t_rounds = time.perf_counter()
    samples: list[list[float]] = [[] for _ in steps]
    means: list[list[float]] = [[] for _ in steps]
    cpus: list[list[list[float]]] = [[] for _ in steps]
    mains: list[list[list[float]]] = [[] for _ in steps]
    k = len(steps)
    while True:
        local = []
        for i, (step, setup) in enumerate(steps):
            if on_step is not None:
                on_step(i)
            local.append(_sample(step, setup, device, group))
        # one gather a round: every step's wall time, the elapsed time, every step's process and main-thread CPU
        per_rank = over_ranks([w for w, _, _ in local] + [time.perf_counter() - t0] + [c for _, c, _ in local]
                              + [m for _, _, m in local], device, group)
        cols = list(zip(*per_rank))
        elapsed = max(cols[k])
        for s, m, c, t, col, cpu, main in zip(samples, means, cpus, mains, cols[:k], cols[k + 1:2 * k + 1],
                                              cols[2 * k + 1:]):
            s.append(max(col))
            m.append(sum(col) / len(col))
            c.append(list(cpu))
            t.append(list(main))
        n = len(samples[0])
        # the next round costs about what the rounds so far cost on average (setups included)
        round_s = (elapsed - (t_rounds - t0)) / n
        why = policy.stop(samples[:judged], elapsed, round_s)
        if why:
            return Interleaved(samples=samples, stop=why, rounds=n, mean_samples=means,
                               cpu_samples=[[list(r) for r in zip(*c)] for c in cpus],
                               cpu_main_samples=[[list(r) for r in zip(*t)] for t in mains])


def summarize(samples: list[float], level: float = 0.95) -> dict[str, float]:
    """Median with its confidence interval, quantiles, mean, spread of per-step times (seconds).
    ``time_ci_lo_s``/``time_ci_hi_s`` are None when there are too few samples for an interval."""
    if not samples:
        return {}
    ci = median_ci(samples, level)
    return {
        "time_median_s": statistics.median(samples),
        "time_ci_lo_s": ci[0] if ci else None,
        "time_ci_hi_s": ci[1] if ci else None,
        "time_ci_level": level,
        "time_ci_halfwidth_rel": ci_halfwidth(samples, level) if ci else None,
        "time_p10_s": quantile(samples, 0.10),
        "time_p90_s": quantile(samples, 0.90),
        "time_mean_s": statistics.fmean(samples),
        "time_min_s": min(samples),
        "time_max_s": max(samples),
        "time_std_s": statistics.pstdev(samples) if len(samples) > 1 else 0.0,
    }


def ratio_interval(num: list[float], den: list[float], *, level: float = 0.95, n_boot: int = 4000,
                   seed: int = 0, paired: bool = False) -> dict[str, float]:
    """The ratio of medians median(num) / median(den) of two sets of step times, with a
    percentile-bootstrap interval at ``level`` (fixed seed, so the same samples give the same
    interval). E.g. num = flat-ring times, den = double-ring times: a speedup whose interval excludes
    1 is a difference the measurement resolves.

    Independent sets: each is resampled on its own. ``paired=True`` (samples taken in the same
    interleaved rounds, ``time_interleaved``; equal lengths): rounds are resampled, both sides of a
    round together, so a drift of the machine that slowed both does not widen the interval."""
    if not num or not den:
        raise ValueError("ratio_interval needs at least one sample on each side")
    if not 0 < level < 1:
        raise ValueError(f"level={level} must be between 0 and 1")
    if paired and len(num) != len(den):
        raise ValueError(f"paired=True needs one sample per round on each side; got {len(num)} and {len(den)}")
    rng = random.Random(seed)
    boots = []
    for _ in range(n_boot):
        if paired:
            idx = rng.choices(range(len(num)), k=len(num))
            a, b = [num[i] for i in idx], [den[i] for i in idx]
        else:
            a, b = rng.choices(num, k=len(num)), rng.choices(den, k=len(den))
        boots.append(statistics.median(a) / statistics.median(b))
    boots.sort()
    alpha = (1 - level) / 2
    return {"ratio": statistics.median(num) / statistics.median(den), "lo": quantile(boots, alpha),
            "hi": quantile(boots, 1 - alpha), "level": level, "n_num": len(num), "n_den": len(den),
            "paired": paired}
