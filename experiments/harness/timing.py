"""The one place where time is measured.

``time_steps`` runs warm-up steps, then ``repeats`` timed steps. Before each
timed step every rank synchronises its device and meets the others at a
barrier, so all ranks start the step together; each rank times its own step
(CUDA events on GPU, ``perf_counter`` on CPU) and the step's time is the
MAXIMUM over ranks (a distributed step is as slow as its slowest rank). Raw
per-step samples are returned; ``summarize`` gives median and quantiles.

An optional ``setup`` runs before each step and is not timed (e.g. the forward
whose backward is being timed).
"""
from __future__ import annotations

import statistics
import time
from typing import Callable

import torch
import torch.distributed as dist


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
    if not _dist_on():
        return list(values)
    # gloo reduces CPU tensors, NCCL CUDA tensors.
    where = device if device.type == "cuda" else torch.device("cpu")
    t = torch.tensor(values, dtype=torch.float64, device=where)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.cpu().tolist()


def _time_one(step: Callable[[], object], device: torch.device) -> float:
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize(device)
        return start.elapsed_time(end) / 1e3
    t0 = time.perf_counter()
    step()
    return time.perf_counter() - t0


def time_steps(step: Callable[[], object], *, warmup: int, repeats: int, device: torch.device,
               setup: Callable[[], object] | None = None, group=None) -> list[float]:
    """Per-step wall times in seconds, each the maximum over ranks; ``repeats`` samples."""
    if repeats < 1:
        raise ValueError(f"repeats={repeats} must be at least 1")
    for _ in range(warmup):
        if setup is not None:
            setup()
        step()
    synchronize(device)
    local: list[float] = []
    for _ in range(repeats):
        if setup is not None:
            setup()
        synchronize(device)
        barrier(group, device)
        local.append(_time_one(step, device))
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


def summarize(samples: list[float]) -> dict[str, float]:
    """Median, quantiles, mean, spread of per-step times (seconds)."""
    if not samples:
        return {}
    return {
        "time_median_s": statistics.median(samples),
        "time_p10_s": quantile(samples, 0.10),
        "time_p90_s": quantile(samples, 0.90),
        "time_mean_s": statistics.fmean(samples),
        "time_min_s": min(samples),
        "time_max_s": max(samples),
        "time_std_s": statistics.pstdev(samples) if len(samples) > 1 else 0.0,
    }


def ratio_interval(num: list[float], den: list[float], *, level: float = 0.95, n_boot: int = 4000,
                   seed: int = 0) -> dict[str, float]:
    """The ratio of medians median(num) / median(den) of two independent sets of step times, with a
    percentile-bootstrap interval at ``level`` (each set resampled with replacement; fixed seed, so
    the same samples give the same interval). E.g. num = flat-ring times, den = double-ring times:
    a speedup whose interval excludes 1 is a difference the measurement resolves."""
    import random

    if not num or not den:
        raise ValueError("ratio_interval needs at least one sample on each side")
    if not 0 < level < 1:
        raise ValueError(f"level={level} must be between 0 and 1")
    rng = random.Random(seed)
    boots = sorted(statistics.median(rng.choices(num, k=len(num))) / statistics.median(rng.choices(den, k=len(den)))
                   for _ in range(n_boot))
    alpha = (1 - level) / 2
    return {"ratio": statistics.median(num) / statistics.median(den), "lo": quantile(boots, alpha),
            "hi": quantile(boots, 1 - alpha), "level": level, "n_num": len(num), "n_den": len(den)}
