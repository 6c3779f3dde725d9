"""BurstEngine's ablation (PAPER.md §3): the spec at the paper's size and its CPU mirror.

    python -m experiments.benches.ablation --paper                      # memory model at 14B, 1M tokens, 32 GPUs
    python -m experiments.benches.ablation --out /tmp/ablation.jsonl    # CPU mirror on the emulated cluster

The paper's ablation starts from a ring-attention training step and adds one
feature at a time (``STEPS``, cumulative): BurstEngine's optimised backward
communication (the query side circulates with delta instead of the key/value
side: method ``burst`` instead of ``ring``), the topology-aware double ring
(``burst_double_ring``), the fused LM head + cross-entropy (``loss: fused``),
sequence-level selective checkpointing (``checkpoint: seq``). Every step
before the last runs full-block checkpointing, as their runs do.

``--paper`` prints each step's per-rank memory (``memory.step_memory``:
14B = ``burstengine_14b``, N = 1M, 32 ranks, FSDP2, bf16) and whether it
fits an 80 GB A800.

The CPU mirror runs each step's ``train_step`` (AdamW) on a small model
(``MIRROR``) over the ranks of a cluster profile (default the emulated
2 nodes x 2 ranks of ``a100_roce_emu``; loopback when namespaces are not
permitted, which the records say): step times (``experiments/harness/timing.py``,
max over ranks, median with p10/p90 and a bootstrap interval of the ratio to
the first step) and the measured peak memory of one step (rank 0,
``experiments/harness/memory.py``), one JSON line per step with the resolved
config. This is a standalone benchmark, not a harness spec (the harness's
model level is another branch's work).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist

from baselines.registry import get
from burst_impl.model.config import get_config
from burst_impl.model.memory import step_memory
from burst_impl.model.data import batch_at, load_corpus
from burst_impl.model.model import build_model
from burst_impl.model.sequence_parallel import sequence_parallel
from burst_impl.model.step import train_step
from experiments.cluster.emulator.emulated import EmulatedCluster
from experiments.harness.memory import measure_peak
from experiments.harness.timing import ratio_interval, summarize, time_steps
from experiments.profiles.cluster import load_profile


@dataclass(frozen=True)
class AblationStep:
    name: str
    method: str
    loss: str
    checkpoint: str


STEPS = (
    AblationStep("ring baseline", "ring", "unfused", "full"),
    AblationStep("+ optimised backward comm", "burst", "unfused", "full"),
    AblationStep("+ double ring", "burst_double_ring", "unfused", "full"),
    AblationStep("+ fused LM head", "burst_double_ring", "fused", "full"),
    AblationStep("+ sequence-level checkpointing", "burst_double_ring", "fused", "seq"),
)

PAPER = dict(model="burstengine_14b", batch=1, seqlen=1 << 20, world_size=32, dtype="bfloat16",
             weights="fsdp2", layout="zigzag", hbm_bytes=80 * 10 ** 9)
# The mirror: 2 layers of hidden 256 with a 4096-word vocabulary (the logits are 16x the hidden
# states, as 120K vs 5120 in the paper's model), 1024 tokens over 4 ranks (the emulated links are
# scaled to this machine's compute: a few MB/s under load, so each step's rings take seconds).
MIRROR = dict(model="cpu_small", n_layers=2, vocab_size=4096, batch=1, seqlen=1024, layout="zigzag", warmup=1,
              repeats=4)


def paper_table() -> list[dict]:
    cfg = get_config(PAPER["model"])
    rows = []
    for s in STEPS:
        m = step_memory(cfg, batch=PAPER["batch"], seqlen=PAPER["seqlen"], world_size=PAPER["world_size"],
                        method=get(s.method), layout=PAPER["layout"], dtype=PAPER["dtype"], weights=PAPER["weights"],
                        checkpoint=s.checkpoint, loss=s.loss, loss_device="cuda")   # the fused loss's GPU tiles
        rows.append(dict(step=s.name, **asdict(s), predicted_total_gib=m.total_bytes / 2 ** 30,
                         oom_80gb=m.total_bytes > PAPER["hbm_bytes"], memory=m.as_dict(), config=PAPER))
    return rows


# ---------------------------------------------------------------- the mirror, on every rank


def _worker(out: str, node_size: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, G = dist.get_rank(), dist.get_world_size()
    base = replace(get_config(MIRROR["model"]), n_layers=MIRROR["n_layers"], vocab_size=MIRROR["vocab_size"])
    tokens, labels = batch_at(load_corpus("markov", base.vocab_size, n_tokens=4 * MIRROR["seqlen"]), 0,
                              MIRROR["batch"], MIRROR["seqlen"])
    cluster = json.loads(os.environ.get("EXPERIMENTS_CLUSTER", "{}"))
    first = None
    rows = []
    for s in STEPS:
        cfg = replace(base, loss=s.loss, checkpoint=s.checkpoint)
        model = sequence_parallel(build_model(cfg), get(s.method), layout=MIRROR["layout"], node_size=node_size)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        step = lambda: train_step(model, opt, tokens, labels)  # noqa: E731 - the timed closure over this step
        times = time_steps(step, warmup=MIRROR["warmup"], repeats=MIRROR["repeats"], device=torch.device("cpu"))
        opt.zero_grad(set_to_none=True)
        peak = measure_peak(step, torch.device("cpu")).peak_bytes   # every rank: the step has collectives
        peaks = torch.tensor([peak], dtype=torch.float64)
        dist.all_reduce(peaks, op=dist.ReduceOp.MAX)
        first = first or times
        predicted = step_memory(cfg, batch=MIRROR["batch"], seqlen=MIRROR["seqlen"], world_size=G,
                                method=get(s.method), layout=MIRROR["layout"])
        n, t = MIRROR["batch"] * MIRROR["seqlen"], summarize(times)
        rows.append(dict(step=s.name, **asdict(s), world_size=G, node_size=node_size, mirror=MIRROR,
                         # tokens/s of the median step; p10/p90 of tokens/s are N over the p90/p10 times
                         tokens_per_s_median=n / t["time_median_s"], tokens_per_s_p10=n / t["time_p90_s"],
                         tokens_per_s_p90=n / t["time_p10_s"],
                         speedup_vs_first=ratio_interval(first, times), times_s=times, **t,
                         peak_bytes_max_rank=int(peaks.item()),
                         predicted_step_peak_bytes=predicted.step_peak_bytes,
                         predicted_resident_bytes=predicted.resident_bytes, cluster=cluster,
                         torch=torch.__version__))
        if rank == 0:   # one line per step as it finishes: a run cut short keeps what it measured
            with open(out, "a") as f:
                f.write(json.dumps(rows[-1]) + "\n")
            print(f"{s.name:<34} {rows[-1]['tokens_per_s_median']:>9.0f} tok/s  peak {peak / 2**20:7.1f} MiB",
                  flush=True)
    dist.destroy_process_group()


# ---------------------------------------------------------------- driver


def run_mirror(out: Path, cluster: str, port: int = 29871) -> int:
    profile = load_profile(cluster)
    G = profile.nodes * profile.ranks_per_node
    args = ["--worker", "--out", str(out), "--node-size", str(profile.ranks_per_node)]
    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(repo), "OMP_NUM_THREADS": "1"}
    with EmulatedCluster(profile) as cl:
        env.update(cl.env(G))
        cmds = cl.launches(G, args, port=port, module="experiments.benches.ablation")
        procs = [subprocess.Popen(c, cwd=repo, env=env) for c in cmds]
        rc = 0
        for p in procs:
            rc = rc or p.wait(timeout=2400)
    return rc


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--paper", action="store_true", help="print the memory model of each step at the paper's size")
    ap.add_argument("--cluster", default="a100_roce_emu", help="cluster profile of the CPU mirror")
    ap.add_argument("--out", default="/tmp/burst_ablation.jsonl", help="JSON lines, appended")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--node-size", type=int, default=2, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        _worker(a.out, a.node_size)
        return 0
    if a.paper:
        for r in paper_table():
            print(f"{r['step']:<34} {r['predicted_total_gib']:8.1f} GiB/rank  "
                  f"{'OOM' if r['oom_80gb'] else 'fits'} on 80 GB")
        return 0
    t0 = time.time()
    rc = run_mirror(Path(a.out), a.cluster)
    print(f"mirror finished in {time.time() - t0:.0f} s (rc {rc}); records in {a.out}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
