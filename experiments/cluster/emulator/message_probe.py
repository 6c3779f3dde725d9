"""What a small message costs on the emulated cluster when the rank waits for it (a blocking step).

A decode step's merge (``burst_impl.inference.decode``), an all-to-all, a no-overlap ring step: the rank
posts a message of a few hundred bytes to tens of KiB and waits for it with nothing to compute. On a
GPU that costs NCCL's latency and bytes / rate; on a CPU rank under its quota it also costs the
rank's own send and receive path (Python, gloo, the kernel's TCP stack) and its wake-up when the
message lands, at the rank's capped share of a core. This probe measures it with the suite's own
pieces, every rank at once (in their namespaces and CPU cgroups, gloo, as a run), timed by
``experiments.harness.timing.time_interleaved`` (each sample the slowest rank's, over ``ITERS`` calls
back to back as a decode step makes them), for each case ``pattern:bytes`` of ``CASES``:

* ``ring``: one hop inside the node, every rank at once (send to the next local rank, receive from
  the previous), posted as ``burst_impl.comm.Channel`` posts it (receive, send, one
  ``batch_isend_irecv``) and waited for; ``bytes`` per hop;
* ``pair``: one hop across nodes (the same local rank of the next node; ``overlap_probe.peers``);
* ``all_gather``: ``burst_impl.collectives.all_gather_`` over the whole world (gloo's ring
  all-gather, decode's all-gather merge), ``bytes`` per rank;
* ``all_reduce``: ``all_reduce_`` of ``bytes`` (the row-parallel projection's);
* ``all_to_all``: ``all_to_all_`` with ``bytes`` per piece (decode's heads merge; on gloo every
  receive posted before any send).

Each row has the wall seconds per call (median over rounds) and each rank's process CPU per call (all
threads, gloo's too; median over ranks and rounds). ``experiments/perfmodel/emulated/message.py``
fits the hops' per-message latency per link class (wall - bytes / the shaped rate) and checks the
collectives against the schedules' composition of those hops.

    burst-bench cluster messages a800_ib_emu_2x4 --out results/.../message_probe.json
    torchrun ... -m experiments.cluster.emulator.message_probe <repeats> <case,...>   # what each rank runs
"""
from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from burst_impl.collectives import all_gather_, all_reduce_, all_to_all_

from ...harness.timing import RepeatPolicy, time_interleaved
from .overlap_probe import Case as HopCase, check_shape as check_hops, peers
from .probe_rank import pattern_bytes, rank_main

ITERS = 8                  # calls per sample, back to back (a decode step makes 2-3 of them in a row)
HOPS = ("ring", "pair")    # point-to-point, one link class each (overlap_probe.peers)
COLLECTIVES = ("all_gather", "all_reduce", "all_to_all")
PATTERNS = HOPS + COLLECTIVES


@dataclass(frozen=True)
class Case:
    pattern: str
    nbytes: int            # float32 elements x 4: per hop, per rank (all-gather), buffer (all-reduce), piece

    @property
    def name(self) -> str:
        return f"{self.pattern}:{self.nbytes}"


# decode's messages on the 2 x 4 mirrors (8 x 2 heads of 64, float32, B 1..4): lse 32 B..128 B, O 2-8 KiB per
# rank, the heads merge's pieces 256 B..1 KiB; up to the all-to-alls' tens of KiB (ulysses at small N)
SIZES = (256, 2048, 16384, 65536)
CASES = tuple(Case(p, n) for p in PATTERNS for n in SIZES)


def parse_cases(text: str) -> list[Case]:
    """``pattern:bytes`` items, comma-separated (``probe_rank.pattern_bytes``)."""
    return [Case(p, n) for p, n in pattern_bytes(text, PATTERNS)]


def check_shape(cases: list[Case], nodes: int, per_node: int) -> None:
    """ValueError unless every hop has its peers (``overlap_probe.check_shape``) and a collective 2 ranks."""
    check_hops([HopCase(c.pattern, 1, c.nbytes) for c in cases if c.pattern in HOPS], nodes, per_node)
    if nodes * per_node < 2 and any(c.pattern in COLLECTIVES for c in cases):
        raise ValueError(f"a collective needs 2 ranks, not {nodes * per_node}")


def _call(case: Case, per_node: int):
    """The blocking call of ``case`` on this rank."""
    rank, world = dist.get_rank(), dist.get_world_size()
    n = case.nbytes // 4
    if case.pattern in HOPS:
        dst, src = peers(case.pattern, rank, world, per_node)
        send, recv = torch.randn(n), torch.empty(n)

        def hop():
            for r in dist.batch_isend_irecv([dist.P2POp(dist.irecv, recv, src), dist.P2POp(dist.isend, send, dst)]):
                r.wait()
        return hop
    if case.pattern == "all_gather":
        x = torch.randn(n)
        return lambda: all_gather_(x, 0, None, "forward", "probe")
    if case.pattern == "all_reduce":
        x = torch.randn(n)
        return lambda: all_reduce_(x, None, "forward", "probe")
    x = torch.randn(world, n)         # piece j (n elements) for rank j
    return lambda: all_to_all_(x, 0, 0, None, "forward", "probe")


def _probe_case(case: Case, repeats: int, per_node: int) -> dict:
    """``{"wall": [s per call, one per round: the slowest rank's], "cpu": [this rank's s per call]}``."""
    call = _call(case, per_node)
    cpu: list[float] = []

    def run():
        c0 = time.process_time()
        for _ in range(ITERS):
            call()
        cpu.append((time.process_time() - c0) / ITERS)

    res = time_interleaved([(run, None)], warmup=1, device=torch.device("cpu"),
                           policy=RepeatPolicy(min_repeats=repeats, max_repeats=repeats))
    return {"wall": [t / ITERS for t in res.samples[0]], "cpu": cpu[-repeats:]}   # the warm-up's CPU dropped


def summarize(per_rank: list[dict], cases: list[Case]) -> list[dict]:
    """One row per case: the median wall seconds per call (the slowest rank's, the same on every rank) and
    the median over ranks and rounds of the CPU seconds per call."""
    rows = []
    for c in cases:
        wall = per_rank[0][c.name]["wall"]
        rows.append({"case": c.name, "pattern": c.pattern, "bytes": c.nbytes, "wall_s": statistics.median(wall),
                     "wall_samples_s": wall,
                     "cpu_s": statistics.median(x for r in per_rank for x in r[c.name]["cpu"])})
    return rows


def table(rows: list[dict]) -> str:
    lines = [f"{'case':<18} {'wall ms/call':>12} {'cpu ms/call':>11}"]
    lines += [f"{r['case']:<18} {r['wall_s'] * 1e3:12.3f} {r['cpu_s'] * 1e3:11.3f}" for r in rows]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    return rank_main(argv, marker="MESSAGE_PROBE", doc=__doc__, parse_cases=parse_cases, check_shape=check_shape,
                     probe_case=_probe_case)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
