"""What a transfer costs a rank that computes meanwhile, on the emulated cluster (a diagnostic).

The performance model counts a transfer that runs under a rank's compute as hidden: a ring step
takes max(compute, transfer). This probe measures that on the emulated cluster, with the suite's
own pieces: every rank at once (the ranks in their namespaces and CPU cgroups, gloo, as a run),
timed by ``experiments.harness.timing.time_interleaved`` (rounds compute, transfer, both; each
sample the slowest rank's, over ``ITERS`` steps back to back as a ring runs them),

* ``compute``: fwd+bwd of one ``tokens x tokens`` block (``harness.reference.block_step``, the calibration's
  work, 8 heads x 32);
* ``transfer``: one hop of ``nbytes``, posted as ``burst_impl.comm.Channel`` posts it (the
  receive, then the send, one ``batch_isend_irecv``), waited for;
* ``both``: the hop posted, the block computed, the hop waited for (a ring step with overlap);

for each case of ``CASES``: ``ring`` (inside the node: send to the next rank, receive from the
previous), ``pair`` (across nodes: send to the same local rank of the next node, receive from the
previous node's; the double ring's outer ring: over 2 nodes a two-way exchange, over more a ring of
the nodes), ``oneway`` (across nodes: nodes paired 0 -> 1, 2 -> 3, ...; the first of a pair sends,
the second receives; at an odd node count the last node has no partner and only computes).
``excess = both - max(compute, transfer)`` per round is what overlap did not hide; the wall seconds
(medians over rounds) and each busy rank's process CPU seconds (all threads: gloo's too; medians over
ranks and rounds) of each are reported, and ``cpu_excess``: the CPU the hop adds to a
rank's step, in wall seconds at the rank's CPU rate, the part the performance model charges.

    burst-bench cluster overlap a800_ib_emu_2x4 --out results/.../overlap_probe.json
    torchrun ... -m experiments.cluster.emulator.overlap_probe <repeats> <case,...>   # what each rank runs

Measurements: docs/findings.md#overlap-on-the-emulated-cluster.
"""
from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ...harness.timing import RepeatPolicy, time_interleaved
from ...harness.reference import block_step
from .probe_rank import rank_main

HEADS, HEAD_DIM = 8, 32
KINDS = ("compute", "transfer", "both")
ITERS = 4                 # steps per sample, back to back (ranks drift apart as in a ring's pass)


@dataclass(frozen=True)
class Case:
    pattern: str          # ring | pair | oneway
    tokens: int           # compute: fwd+bwd of one tokens x tokens block
    nbytes: int           # of the hop (float32 elements x 4)

    @property
    def name(self) -> str:
        return f"{self.pattern}:{self.tokens}:{self.nbytes}"


# the block sizes of cpu_double_ring_emulated_2x4 (2K and 8K tokens over 8 ranks: K and V of 256 and
# 1024 tokens x 8 x 32 float32 = 512 KiB and 2 MiB per hop), with the compute of a block of that size; the
# one-way case (a flat ring's edge hop, the model's ``inter_oneway`` line) at both sizes, so that its line has
# an intercept of its own (probes before 2026-12-04 have the 2 MiB case alone: a line through the origin); and
# each pattern's 512 KiB hop beside a 16-token block, next to nothing: a hop's excess grows with the compute it
# runs beside, from about its own CPU beside none (the model's plane, ``perfmodel/emulated/excess.fit_excess``;
# probes before 2026-12-07 lack these cases and are fitted a line)
CASES = (Case("ring", 256, 1 << 19), Case("ring", 1024, 1 << 21), Case("pair", 1024, 1 << 19),
         Case("pair", 1024, 1 << 21), Case("oneway", 1024, 1 << 19), Case("oneway", 1024, 1 << 21),
         Case("ring", 16, 1 << 19), Case("pair", 16, 1 << 19), Case("oneway", 16, 1 << 19))
PATTERNS = ("ring", "pair", "oneway")


def parse_cases(text: str) -> list[Case]:
    """``pattern:tokens:nbytes`` items, comma-separated."""
    out = []
    for item in text.split(","):
        parts = item.split(":")
        if len(parts) != 3 or parts[0] not in PATTERNS or not all(p.isdigit() and int(p) > 0 for p in parts[1:]):
            raise ValueError(f"case={item!r} must be <pattern>:<tokens>:<bytes> with pattern in {PATTERNS} "
                             "and positive integers")
        if int(parts[2]) % 4:
            raise ValueError(f"case={item!r}: bytes must be a multiple of 4 (float32 elements)")
        out.append(Case(parts[0], int(parts[1]), int(parts[2])))
    return out


def check_shape(cases: list[Case], nodes: int, per_node: int) -> None:
    """ValueError unless every case's pattern has its peers on a cluster of ``nodes`` x ``per_node``:
    ``ring`` needs 2 ranks in a node, ``pair`` and ``oneway`` 2 nodes (else a rank would send to itself)."""
    for c in cases:
        if c.pattern == "ring" and per_node < 2:
            raise ValueError(f"case={c.name!r}: a ring inside a node needs ranks_per_node >= 2, not {per_node}")
        if c.pattern in ("pair", "oneway") and nodes < 2:
            raise ValueError(f"case={c.name!r}: a {c.pattern} across nodes needs nodes >= 2, not {nodes}")


def peers(pattern: str, rank: int, world: int, per_node: int) -> tuple[int | None, int | None]:
    """(send to, receive from) global ranks of ``rank`` for ``pattern`` (None: no such direction). For any
    node count every send has its receive and every receive its send (``tests/test_overlap_probe.py``)."""
    node, local = divmod(rank, per_node)
    if pattern == "ring":
        return node * per_node + (local + 1) % per_node, node * per_node + (local - 1) % per_node
    nodes = world // per_node
    nxt, prv = (rank + per_node) % world, (rank - per_node) % world
    if pattern == "pair":
        return nxt, prv
    if pattern == "oneway":
        # nodes in pairs, not halves: with halves a sender's neighbour is another sender whenever the
        # first half has more than one node, and at an odd count the last receiver's sender never sends
        if node % 2 == 0:
            return (nxt, None) if node + 1 < nodes else (None, None)
        return None, prv
    raise ValueError(f"pattern={pattern!r} must be one of {PATTERNS}")


def _probe_case(case: Case, repeats: int, per_node: int) -> dict:
    """``{"wall": {kind: [s per step, one per round: the slowest rank's]}, "cpu": {kind: [this rank's]}}``."""
    dst, src = peers(case.pattern, dist.get_rank(), dist.get_world_size(), per_node)
    compute = block_step(case.tokens, HEADS, HEAD_DIM)
    send, recv = torch.randn(case.nbytes // 4), torch.empty(case.nbytes // 4)
    cpu: dict[str, list] = {k: [] for k in KINDS}

    def post():
        ops = ([dist.P2POp(dist.irecv, recv, src)] if src is not None else []) + (
            [dist.P2POp(dist.isend, send, dst)] if dst is not None else [])
        return dist.batch_isend_irecv(ops) if ops else []      # a node without a partner (oneway) only computes

    def step(kind: str):
        def run():
            c0 = time.process_time()
            for _ in range(ITERS):
                reqs = post() if kind != "compute" else []
                if kind != "transfer":
                    compute()
                for r in reqs:
                    r.wait()
            cpu[kind].append((time.process_time() - c0) / ITERS)
        return run, None

    # the warm-up (connections, allocations) is timed by nobody: drop its CPU samples
    res = time_interleaved([step(k) for k in KINDS], warmup=1, device=torch.device("cpu"),
                           policy=RepeatPolicy(min_repeats=repeats, max_repeats=repeats))
    return {"wall": {k: [t / ITERS for t in s] for k, s in zip(KINDS, res.samples)},
            "cpu": {k: v[-repeats:] for k, v in cpu.items()}, "idle": dst is None and src is None}


def cpu_excess(cpu: dict, compute_wall_s: float) -> float:
    """The CPU seconds the hop adds to a rank's step (``both`` - ``compute``, medians over ranks and
    rounds), in wall seconds at the rate a rank gets CPU here (compute's wall / CPU seconds: ~4 for a
    rank capped at a quarter core): what the performance model charges beside each transfer
    (``EmulatedCosts.sender_seconds``, experiments/perfmodel/emulated/costs.py). Unlike the wall excess it
    leaves out what the schedule already carries or the model does not (waits on a peer, the scheduler's
    wake-ups at 4 ranks per core)."""
    if cpu["compute"] <= 0:
        return 0.0
    return max(0.0, cpu["both"] - cpu["compute"]) * compute_wall_s / cpu["compute"]


def summarize(per_rank: list[dict], cases: list[Case]) -> list[dict]:
    """One row per case: medians of the wall times (every rank has the same: the slowest rank's) and of
    the ranks' CPU times, and the excess of ``both`` over max(compute, transfer), round by round."""
    rows = []
    for c in cases:
        wall = per_rank[0][c.name]["wall"]
        excess = [b - max(cp, t) for cp, t, b in zip(wall["compute"], wall["transfer"], wall["both"])]
        # a rank without a peer moved no bytes: its CPU would dilute what a hop costs the ranks that did
        busy = [r[c.name] for r in per_rank if not r[c.name].get("idle")]
        cpu = {k: statistics.median(x for r in busy for x in r["cpu"][k]) for k in KINDS}
        walls = {k: statistics.median(wall[k]) for k in KINDS}
        rows.append({"case": c.name, "pattern": c.pattern, "tokens": c.tokens, "bytes": c.nbytes,
                     **{f"{k}_wall_s": walls[k] for k in KINDS},
                     **{f"{k}_cpu_s": cpu[k] for k in KINDS},
                     "excess_s": statistics.median(excess), "excess_samples_s": excess,
                     "cpu_excess_s": cpu_excess(cpu, walls["compute"]),
                     "transfer_bytes_per_s": c.nbytes / statistics.median(wall["transfer"])})
    return rows


def table(rows: list[dict]) -> str:
    lines = [f"{'case':<22} {'compute ms':>10} {'transfer ms':>11} {'both ms':>8} {'excess ms':>9} "
             f"{'xfer MB/s':>9} {'cpu: comp':>9} {'xfer':>6} {'both':>6} ms {'cpu excess ms':>13}"]
    for r in rows:
        lines.append(f"{r['case']:<22} {r['compute_wall_s'] * 1e3:10.1f} {r['transfer_wall_s'] * 1e3:11.1f} "
                     f"{r['both_wall_s'] * 1e3:8.1f} {r['excess_s'] * 1e3:+9.1f} "
                     f"{r['transfer_bytes_per_s'] / 1e6:9.1f} {r['compute_cpu_s'] * 1e3:9.1f} "
                     f"{r['transfer_cpu_s'] * 1e3:6.1f} {r['both_cpu_s'] * 1e3:6.1f}    "
                     f"{r['cpu_excess_s'] * 1e3:13.1f}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    return rank_main(argv, marker="OVERLAP_PROBE", doc=__doc__, parse_cases=parse_cases, check_shape=check_shape,
                     probe_case=_probe_case)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
