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

* ``free``: pieces of ``cpu_us`` microseconds of the rank's CPU, back to back, ``ROUND_CPU_S`` of CPU a sample.
  A ``compute`` piece is a single-threaded GEMM loop held in the core's caches; a ``memory`` piece streams
  arrays far larger than the machine's last-level cache (``harness.reference.stream_step``'s traffic, in
  slices), as a decode step's attention streams its cache; each piece's length is calibrated on the rank;
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

import itertools
import statistics
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ...harness.reference import STREAM_ELEMENTS
from ...harness.row_file import merge_rows
from ...harness.timing import RepeatPolicy, time_interleaved
from .probe_rank import rank_main

ROUND_CPU_S = 0.25         # a sample's CPU: ten of the ranks' 100 ms CFS periods at 0.25 of a core, over which
                           # the quota's quantisation averages out (as the decode specs' min_sample_s)
SYNC_CALLS = 20            # all-reduces a sample of the all-reduce alone
UNIT = 128                 # the GEMM's side: one unit is some 0.1-0.3 ms of CPU, the piece's resolution
STREAM_SLICE = 1 << 20     # a memory unit's slice of the stream's arrays: 4 MiB fp32 an operand
KINDS = ("free", "lockstep", "sync")
MEMORY_PREFIX = "mem"      # a memory piece's case name: mem<cpu_us>


@dataclass(frozen=True)
class Case:
    cpu_us: int            # CPU a piece, microseconds
    piece: str = "compute"  # what the piece's CPU does: "compute" (in cache) or "memory" (streaming)

    @property
    def name(self) -> str:
        return str(self.cpu_us) if self.piece == "compute" else f"{MEMORY_PREFIX}{self.cpu_us}"


# pieces around a decode step's CPU between its meetings on the 2 x 4 mirrors (docs/findings.md); memory pieces
# (``mem<cpu_us>``) on request: measured, they lose what compute pieces lose ("The lockstep probe": memory pieces)
CASES = tuple(Case(p) for p in (2000, 5000, 10000, 20000, 50000))


def parse_cases(text: str) -> list[Case]:
    """Comma-separated items: ``cpu_us`` (a positive integer: a compute piece) or ``mem<cpu_us>`` (a memory
    piece)."""
    out = []
    for item in text.split(","):
        piece, digits = ("memory", item[len(MEMORY_PREFIX):]) if item.startswith(MEMORY_PREFIX) else ("compute", item)
        if not digits.isdigit() or int(digits) <= 0:
            raise ValueError(f"case={item!r} must be a piece's CPU in microseconds, a positive integer, or "
                             f"{MEMORY_PREFIX}<microseconds> for a memory piece")
        out.append(Case(int(digits), piece))
    return out


def check_shape(cases: list[Case], nodes: int, per_node: int) -> None:
    """ValueError unless the ranks have peers to meet (2 ranks)."""
    if nodes * per_node < 2:
        raise ValueError(f"a lockstep needs 2 ranks, not {nodes * per_node}")


def _unit_of(piece: str):
    """A piece's unit of work, a zero-argument callable: a 128 x 128 GEMM (some 0.1-0.3 ms of CPU), or ``x.add_(y)``
    over the next 4 MiB slice of the stream's two 32 MiB arrays (some 1-2 ms: 64 MiB a rank, eight ranks twice
    this machine's 32 MiB L3 over, so every slice comes from memory)."""
    g = torch.Generator().manual_seed(0)
    if piece == "compute":
        a = torch.randn(UNIT, UNIT, generator=g)
        return lambda: torch.tanh(a @ a * 0.01)
    return _stream_unit(torch.randn(STREAM_ELEMENTS, generator=g), torch.randn(STREAM_ELEMENTS, generator=g),
                        STREAM_SLICE)


def _stream_unit(x: torch.Tensor, y: torch.Tensor, size: int):
    """``x.add_(y)`` over the next ``size`` elements of both each call, wrapping round."""
    slices = itertools.cycle([(x[i:i + size], y[i:i + size]) for i in range(0, x.numel(), size)])

    def stream():
        xs, ys = next(slices)
        xs.add_(ys)
    return stream


def _calibrate(unit) -> float:
    """This rank's thread CPU of one unit (median of 5 timings of 16 units)."""
    per = []
    for _ in range(5):
        c0 = time.thread_time()
        for _ in range(16):
            unit()
        per.append((time.thread_time() - c0) / 16)
    return statistics.median(per)


def _step(kind: str, units: int, pieces: int, unit, flag: torch.Tensor, cpu: list):
    def run():
        c0 = time.thread_time()
        for _ in range(pieces):
            for _ in range(units):
                unit()
            if kind != "free":
                dist.all_reduce(flag)
        cpu.append((time.thread_time() - c0) / pieces)
    return run


def _probe_case(case: Case, repeats: int, per_node: int) -> dict:
    """Rounds of (free, lockstep, the all-reduce alone), interleaved so that each round's three see the same
    machine: ``{kind: {"wall": [s per piece a round: the slowest rank's], "cpu": [this rank's thread s per
    piece a round]}}``."""
    unit, flag = _unit_of(case.piece), torch.zeros(1)
    units = max(1, round(case.cpu_us * 1e-6 / _calibrate(unit)))
    pieces = max(1, round(ROUND_CPU_S / (case.cpu_us * 1e-6)))
    shape = {"free": (units, pieces), "lockstep": (units, pieces), "sync": (0, SYNC_CALLS)}
    cpu: dict = {k: [] for k in KINDS}
    res = time_interleaved([(_step(k, *shape[k], unit, flag, cpu[k]), None) for k in KINDS], warmup=1,
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
        row = {"case": c.name, "cpu_us": c.cpu_us, "piece": c.piece, "world_size": len(per_rank),
               "factor": statistics.median(factors), "factor_samples": factors}
        for k in KINDS:
            row |= {f"{k}_wall_s": statistics.median(wall[k]), f"{k}_cpu_s": statistics.median(cpu[k]),
                    f"{k}_wall_samples_s": wall[k]}
        rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    lines = [f"{'piece':>7} {'cpu ms':>7} {'G':>2} {'free ms':>8} {'share':>6} {'lockstep ms':>11} {'share':>6} "
             f"{'sync ms':>7} {'factor':>6}"]
    for r in rows:
        lock = _lockstep_share(r["lockstep_wall_s"], r["lockstep_cpu_s"], r["sync_wall_s"], r["sync_cpu_s"])
        lines.append(f"{r.get('piece', 'compute'):>7} {r['cpu_us'] / 1e3:7.1f} {r['world_size']:>2} "
                     f"{r['free_wall_s'] * 1e3:8.2f} {r['free_cpu_s'] / r['free_wall_s']:6.3f} "
                     f"{r['lockstep_wall_s'] * 1e3:11.2f} {lock:6.3f} {r['sync_wall_s'] * 1e3:7.2f} {r['factor']:6.3f}")
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
