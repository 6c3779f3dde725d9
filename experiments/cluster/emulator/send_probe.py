"""How long a ring's send holds the rank that posted it, on the emulated cluster (gloo over TCP).

A ring step posts its hop (``burst_impl.comm.Channel``: one ``batch_isend_irecv``) and, after its compute, waits
for every request, its own send's too. Gloo sends on rendezvous: the bytes leave once the receiver has posted its
receive. Its send then completes when the last byte is written into the connection's socket, not when it lands:
the kernel's buffers hold up to some bytes on the way, so a sender whose message fits goes on while the link still
carries it, and one whose message does not is held until the rest fits. On a GPU NCCL's send ends with its
transfer, so the hardware model holds the sender until the hop lands; this probe measures what a CPU rank's
send holds it for instead (``perfmodel/emulated/send_buffer.py`` fits the bytes the buffers take).

Every rank in its namespace and CPU cgroup, on gloo, as a run. For each case ``pattern:bytes``:

* ``oneway``: across nodes, each rank of an even node sends to the same local rank of the next node
  (``overlap_probe.peers``), which receives;
* ``intra``: inside a node, each even local rank sends to the next local rank, which receives.

A round: a barrier, then the sender posts its send and waits for it, the receiver posts its receive and waits
for it, each timing its own wait from its post. Each rank keeps its seconds per round (the barrier between rounds
leaves the link idle before each message, as a ring's hop after a step's compute).

    burst-bench cluster sends a800_ib_emu_2x4 --out results/.../send_probe.json
    torchrun ... -m experiments.cluster.emulator.send_probe <repeats> <case,...>   # what each rank runs
"""
from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .overlap_probe import peers
from .probe_rank import pattern_bytes, rank_main

PATTERNS = ("oneway", "intra")
# a ring's hop on the 2 x 4 mirrors is 64 KiB-2 MiB (K/V blocks of 256-4096 tokens); the larger sizes find where
# the buffers fill
SIZES = (131072, 524288, 2097152, 4194304, 8388608)
CASES_TEXT = ",".join(f"{p}:{n}" for p in PATTERNS for n in SIZES)


@dataclass(frozen=True)
class Case:
    pattern: str
    nbytes: int

    @property
    def name(self) -> str:
        return f"{self.pattern}:{self.nbytes}"


CASES = tuple(Case(p, n) for p in PATTERNS for n in SIZES)


def parse_cases(text: str) -> list[Case]:
    """``pattern:bytes`` items, comma-separated (``probe_rank.pattern_bytes``)."""
    return [Case(p, n) for p, n in pattern_bytes(text, PATTERNS)]


def check_shape(cases: list[Case], nodes: int, per_node: int) -> None:
    """ValueError unless every case has its peers: ``oneway`` 2 nodes, ``intra`` 2 ranks in a node."""
    for c in cases:
        if c.pattern == "oneway" and nodes < 2:
            raise ValueError(f"case={c.name!r}: a send across nodes needs nodes >= 2, not {nodes}")
        if c.pattern == "intra" and per_node < 2:
            raise ValueError(f"case={c.name!r}: a send inside a node needs ranks_per_node >= 2, not {per_node}")


def roles(pattern: str, rank: int, world: int, per_node: int) -> tuple[int | None, int | None]:
    """(send to, receive from) of ``rank``; None where it has no such role."""
    if pattern == "oneway":
        return peers("oneway", rank, world, per_node)
    local = rank % per_node
    if local % 2 == 0:
        return (rank + 1, None) if local + 1 < per_node else (None, None)
    return None, rank - 1


def _probe_case(case: Case, repeats: int, per_node: int) -> dict:
    """``{"role": "send" | "recv" | None, "s": [this rank's seconds from its post to its wait's return]}``."""
    dst, src = roles(case.pattern, dist.get_rank(), dist.get_world_size(), per_node)
    buf = torch.ones(case.nbytes // 4)
    op = (dist.P2POp(dist.isend, buf, dst) if dst is not None else
          dist.P2POp(dist.irecv, buf, src) if src is not None else None)
    seconds = []
    for i in range(repeats + 1):                 # the first round warms the connection up, not kept
        dist.barrier()
        if op is None:
            continue
        t0 = time.perf_counter()
        for r in dist.batch_isend_irecv([op]):
            r.wait()
        if i:
            seconds.append(time.perf_counter() - t0)
    return {"role": "send" if dst is not None else "recv" if src is not None else None, "s": seconds}


def summarize(per_rank: list[dict], cases: list[Case]) -> list[dict]:
    """One row per case: the median over senders and rounds of a send's wait, and over receivers of a receive's."""
    rows = []
    for c in cases:
        by = {role: [x for r in per_rank if r[c.name]["role"] == role for x in r[c.name]["s"]]
              for role in ("send", "recv")}
        rows.append({"case": c.name, "pattern": c.pattern, "bytes": c.nbytes,
                     "send_s": statistics.median(by["send"]), "recv_s": statistics.median(by["recv"]),
                     "send_samples_s": by["send"], "recv_samples_s": by["recv"]})
    return rows


def table(rows: list[dict]) -> str:
    lines = [f"{'case':<16} {'send ms':>9} {'recv ms':>9} {'send/recv':>9}"]
    lines += [f"{r['case']:<16} {r['send_s'] * 1e3:9.2f} {r['recv_s'] * 1e3:9.2f} {r['send_s'] / r['recv_s']:9.2f}"
              for r in rows]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    return rank_main(argv, marker="SEND_PROBE", doc=__doc__, parse_cases=parse_cases, check_shape=check_shape,
                     probe_case=_probe_case)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
