"""Benchmark (not a test): the process CPU seconds one call costs each rank, per method, over loopback.

On G gloo ranks over loopback (``node_size`` ranks per emulated node for the node-aware methods),
for each method and sequence length: one warm-up call, then ``--calls`` calls (12), each rank's
``time.process_time`` (all its threads: gloo's too) around its forward + backward; the median per rank
and the wall time of the slowest (``experiments/harness/call_cpu.py``, the calls and their shapes). At a few
tokens per rank the CPU is what a call costs beside its kernels (Python, the dispatcher, gloo's per-message
work): the emulated cluster runs that on a rank's capped share too, and the hardware model has no term for
it (docs/findings.md#nic-conventions-2-x-2-and-2-x-4). The emulated cluster's own probe measures the same
calls with every rank in its namespace and CPU cgroup (``burst-bench cluster calls``), which a run on it pays
and loopback does not (docs/findings.md#the-host-term-on-the-emulated-cluster-2026-12-06).

    python -m benchmarks.cpu_per_call                         # G = 8, node_size 4, N = 64 and 2048
    python -m benchmarks.cpu_per_call --world-size 4 --node-size 2 --seqlen 64,1024 --methods burst,usp
    python -m benchmarks.cpu_per_call --seqlen 64 --out results/reference/<root>/call_cpu.json

A method ``decode:<row>`` (``cp_all_gather``, ``cp_heads``, ``tp``: ``baselines.decode_layer.ROWS``) times
one decode step on a cache of N tokens of context per sequence, at each ``--batch``:

    python -m benchmarks.cpu_per_call --world-size 8 --node-size 4 --seqlen 64 --batch 1,4 \
        --methods decode:cp_all_gather,decode:cp_heads,decode:tp --out results/reference/<root>/call_cpu.json

``--out`` adds the records to that file (replacing those of the same method, N, world and node size and
batch): the emulated cluster's validation reads it there as the host's work per op
(experiments/perfmodel/emulated/host_cost.py).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from experiments.harness.call_cpu import CALLS, DECODE_PREFIX, measure, merge, row

METHODS = "burst,burst_double_ring,loongtrain_double_ring,usp"


def _records(name: str, n: int, args) -> list[dict]:
    """The rows of one method at one N (every rank's samples gathered): a training call on each ``--layouts``,
    or a decode step at each ``--batch``."""
    if name.startswith(DECODE_PREFIX):
        calls = [dict(batch=b) for b in _batches(args.batch)]
    else:
        calls = [dict(layout=x) for x in args.layouts.split(",")]
    out = []
    for kw in calls:
        meta, mine = measure(name, n, node_size=args.node_size, calls=args.calls, **kw)
        every: list = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        out.append(row(meta, every))
    return out


def _worker(rank: int, port: int, args) -> None:
    from experiments.harness.env import git_info, hardware, versions   # the record's provenance

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=args.world_size, timeout=datetime.timedelta(seconds=300))
    recs = []
    for name in args.methods.split(","):
        for n in (int(x) for x in args.seqlen.split(",")):
            for rec in _records(name, n, args):
                if rank == 0:
                    recs.append({**rec, "where": "loopback"})
                    print(json.dumps(recs[-1]), flush=True)
    dist.destroy_process_group()
    if rank == 0 and args.out:      # the provenance field the emulated probe's rows carry too
        merge(args.out, recs, provenance=dict(git=git_info(), versions=versions(), hardware=hardware(args.world_size)))


def _batches(text: str) -> list[int]:
    """``--batch`` as ints; [] unless every one is a positive integer."""
    try:
        out = [int(b) for b in text.split(",")]
    except ValueError:
        return []
    return out if all(b >= 1 for b in out) else []


def _args(argv) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.cpu_per_call", description=__doc__.splitlines()[0])
    ap.add_argument("--world-size", type=int, default=8)
    ap.add_argument("--node-size", type=int, default=4)
    ap.add_argument("--seqlen", default="64,2048", help="comma-separated; each a multiple of 2 x world size")
    ap.add_argument("--methods", default=METHODS, help="registry names, or decode:<row> (module docstring)")
    ap.add_argument("--layouts", default="zigzag",
                    help="comma-separated layouts of the training calls (zigzag; balanced: more kernel calls a step "
                         "at the same ops, host_cost.per_call_host)")
    ap.add_argument("--batch", default="1", help="comma-separated sequences per decode step (decode rows only)")
    ap.add_argument("--calls", type=int, default=CALLS, help="timed calls per method and N, after one warm-up")
    ap.add_argument("--out", help="JSON file to add the records to (the emulated validation's call_cpu.json)")
    args = ap.parse_args(argv)
    from baselines import METHODS as registry
    from baselines.decode_layer import ROWS
    bad = [m for m in args.methods.split(",")
           if m not in registry and not (m.startswith(DECODE_PREFIX) and m[len(DECODE_PREFIX):] in ROWS)]
    if bad:
        ap.error(f"--methods: {bad} not in the registry nor decode:<row> with a row of {ROWS}")
    if not _batches(args.batch):
        ap.error(f"--batch={args.batch!r} must be comma-separated positive integers")
    from burst_impl.layout import LAYOUTS, is_balanced_name
    bad = [x for x in args.layouts.split(",") if x not in LAYOUTS and not is_balanced_name(x)]
    if bad:
        ap.error(f"--layouts: {bad} not among {LAYOUTS} nor balanced[:K]")
    if args.calls < 1:
        ap.error(f"--calls={args.calls} must be >= 1")
    if args.world_size < 1 or args.node_size < 1 or args.world_size % args.node_size:
        ap.error(f"--world-size={args.world_size} must be a positive multiple of --node-size={args.node_size}")
    try:
        ns = [int(x) for x in args.seqlen.split(",")]
    except ValueError:
        ap.error(f"--seqlen={args.seqlen!r} must be comma-separated integers")
    if any(n <= 0 or n % (2 * args.world_size) for n in ns):
        ap.error(f"--seqlen={args.seqlen!r}: each must be a positive multiple of 2 x world size "
                 f"({2 * args.world_size}; zigzag)")
    return args


def main(argv=None) -> None:
    args = _args(sys.argv[1:] if argv is None else argv)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(_worker, args=(port, args), nprocs=args.world_size)


if __name__ == "__main__":
    main()
