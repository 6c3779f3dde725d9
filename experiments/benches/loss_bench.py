"""Peak memory and time of the LM head + cross-entropy, per loss mode (forward + backward).

    python -m experiments.benches.loss_bench        # tokens 8192, hidden 1024, vocab 32K and 128K, fp32
    python -m experiments.benches.loss_bench --vocab 32768 --dtype bfloat16 --modes unfused fused
    python -m experiments.benches.loss_bench --modes fused --tiles 1024x2048 2048x2048 --vocab 32768   # tile sweep
    python -m experiments.benches.loss_bench --modes unfused fused fused_recompute --vocab 32768   # both fused paths
    python -m experiments.benches.loss_bench --json loss_bench.jsonl   # one JSON line per case, with raw samples

One step = zero the gradients, loss (mean), backward; d hidden and d W are
part of the step's memory. Peak memory is the suite's measurement
(experiments/harness/memory.py: CUDA allocator peak, or the CPU allocator's
live bytes under the profiler) in a separate untimed step; times come from the
suite's timing module (experiments/harness/timing.py). Cases are timed
interleaved, one step of each per round, so that a machine whose load drifts
(a shared CPU) shifts all modes alike; median and p10/p90 of the rounds are
printed, and ratios against ``unfused`` at the same size and dtype.
On CPU the process's CPU time per step is recorded next to the wall time (a
diagnostic for a shared machine: with one thread it excludes the time the
step waited for a core; it is not the suite's timing).
Modes that cannot run here (Liger, CCE without CUDA) are listed as skipped.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass

import torch

from experiments.cli import prog
from experiments.harness.env import git_info, hardware, versions
from experiments.harness.memory import is_oom, measure_peak
from experiments.harness.timing import summarize, synchronize, time_steps

from burst_impl.loss_modes import LOSS_MODES, get_loss_mode

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
FUSED_MODES = ("fused", "fused_recompute")      # ours: take --tiles (gradients in the forward: rows only)


@dataclass(frozen=True)
class LossCase:
    mode: str
    tokens: int
    hidden: int
    vocab: int
    dtype: str = "float32"
    chunk_tokens: int | None = None      # FUSED_MODES only; None = the module's default
    chunk_vocab: int | None = None
    ignore_frac: float = 0.0             # share of labels set to ignore_index
    seed: int = 0

    @property
    def name(self) -> str:
        tile = f"[{self.chunk_tokens}x{self.chunk_vocab}]" if self.chunk_tokens or self.chunk_vocab else ""
        return f"{self.mode}{tile}"

    @property
    def logits_bytes(self) -> int:
        return self.tokens * self.vocab * torch.finfo(DTYPES[self.dtype]).bits // 8


@dataclass
class Built:
    step: object
    start_bytes: int


def build(case: LossCase, device: torch.device) -> Built:
    """Inputs on ``device`` and the step: grads cleared, loss, backward."""
    mode = get_loss_mode(case.mode)
    g = torch.Generator(device="cpu").manual_seed(case.seed)
    dt = DTYPES[case.dtype]
    hidden = torch.randn(case.tokens, case.hidden, generator=g).to(device, dt).requires_grad_()
    # LM-head initialisation scale: logits of order 1, as in training.
    weight = (torch.randn(case.vocab, case.hidden, generator=g) / case.hidden ** 0.5).to(device, dt).requires_grad_()
    labels = torch.randint(0, case.vocab, (case.tokens,), generator=g)
    if case.ignore_frac:
        labels[torch.rand(case.tokens, generator=g) < case.ignore_frac] = -100
    labels = labels.to(device)
    opts = {}
    if case.mode in FUSED_MODES:
        opts = {k: v for k, v in (("chunk_tokens", case.chunk_tokens), ("chunk_vocab", case.chunk_vocab)) if v}

    def step():
        hidden.grad = weight.grad = None
        mode(hidden, weight, labels, **opts).backward()

    start = sum(t.numel() * t.element_size() for t in (hidden, weight, labels))
    return Built(step, start)


def run(cases: list[LossCase], device: torch.device, *, warmup: int, repeats: int, memory: bool = True,
        log=print) -> list[dict]:
    """One record per case: status, samples and their summary, peak memory, ratios to ``unfused``."""
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats={repeats!r} must be an int >= 1 (timed rounds; a median needs a sample)")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup={warmup!r} must be an int >= 0")
    records, built = {}, {}
    for c in cases:
        rec = {"case": asdict(c), "name": c.name, "status": "ok", "reason": ""}
        mode = LOSS_MODES.get(c.mode)
        why = mode.unavailable() if mode is not None else f"unknown loss mode {c.mode!r}"
        if why:
            rec.update(status="skipped", reason=why)
        else:
            try:
                b = built[c] = build(c, device)
                if memory:
                    m = measure_peak(b.step, device, start_bytes=b.start_bytes)
                    rec.update(mem_peak_bytes=m.peak_bytes, mem_start_bytes=m.start_bytes, mem_method=m.method)
                for _ in range(warmup):
                    b.step()
                rec["samples_s"] = []
            except Exception as e:  # noqa: BLE001 - recorded, the sweep goes on
                built.pop(c, None)
                rec.update(status="oom" if is_oom(e) else "failed", reason=f"{type(e).__name__}: {e}")
        records[c] = rec
        log(f"  prepared {c.name} vocab={c.vocab} {c.dtype}: {rec['status']} {rec['reason']}".rstrip())
    for r in range(repeats):                              # interleaved rounds
        for c, b in list(built.items()):
            try:
                cpu0 = time.process_time()
                records[c]["samples_s"] += time_steps(b.step, warmup=0, repeats=1, device=device)
                if device.type == "cpu":
                    records[c].setdefault("cpu_samples_s", []).append(time.process_time() - cpu0)
            except Exception as e:  # noqa: BLE001 - recorded, the sweep goes on without this case
                built.pop(c)
                records[c].update(status="oom" if is_oom(e) else "failed", reason=f"{type(e).__name__}: {e}")
        log(f"  round {r + 1}/{repeats} done")
    synchronize(device)
    for c, rec in records.items():
        if rec.get("samples_s"):
            rec.update(summarize(rec["samples_s"]))
        if rec.get("cpu_samples_s"):
            rec["cpu_median_s"] = statistics.median(rec["cpu_samples_s"])
        base = records.get(LossCase("unfused", c.tokens, c.hidden, c.vocab, c.dtype, seed=c.seed,
                                    ignore_frac=c.ignore_frac))
        if base and base.get("time_median_s") and rec.get("time_median_s"):
            rec["time_ratio_to_unfused"] = rec["time_median_s"] / base["time_median_s"]
        if base and base.get("cpu_median_s") and rec.get("cpu_median_s"):
            rec["cpu_ratio_to_unfused"] = rec["cpu_median_s"] / base["cpu_median_s"]
        if base and base.get("mem_peak_bytes") and rec.get("mem_peak_bytes") is not None:
            rec["mem_ratio_to_unfused"] = rec["mem_peak_bytes"] / base["mem_peak_bytes"]
        rec["logits_bytes"] = c.logits_bytes
    return list(records.values())


def table(records: list[dict]) -> str:
    head = ("| mode | vocab | dtype | peak MiB | x unfused | time median s [p10, p90] | x unfused "
            "| CPU s | x unfused |\n"
            "|---|---:|---|---:|---:|---|---:|---:|---:|")
    rows = []
    for r in records:
        c = r["case"]
        if r["status"] != "ok":
            rows.append(f"| {r['name']} | {c['vocab']} | {c['dtype']} | {r['status']}: {r['reason'][:60]} | | | | | |")
            continue
        mem = r.get("mem_peak_bytes")
        rows.append("| {} | {} | {} | {} | {} | {:.2f} [{:.2f}, {:.2f}] | {} | {} | {} |".format(
            r["name"], c["vocab"], c["dtype"], f"{mem / 2**20:.0f}" if mem is not None else "-",
            f"{r['mem_ratio_to_unfused']:.3f}" if "mem_ratio_to_unfused" in r else "-",
            r["time_median_s"], r["time_p10_s"], r["time_p90_s"],
            f"{r['time_ratio_to_unfused']:.2f}" if "time_ratio_to_unfused" in r else "-",
            f"{r['cpu_median_s']:.2f}" if "cpu_median_s" in r else "-",
            f"{r['cpu_ratio_to_unfused']:.2f}" if "cpu_ratio_to_unfused" in r else "-"))
    return "\n".join([head, *rows])


def _tile(s: str) -> tuple[int, int]:
    try:
        a, b = s.lower().split("x")
        return int(a), int(b)
    except ValueError:
        raise argparse.ArgumentTypeError(f"tile {s!r} must look like 1024x4096 (chunk_tokens x chunk_vocab)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=prog("python -m experiments.benches.loss_bench"),
                                description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--vocab", type=int, nargs="+", default=[32768, 131072])
    p.add_argument("--dtype", nargs="+", default=["float32"], choices=sorted(DTYPES))
    p.add_argument("--modes", nargs="+", default=list(LOSS_MODES), choices=list(LOSS_MODES))
    p.add_argument("--tiles", type=_tile, nargs="*", default=[],
                   help="fused tile sizes to compare (chunk_tokens x chunk_vocab; with gradients in the "
                   "forward only chunk_tokens applies, the rows); default: the module's")
    p.add_argument("--ignore-frac", type=float, default=0.0)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--no-memory", action="store_true", help="skip the (slow, profiled) peak-memory step")
    p.add_argument("--json", default=None, help="append one JSON line per case to this file")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    dev = torch.device("cuda" if a.device == "cuda" or (a.device == "auto" and torch.cuda.is_available()) else "cpu")
    cases = []
    for dtype in a.dtype:
        for vocab in a.vocab:
            for mode in a.modes:
                tiles = a.tiles if mode in FUSED_MODES and a.tiles else [(None, None)]
                cases += [LossCase(mode, a.tokens, a.hidden, vocab, dtype, ct, cv, a.ignore_frac)
                          for ct, cv in tiles]
    meta = {"hardware": hardware(), "versions": versions(), "git": git_info(), "threads": torch.get_num_threads(),
            "device": str(dev), "warmup": a.warmup, "repeats": a.repeats,
            "loadavg_start": os.getloadavg() if hasattr(os, "getloadavg") else None}
    print(f"# loss modes, forward+backward, tokens={a.tokens} hidden={a.hidden}; {meta['hardware']['summary']}, "
          f"{meta['threads']} threads, load average {meta['loadavg_start']}", flush=True)
    records = run(cases, dev, warmup=a.warmup, repeats=a.repeats, memory=not a.no_memory,
                  log=lambda s: print(s, file=sys.stderr, flush=True))
    meta["loadavg_end"] = os.getloadavg() if hasattr(os, "getloadavg") else None
    print(table(records))
    print(f"# load average at the end {meta['loadavg_end']}")
    if a.json:
        with open(a.json, "a") as f:
            for r in records:
                f.write(json.dumps({**r, **meta}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
