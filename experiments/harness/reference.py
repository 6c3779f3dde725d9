"""The emulated machine's compute rate in each group's own rounds: the calibration's work timed beside the cases.

An emulated rank's kernels run on a share of a VM's cores, and how fast those cores are moves from minute to
minute: a 1.1-1.4x change within one run, the same in a step's CPU as in its wall time (docs/findings.md, "A
reference in every group's rounds"). The emulator's calibration measures the rate once, at bring-up, so a group
timed minutes later is priced at another minute's rate. So on an emulated cluster with a calibration,
``measure.measure_group`` times one more step in every round of the group: the calibration's work
(fwd+bwd of one full ``tokens x tokens`` block with the suite's kernels, ``block_step``; at most ``MAX_TOKENS``
tokens, back to back for ``MIN_SAMPLE_S``), on every rank at once after the round's barrier, as the cases' steps
are timed; it adds some 0.5 s to each round of an emulated run. Each record of the group carries its samples
(``time_reference``): the slowest rank's seconds per block and each rank's CPU. The model's validation divides
their median by the kernel table's time for the same work (``experiments/perfmodel/emulated/validate.py``,
``case_load``) and prices the group's kernels at that load (``at_reference=False``: at the bring-up's, as
reports before 2026-12-07 did; over every committed run with references the groups' own did better overall,
though not in every run: docs/findings.md, "Each group at its own reference").

Where the calibration timed the memory rate, a memory reference follows it in every round (``memory_step_for``:
``stream_step`` back to back for ``MIN_SAMPLE_S``, another 0.5 s a round; the record's ``time_memory_reference``).
The validation reports the load it gives beside each row (``validate.case_memory_load``) and prices the group's
memory-bound work at it only with ``memory_rule="group"``: the memory rate moved 1.6x between one run's bring-ups,
but over the decode runs timed with it the stream in the group's rounds did not follow the decode steps, and the
compute reference did (docs/findings.md, "Memory-bound work at the group's compute load").

    for ref in references_for(cluster_info):   # none: not an emulated run with a calibration
        rec[ref.name] = ref.to_field(ref.work, samples, cpu_samples)   # samples per call (measure: / work["calls"])
"""
from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass

import torch

from burst_impl import kernels
from burst_impl.flops import attention_flops
from burst_impl.shape import DTYPES, AttnShape

from . import cpuquota

WORK_KEYS = ("tokens", "heads", "head_dim", "dtype")
# at most this many tokens a block: the calibration's 2048-token block of 8 heads x 64 took 1.85 s a round at a
# quarter core (issue 36's run C), more than a decode group's three cases together
MAX_TOKENS = 512
# a sample runs the block back to back for at least this long: five of CFS's default 100 ms periods. A rank whose
# quota leaves cores free (4 ranks on 2 cores) runs a shorter sample at more than its cap: run D's 0.1 s blocks
# at G 4 ran at 0.28-0.31 of a core against 0.25, and priced the groups' kernels 30% fast
MIN_SAMPLE_S = 0.5
PERIODS = 2            # a reference shorter than this many of the run's CFS periods is not used (long_enough)


def block_step(tokens: int, heads: int, head_dim: int, dtype: str = "float32"):
    """The calibration's work as a callable: fwd+bwd of one full tokens x tokens block with the suite's
    kernels (``burst_impl.kernels``, what a ring step computes)."""
    dt = DTYPES[dtype]
    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(1, tokens, heads, head_dim, generator=g).to(dt) for _ in range(4))
    scale_ = kernels.default_scale(head_dim, None)

    def step():
        out, lse = kernels.attn_forward(q, k, v, causal=False, scale=scale_)
        delta = kernels.compute_delta(do, out)
        kernels.attn_backward(do, q, k, v, lse, delta, causal=False, scale=scale_)
    return step


STREAM_ELEMENTS = 1 << 23        # 32 MiB fp32 per operand: far larger than any cache of this machine
STREAM_BYTES = 3 * 4 * STREAM_ELEMENTS     # x.add_(y) reads two fp32 arrays and writes one


def stream_step():
    """The memory-bound work the kernel table prices a byte of traffic with (its ``("hbm",)`` key) and the
    emulator's calibration times at bring-up beside ``block_step``: ``x.add_(y)`` over two 32 MiB fp32 arrays,
    ``STREAM_BYTES`` a call. The machine's memory rate moves apart from its compute rate (docs/findings.md,
    "The memory rate apart from the compute rate")."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(STREAM_ELEMENTS, generator=g), torch.randn(STREAM_ELEMENTS, generator=g)
    return lambda: x.add_(y)


def work_of(cluster: dict) -> dict | None:
    """The calibration's work of an emulated run (``{tokens, heads, head_dim, dtype}``), at most ``MAX_TOKENS``
    tokens, or None: not emulated, or no calibration (given link rates)."""
    cal = cluster.get("calibration") or {}
    if not cluster.get("emulated") or not cal.get("per_rank_flops_s"):
        return None
    return {**{k: cal[k] for k in WORK_KEYS}, "tokens": min(int(cal["tokens"]), MAX_TOKENS)}


def calls_for(work: dict, per_rank_flops_s: float) -> int:
    """Blocks a sample runs back to back: ``MIN_SAMPLE_S`` at the calibration's rate per rank."""
    flops = attention_flops(AttnShape(1, int(work["tokens"]), int(work["heads"]), int(work["heads"]),
                                      int(work["head_dim"]), 1, causal=False), mode="fwd_bwd")
    return max(1, math.ceil(MIN_SAMPLE_S * per_rank_flops_s / flops))


def _repeated(fn, calls: int):
    """``fn`` run ``calls`` times a call (a reference's sample)."""
    def step(n=calls):
        for _ in range(n):
            fn()
    return step


def step_for(cluster: dict):
    """(the reference step, its work with ``calls``: blocks a sample) for a group measured on ``cluster``, or
    (None, None). One call of the step runs the block ``calls`` times."""
    work = work_of(cluster)
    if work is None:
        return None, None
    block = block_step(int(work["tokens"]), int(work["heads"]), int(work["head_dim"]), work["dtype"])
    work["calls"] = calls_for(work, float(cluster["calibration"]["per_rank_flops_s"]))
    return _repeated(block, work["calls"]), work


def memory_step_for(cluster: dict):
    """(the memory reference's step, ``{"bytes": per call, "calls": calls a sample}``) for a group measured on
    ``cluster``, or (None, None): ``stream_step`` back to back for ``MIN_SAMPLE_S`` at the bring-up's memory
    rate, timed in every round after the compute reference. Only on an emulated run whose calibration timed the
    memory rate (2026-12-06 on): the rate moves 1.6x between a run's bring-ups (docs/findings.md, "The memory rate
    apart from the compute rate"), and a group's ranks stream beside the group's caches, at its occupancy (at
    G 4, four ranks of the machine's eight)."""
    per_byte = (cluster.get("calibration") or {}).get("per_rank_memory_s_per_byte") if work_of(cluster) else None
    if not per_byte:
        return None, None
    calls = max(1, math.ceil(MIN_SAMPLE_S / (STREAM_BYTES * float(per_byte))))
    return _repeated(stream_step(), calls), {"bytes": STREAM_BYTES, "calls": calls}


def _timed(samples: list[float], cpu_samples: list[list[float]] | None) -> dict:
    """The slowest rank's seconds per call in each round, their median, and each rank's median CPU per call."""
    return {"samples_s": list(samples), "median_s": statistics.median(samples),
            "cpu_s_per_rank": [statistics.median(r) for r in cpu_samples] if cpu_samples else None}


def memory_field(work: dict, samples: list[float], cpu_samples: list[list[float]] | None) -> dict:
    """A record's ``time_memory_reference``: bytes a call, ``calls`` calls a sample, and ``_timed``'s."""
    return {"bytes": int(work["bytes"]), "calls": int(work["calls"]), **_timed(samples, cpu_samples)}


def field(work: dict, samples: list[float], cpu_samples: list[list[float]] | None) -> dict:
    """A record's ``time_reference``: the work (``calls`` blocks a sample) and ``_timed``'s, per block."""
    return {"work": {k: work[k] for k in WORK_KEYS}, "calls": int(work.get("calls", 1)),
            **_timed(samples, cpu_samples)}


@dataclass(frozen=True)
class Reference:
    """One reference a group times after its cases in every round: the record's field, the step, its work
    (``calls`` a sample) and how the samples become the field."""

    name: str
    step: Callable[[], None]
    work: dict
    to_field: Callable[[dict, list, list | None], dict]


def references_for(cluster: dict) -> list[Reference]:
    """The references a group measured on ``cluster`` times, in order: the compute rate (``step_for``), then the
    memory rate (``memory_step_for``); none off an emulated run with a calibration."""
    made = (("time_reference", step_for(cluster), field), ("time_memory_reference", memory_step_for(cluster),
                                                            memory_field))
    return [Reference(name, step, work, to_field) for name, (step, work), to_field in made if step is not None]


def long_enough(ref: dict, cluster: dict) -> bool:
    """Whether a record's reference spans ``PERIODS`` of its run's CFS period (``cpu_quota.period_us``; 100 ms
    where not recorded): a shorter sample measures the quota's burst, not the rate (``MIN_SAMPLE_S``)."""
    return float(ref["median_s"]) * int(ref.get("calls", 1)) >= PERIODS * cpuquota.period_s(cluster)
