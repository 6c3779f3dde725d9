"""What a paper's number is, read from one of our records: value, its 95% interval, unit, and which way
is better. Throughputs are work / time, so their interval is the time interval inverted; a record
without ``time_ci_lo_s`` / ``time_ci_hi_s`` has no interval, and says so (None), never a made-up one.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

GB = 2 ** 30      # the papers' "GB" are torch's allocator numbers, i.e. GiB


def _interval(rec: dict) -> tuple[float, float] | None:
    lo, hi = rec.get("time_ci_lo_s"), rec.get("time_ci_hi_s")
    return (float(lo), float(hi)) if lo is not None and hi is not None else None


def _time(rec: dict) -> float | None:
    t = rec.get("time_median_s")
    return float(t) if t is not None else None


def _tokens_per_gpu(rec: dict) -> float | None:
    t = _time(rec)
    if not t:
        return None
    return rec.get("batch", 1) * rec["seqlen"] / t / rec.get("world_size", 1)


def _memory(rec: dict) -> float | None:
    # model-level records keep weights/optimizer state apart from the step's peak: the total is per GPU
    b = rec.get("mem_total_bytes") or rec.get("mem_peak_bytes")
    return b / GB if b else None


def _tflops(rec: dict) -> float | None:
    v = rec.get("tflops_per_rank")
    return float(v) if v is not None else None


def _perplexity(rec: dict) -> float | None:
    # a perplexity run's held-out value is Table 4's own quantity; a training run has only its losses, and
    # its first step (same seeded batch, weights not yet updated) is where every method must agree
    if rec.get("perplexity") is not None:
        return float(rec["perplexity"])
    losses = rec.get("losses") or []
    return math.exp(losses[0]) if losses else None


@dataclass(frozen=True)
class Quantity:
    name: str
    label: str
    unit: str
    better: str                              # "lower" | "higher"
    read: Callable[[dict], float | None]
    timing: str | None       # "time": value ∝ time, "inverse": ∝ 1/time, None: not timed (exact, no interval)

    def interval(self, rec: dict) -> tuple[float, float] | None:
        iv, t, v = _interval(rec), _time(rec), self.read(rec)
        if self.timing is None or iv is None or not t or v is None:
            return None
        return (iv[0] / t * v, iv[1] / t * v) if self.timing == "time" else (t / iv[1] * v, t / iv[0] * v)


QUANTITIES: dict[str, Quantity] = {q.name: q for q in (
    Quantity("latency_s", "first-token latency", "s", "lower", _time, "time"),
    Quantity("step_time_s", "time per iteration", "s", "lower", _time, "time"),
    Quantity("tokens_per_s_per_gpu", "tokens/s per GPU", "tokens/s", "higher", _tokens_per_gpu, "inverse"),
    Quantity("memory_gb", "memory per GPU", "GB", "lower", _memory, None),
    Quantity("tflops_per_gpu", "TFLOP/s per GPU", "TFLOP/s", "higher", _tflops, "inverse"),
    Quantity("perplexity", "perplexity (held-out after training, else exp of the first loss)", "", "lower",
             _perplexity, None),
)}
