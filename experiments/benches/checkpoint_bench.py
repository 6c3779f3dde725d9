"""Peak memory and time of one training step (forward + backward) per checkpoint mode, one process.

    python -m experiments.benches.checkpoint_bench                          # defaults below
    python -m experiments.benches.checkpoint_bench --seqlen 8192 --json ckpt.jsonl

The model is long-sequence shaped (hidden 128, 4 heads of 32, FFN 344,
vocabulary 4096, 2 layers) so that causal attention is most of a block's
FLOPs at N = 4096 (2NH = 1.0M per token against 8H^2 + 6HF = 0.39M for the
projections and MLP), the regime where sequence-level checkpointing pays:
``seq`` recomputes 1/4 of the attention, ``full`` all of it. Fused loss.
Modes are timed interleaved (one step of each per round: a drifting load
shifts all alike), median and p10/p90 of the rounds, and the ratio of medians
to ``none`` with a bootstrap interval (``experiments/harness/timing.py``);
peak memory is the harness's CPU measurement in a separate step, next to
the memory model's prediction (``memory.step_memory``).
"""
from __future__ import annotations

import argparse
import json
from dataclasses import asdict, replace

import torch

from experiments.cli import prog
from experiments.harness.memory import measure_peak
from experiments.harness.timing import ratio_interval, summarize, time_steps

from burst_impl.model.config import CHECKPOINT_MODES as MODES
from burst_impl.model.config import get_config
from burst_impl.model.data import batch_at, load_corpus
from burst_impl.model.memory import step_memory
from burst_impl.model.model import build_model
from burst_impl.model.step import loss_and_grads


def bench_config(**kw):
    return replace(get_config("cpu_small"), n_layers=2, hidden=128, n_heads=4, n_kv_heads=4, ffn_hidden=344,
                   vocab_size=4096, loss="fused", **kw)


def run(seqlen: int, rounds: int, threads: int, memory: bool = True) -> list[dict]:
    torch.set_num_threads(threads)
    base = bench_config()
    tokens, labels = batch_at(load_corpus("markov", base.vocab_size, n_tokens=4 * seqlen), 0, 1, seqlen)
    models = {m: build_model(replace(base, checkpoint=m)) for m in MODES}

    def step(m):
        def go():
            for p in models[m].parameters():
                p.grad = None
            loss_and_grads(models[m], tokens, labels)
        return go

    cpu = torch.device("cpu")
    samples = {m: [] for m in MODES}
    for m in MODES:
        step(m)()                                                        # warm-up
    for _ in range(rounds):
        for m in MODES:
            samples[m] += time_steps(step(m), warmup=0, repeats=1, device=cpu)
    rows = []
    for m in MODES:
        peak = None
        if memory:
            for p in models[m].parameters():
                p.grad = None
            peak = measure_peak(lambda: loss_and_grads(models[m], tokens, labels), cpu).peak_bytes
        pred = step_memory(models[m].cfg, batch=1, seqlen=seqlen)
        rows.append(dict(mode=m, seqlen=seqlen, threads=threads, config=asdict(models[m].cfg), **summarize(samples[m]),
                         times_s=samples[m], time_vs_none=ratio_interval(samples[m], samples["none"]),
                         peak_bytes=peak, predicted_step_peak_bytes=pred.step_peak_bytes))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog=prog("python -m experiments.benches.checkpoint_bench"),
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqlen", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-memory", action="store_true")
    ap.add_argument("--json", default=None, help="append one JSON line per mode")
    a = ap.parse_args(argv)
    rows = run(a.seqlen, a.rounds, a.threads, memory=not a.no_memory)
    print(f"{'mode':<6} {'median s':>9} {'p10':>7} {'p90':>7} {'x none':>7} {'[95%]':>15} {'peak MiB':>9} {'model':>7}")
    for r in rows:
        t = r["time_vs_none"]
        peak = f"{r['peak_bytes'] / 2**20:9.1f}" if r["peak_bytes"] is not None else f"{'-':>9}"
        print(f"{r['mode']:<6} {r['time_median_s']:9.3f} {r['time_p10_s']:7.3f} {r['time_p90_s']:7.3f} "
              f"{t['ratio']:7.2f} [{t['lo']:5.2f}, {t['hi']:5.2f}] {peak} "
              f"{r['predicted_step_peak_bytes'] / 2**20:7.1f}")
    if a.json:
        with open(a.json, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
