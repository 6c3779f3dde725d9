"""The share of a core a rank runs at when the ranks meet after every piece of work (a lockstep).

Each emulated rank is capped at a share of a core (``cluster.cpu_quota``). Where the quotas fill the cores
(8 ranks at 0.25 on 2 cores), a rank that waits for its peers after each piece of work runs at less than its
cap: the scheduler's periods and the ranks' quotas fall out of phase, and the slowest rank sets each meeting.
The kernel table (``perfmodel/emulated/measured.py``) times its work free-running at the cap, so the model
prices a step at the free share; a decode step meets its peers at each of its collectives, a ring step at each
hop. This probe measures both shares with the suite's own pieces, every rank at once (in their namespaces and
CPU cgroups, gloo, as a run), timed by ``experiments.harness.timing.time_interleaved`` (each sample the slowest
rank's), in rounds of three for each case, a piece's CPU ``cpu_us`` (the three see the same minute of the
machine, whose rate moves):

* ``free``: pieces of ``cpu_us`` microseconds of the rank's CPU (a single-threaded GEMM loop, its length
  calibrated on the rank), back to back, ``ROUND_CPU_S`` of CPU a sample;
* ``lockstep``: the same pieces, each followed by a 4-byte all-reduce over the world (the rank waits for every
  peer);
* ``sync``: the all-reduce alone, whose wall and CPU the lockstep's share leaves out.

Each row has each kind's wall seconds per piece (median over rounds of the slowest rank's) and the timing
thread's CPU per piece (median over ranks and rounds), and the factor: the median over rounds of the free
share over the lockstep share, by which a step's work met every ``cpu_us`` outlasts its free-running time
(``perfmodel/emulated/lockstep.py`` reads it).

    burst-bench cluster lockstep a800_ib_emu_2x4 --world-size 8 --out results/.../lockstep_probe.json
    torchrun ... -m experiments.cluster.emulator.lockstep_probe <repeats> <case,...>   # what each rank runs
"""
from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ...harness.row_file import merge_rows
from ...harness.timing import RepeatPolicy, time_interleaved
from .probe_rank import rank_main

ROUND_CPU_S = 0.25         # a sample's CPU: ten of the ranks' 100 ms CFS periods at 0.25 of a core, over which
                           # the quota's quantisation averages out (as the decode specs' min_sample_s)
SYNC_CALLS = 20            # all-reduces a sample of the all-reduce alone
UNIT = 128                 # the GEMM's side: one unit is some 0.1-0.3 ms of CPU, the piece's resolution
KINDS = ("free", "lockstep", "sync")


@dataclass(frozen=True)
class Case:
    cpu_us: int            # CPU a piece, microseconds

    @property
    def name(self) -> str:
        return str(self.cpu_us)


# pieces around a decode step's CPU between its meetings on the 2 x 4 mirrors (docs/findings.md)
CASES = tuple(Case(p) for p in (2000, 5000, 10000, 20000, 50000))


def parse_cases(text: str) -> list[Case]:
    """``cpu_us`` items (positive integers), comma-separated."""
    out = []
    for item in text.split(","):
        if not item.isdigit() or int(item) <= 0:
            raise ValueError(f"case={item!r} must be a piece's CPU in microseconds, a positive integer")
        out.append(Case(int(item)))
    return out


def check_shape(cases: list[Case], nodes: int, per_node: int) -> None:
    """ValueError unless the ranks have peers to meet (2 ranks)."""
    if nodes * per_node < 2:
        raise ValueError(f"a lockstep needs 2 ranks, not {nodes * per_node}")


def _unit(a: torch.Tensor) -> torch.Tensor:
    return torch.tanh(a @ a * 0.01)


def _calibrate(a: torch.Tensor) -> float:
    """This rank's thread CPU of one unit (median of 5 timings of 20 units)."""
    per = []
    for _ in range(5):
        c0 = time.thread_time()
        for _ in range(20):
            _unit(a)
        per.append((time.thread_time() - c0) / 20)
    return statistics.median(per)


def _step(kind: str, units: int, pieces: int, a: torch.Tensor, flag: torch.Tensor, cpu: list):
    def run():
        c0 = time.thread_time()
        for _ in range(pieces):
            for _ in range(units):
                _unit(a)
            if kind != "free":
                dist.all_reduce(flag)
        cpu.append((time.thread_time() - c0) / pieces)
    return run


def _probe_case(case: Case, repeats: int, per_node: int) -> dict:
    """Rounds of (free, lockstep, the all-reduce alone), interleaved so that each round's three see the same
    machine: ``{kind: {"wall": [s per piece a round: the slowest rank's], "cpu": [this rank's thread s per
    piece a round]}}``."""
    a, flag = torch.randn(UNIT, UNIT), torch.zeros(1)
    units = max(1, round(case.cpu_us * 1e-6 / _calibrate(a)))
    pieces = max(1, round(ROUND_CPU_S / (case.cpu_us * 1e-6)))
    shape = {"free": (units, pieces), "lockstep": (units, pieces), "sync": (0, SYNC_CALLS)}
    cpu: dict = {k: [] for k in KINDS}
    res = time_interleaved([(_step(k, *shape[k], a, flag, cpu[k]), None) for k in KINDS], warmup=1,
                           device=torch.device("cpu"), policy=RepeatPolicy(min_repeats=repeats, max_repeats=repeats))
    return {k: {"wall": [t / shape[k][1] for t in res.samples[i]], "cpu": cpu[k][-repeats:]}
            for i, k in enumerate(KINDS)}


def _lockstep_share(lock_wall, lock_cpu, sync_wall, sync_cpu) -> float:
    """The share of a core a piece ran at in lockstep: its wall and CPU less the all-reduce's."""
    return (lock_cpu - sync_cpu) / max(lock_wall - sync_wall, 1e-12)


def _round_factor(free_wall, free_cpu, lock_wall, lock_cpu, sync_wall, sync_cpu) -> float:
    """One round's free share over its lockstep share."""
    return (free_cpu / free_wall) / _lockstep_share(lock_wall, lock_cpu, sync_wall, sync_cpu)


def summarize(per_rank: list[dict], cases: list[Case]) -> list[dict]:
    """One row per case: each kind's median wall seconds per piece (the slowest rank's, the same on every rank)
    and median over ranks and rounds of the timing thread's CPU seconds per piece; the factor (the median over
    rounds of ``_round_factor``, each round's CPU the median over ranks); the world size."""
    rows = []
    for c in cases:
        wall = {k: per_rank[0][c.name][k]["wall"] for k in KINDS}
        cpu = {k: [statistics.median(x) for x in zip(*(r[c.name][k]["cpu"] for r in per_rank))] for k in KINDS}
        factors = [_round_factor(*args) for args in zip(wall["free"], cpu["free"], wall["lockstep"], cpu["lockstep"],
                                                         wall["sync"], cpu["sync"])]
        row = {"case": c.name, "cpu_us": c.cpu_us, "world_size": len(per_rank), "factor": statistics.median(factors),
               "factor_samples": factors}
        for k in KINDS:
            row |= {f"{k}_wall_s": statistics.median(wall[k]), f"{k}_cpu_s": statistics.median(cpu[k]),
                    f"{k}_wall_samples_s": wall[k]}
        rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    lines = [f"{'cpu ms':>7} {'G':>2} {'free ms':>8} {'share':>6} {'lockstep ms':>11} {'share':>6} {'sync ms':>7} "
             f"{'factor':>6}"]
    for r in rows:
        lock = _lockstep_share(r["lockstep_wall_s"], r["lockstep_cpu_s"], r["sync_wall_s"], r["sync_cpu_s"])
        lines.append(f"{r['cpu_us'] / 1e3:7.1f} {r['world_size']:>2} {r['free_wall_s'] * 1e3:8.2f} "
                     f"{r['free_cpu_s'] / r['free_wall_s']:6.3f} {r['lockstep_wall_s'] * 1e3:11.2f} {lock:6.3f} "
                     f"{r['sync_wall_s'] * 1e3:7.2f} {r['factor']:6.3f}")
    return "\n".join(lines)


def write(out, rows: list[dict], provenance: dict) -> None:
    """Add ``rows`` to ``out``, replacing those of the same case and world size (``row_file.merge_rows``), so that
    probes at several world sizes fill one file; each new row carries the probe's provenance."""
    merge_rows(out, [{**r, **provenance} for r in rows], lambda r: (r["case"], r["world_size"]), probe="lockstep")


def main(argv: list[str]) -> int:
    return rank_main(argv, marker="LOCKSTEP_PROBE", doc=__doc__, parse_cases=parse_cases, check_shape=check_shape,
                     probe_case=_probe_case)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
