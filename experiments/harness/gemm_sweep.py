"""bf16 matmul throughput on one device: the model's layer shapes and a grid for the best shape.

The performance model charges every projection at ``accelerator.gemm_efficiency`` of the peak, a
ceiling measured on the best shape (as the "maximum achievable matmul FLOPS" tables do). This
measures both sides of that assumption on the device it runs on:

* ``layer``: each decoder GEMM of a model config (``burst_impl.model.config``) at ``tokens`` rows:
  the fused QKV projection, the output projection, the MLP's gate+up (one GEMM, 2F columns) and its
  down projection, (tokens x in) @ (in x out);
* ``grid``: every (m, n, k) of ``GRID`` x ``GRID`` x ``GRID``, whose best is the ceiling.

Time from the suite's timing module (warm-up, CUDA events, median), FLOPs 2mnk. One dict per shape.

    rows = run_gemms(torch.device("cuda"), models=("llama2_7b",), tokens=(4096,))
"""
from __future__ import annotations

import time
from typing import Callable

import torch

from burst_impl.model.config import get_config

from .timing import summarize, time_steps

GRID = (4096, 8192, 16384)


def layer_shapes(model: str, tokens: int) -> list[tuple[str, int, int, int]]:
    """(name, m, n, k) of one decoder block's GEMMs: (m x k) @ (k x n) with m = tokens."""
    c = get_config(model)
    qkv = (c.n_heads + 2 * c.n_kv_heads) * c.head_dim
    return [(f"{model}/qkv", tokens, qkv, c.hidden),
            (f"{model}/out", tokens, c.hidden, c.n_heads * c.head_dim),
            (f"{model}/gate_up", tokens, 2 * c.ffn_hidden, c.hidden),
            (f"{model}/down", tokens, c.hidden, c.ffn_hidden)]


def measure_gemm(name: str, m: int, n: int, k: int, device: torch.device, *, dtype=torch.bfloat16,
                 warmup: int = 3, repeats: int = 10) -> dict:
    """One shape: median seconds, TFLOP/s, and the raw samples (random normal inputs, seed 0)."""
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(m, k, device=device, dtype=dtype, generator=gen)
    b = torch.randn(k, n, device=device, dtype=dtype, generator=gen)
    samples = time_steps(lambda: a @ b, warmup=warmup, repeats=repeats, device=device)
    stats = summarize(samples)
    flops = 2.0 * m * n * k
    return {"name": name, "m": m, "n": n, "k": k, "dtype": str(dtype).removeprefix("torch."), "flops": flops,
            "time_median_s": stats["time_median_s"], "tflops": flops / stats["time_median_s"] / 1e12,
            "time_samples_s": samples}


def run_gemms(device: torch.device, *, models=("llama2_7b", "llama2_13b", "llama3_8b", "llama3_70b"),
              tokens=(4096, 16384), grid=GRID, warmup: int = 3, repeats: int = 10,
              budget_s: float | None = None, log: Callable[[str], None] = print) -> list[dict]:
    """Every layer shape, then the grid; shapes past ``budget_s`` are left out (and counted in the log)."""
    shapes = [("layer", *s) for mdl in models for t in tokens for s in layer_shapes(mdl, t)]
    shapes += [("grid", f"grid/{m}x{n}x{k}", m, n, k) for m in grid for n in grid for k in grid]
    out, t0 = [], time.perf_counter()
    for kind, name, m, n, k in shapes:
        if budget_s is not None and time.perf_counter() - t0 > budget_s:
            log(f"  gemm: budget {budget_s:.0f} s spent; {len(shapes) - len(out)} shapes not run")
            break
        row = dict(measure_gemm(name, m, n, k, device, warmup=warmup, repeats=repeats), kind=kind)
        out.append(row)
        log(f"  {name:<28} {m:>6} x {n:>6} x {k:>6}  {row['tflops']:7.1f} TFLOP/s")
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out


def best(rows: list[dict]) -> dict | None:
    """The fastest shape measured: the matmul ceiling the performance model's gemm_efficiency means."""
    return max(rows, key=lambda r: r["tflops"], default=None)
