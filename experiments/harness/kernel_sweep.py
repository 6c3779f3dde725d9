"""Throughput of the local attention kernels on one device: TFLOP/s vs sequence length.

Each kernel of ``burst_impl.kernels`` is timed through the entry points every
ring method calls (``attn_forward``; ``attn_backward`` with the delta
surrogate), next to ``torch.nn.functional.scaled_dot_product_attention``
("torch_sdpa": PyTorch's own choice of fused kernel, with autograd), on the
full sequence of one device (B, N, Z, d). Time comes from the suite's timing
module (warm-up, CUDA events on GPU, raw samples), FLOPs from its one formula
(``flops.attention_flops``), peak memory from ``memory.measure_peak``. One
record per (kernel, causal, mode, N), in the suite's record format
(``results.base_record``: config, git commit and dirty flag, versions,
hardware, seed, repeat counts, raw samples) with ``level: "kernel"`` and the
kernel's name as ``method`` and ``kernel``. ``experiments/kernel_figure.py`` draws them.

    records = run_sweep(["flash_attn", "xformers", "cuda_sdpa", TORCH_SDPA], [1024, 4096],
                        device=torch.device("cuda"), results_root="results/gpu_check/nvidia-h200",
                        experiment="kernels")
"""
from __future__ import annotations

import contextlib
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from burst_impl.kernels import BACKENDS, attn_backward, attn_forward, check_backend, compute_delta, default_scale
from burst_impl.shape import DTYPE_NAMES, AttnShape

from . import results as R
from burst_impl.flops import attention_flops, tflops_per_s, tokens_per_s
from .memory import is_oom, measure_peak
from .spec import Case
from .timing import summarize, time_steps

TORCH_SDPA = "torch_sdpa"        # torch.nn.functional.scaled_dot_product_attention, the yardstick
# SDPA with one backend pinned (torch.nn.attention.sdpa_kernel): which fused kernel a GPU gives, each on
# its own; "flash" is PyTorch's FlashAttention-2, "cudnn" cuDNN's fused attention (Hopper and later)
SDPA_PINNED = {"torch_sdpa_flash": "FLASH_ATTENTION", "torch_sdpa_efficient": "EFFICIENT_ATTENTION",
               "torch_sdpa_cudnn": "CUDNN_ATTENTION"}
SDPA_KERNELS = (TORCH_SDPA, *SDPA_PINNED)
MODES = ("forward", "fwd_bwd")


@dataclass(frozen=True)
class SweepShape:
    """Everything but N and the mask: one attention problem on one device (MHA)."""

    batch: int = 1
    heads: int = 32
    head_dim: int = 128
    dtype: torch.dtype = torch.bfloat16


def _problem(kernel: str, device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    if kernel == TORCH_SDPA:
        return None
    if kernel in SDPA_PINNED:
        return None if device.type == "cuda" else f"{kernel}: a pinned SDPA backend runs on CUDA, not {device.type}"
    try:
        check_backend(kernel, device, dtype, head_dim)
    except ValueError as e:
        return str(e)
    return None


def make_step(kernel: str, mode: str, q, k, v, do, causal: bool) -> Callable[[], object]:
    """The timed callable: one forward, or one forward + backward, of ``kernel`` on (B, N, Z, d) inputs."""
    scale = default_scale(q.shape[-1], None)
    if kernel in SDPA_KERNELS:
        return _sdpa_step(kernel, mode, q, k, v, do, causal, scale)
    if mode == "forward":
        return lambda: attn_forward(q, k, v, causal=causal, scale=scale, backend=kernel)

    def step():
        out, lse = attn_forward(q, k, v, causal=causal, scale=scale, backend=kernel)
        return attn_backward(do, q, k, v, lse, compute_delta(do, out), causal=causal, scale=scale, backend=kernel)
    return step


def _sdpa_step(kernel: str, mode: str, q, k, v, do, causal: bool, scale: float) -> Callable[[], object]:
    """SDPA with autograd on (B, Z, N, d) views; a pinned backend raises rather than falling back."""
    pin = (lambda: sdpa_kernel([getattr(SDPBackend, SDPA_PINNED[kernel])])) if kernel in SDPA_PINNED \
        else contextlib.nullcontext
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))            # (B, Z, N, d) views
    dot = do.transpose(1, 2)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    if mode == "forward":
        def step():
            with torch.no_grad(), pin():
                return sdpa(qt, kt, vt, is_causal=causal, scale=scale)
        return step
    leaves = [t.detach().requires_grad_() for t in (qt, kt, vt)]

    def step():
        for t in leaves:
            t.grad = None
        with pin():
            out = sdpa(*leaves, is_causal=causal, scale=scale)
        out.backward(dot)
    return step


def _case(experiment: str, kernel: str, mode: str, n: int, causal: bool, shape: SweepShape,
          warmup: int, repeats: int, seed: int) -> Case:
    s = AttnShape(batch=shape.batch, seqlen=n, heads=shape.heads, kv_heads=shape.heads, head_dim=shape.head_dim,
                  world_size=1, dtype=DTYPE_NAMES[shape.dtype], causal=causal, layout="contiguous")
    return Case(experiment=experiment, method=kernel, level="kernel", mode=mode, shape=s, warmup=warmup,
                repeats=repeats, seed=seed, measure_memory=True, measure_comm=False, kernel=kernel)


def measure_point(case: Case, device: torch.device) -> dict:
    """One record: the kernel ``case.method`` on ``device`` (status ok, oom, failed or skipped)."""
    kernel, s = case.method, case.shape
    why = _problem(kernel, device, s.torch_dtype, s.head_dim)
    if why:
        return R.base_record(case, "skipped", why)
    t0 = time.perf_counter()
    gen = torch.Generator().manual_seed(case.seed)
    try:
        q, k, v, do = (torch.randn(s.batch, s.seqlen, s.heads, s.head_dim, generator=gen)
                       .to(device=device, dtype=s.torch_dtype) for _ in range(4))
        step = make_step(kernel, case.mode, q, k, v, do, s.causal)
        samples = time_steps(step, warmup=case.warmup, repeats=case.repeats, device=device)
        mem = measure_peak(step, device, start_bytes=4 * q.numel() * q.element_size())
    except Exception as e:  # noqa: BLE001 - every failure is a record, the sweep goes on
        status = "oom" if is_oom(e) else "failed"
        rec = R.base_record(case, status, f"{type(e).__name__}: {str(e)[:600]}")
        rec["traceback"] = traceback.format_exc(limit=3)
        return rec
    finally:
        if device.type == "cuda":
            torch.cuda.empty_cache()
    rec = R.base_record(case, "ok", extra_config={"device": device.type, "sweep": "kernel_sweep"})
    stats = summarize(samples)
    flops = attention_flops(s, mode=case.mode)
    med = stats["time_median_s"]
    rec.update(stats)
    rec.update({
        "time_samples_s": samples, "flops": flops, "tflops_total": tflops_per_s(flops, med),
        "tflops_per_rank": tflops_per_s(flops, med),
        "tflops_p10": tflops_per_s(flops, stats["time_p90_s"]), "tflops_p90": tflops_per_s(flops, stats["time_p10_s"]),
        "tokens_per_s": tokens_per_s(s.batch, s.seqlen, med),
        "mem_peak_bytes": mem.peak_bytes, "mem_start_bytes": mem.start_bytes, "mem_method": mem.method,
        "mem_measured_over": "forward (no grad)" if case.mode == "forward" else "forward + backward",
        "duration_s": time.perf_counter() - t0,
    })
    return rec


def run_sweep(kernels: list[str], seqlens: list[int], *, device: torch.device, results_root: Path | str,
              experiment: str = "kernels", shape: SweepShape = SweepShape(), causal: tuple[bool, ...] = (True, False),
              modes: tuple[str, ...] = MODES, warmup: int = 3, repeats: int = 10, seed: int = 0,
              log: Callable[[str], None] = print, budget_s: float | None = None) -> list[dict]:
    """Measure every (kernel, causal, mode, N); append each record to ``results_root/experiment``.

    ``budget_s``: once that much wall time is spent, the points not yet measured are recorded as
    skipped with that reason (a device lent for a bounded command must get the records back)."""
    for k in kernels:
        if k not in SDPA_KERNELS and k not in BACKENDS:
            raise ValueError(f"kernels: {k!r} is unknown; choose from {[*BACKENDS, *SDPA_KERNELS]}")
    out = []
    t0 = time.perf_counter()
    for kernel in kernels:
        for c in causal:
            for mode in modes:
                for n in seqlens:
                    case = _case(experiment, kernel, mode, n, c, shape, warmup, repeats, seed)
                    if budget_s is not None and time.perf_counter() - t0 >= budget_s:
                        rec = R.base_record(case, "skipped", f"the sweep's time budget ({budget_s:.0f} s) was spent")
                        R.append_record(results_root, rec)
                        out.append(rec)
                        continue
                    rec = measure_point(case, device)
                    R.append_record(results_root, rec)
                    out.append(rec)
                    shown = (f"{rec['tflops_total']:7.1f} TFLOP/s" if rec["status"] == "ok"
                             else f"{rec['status']}: {rec['reason'][:100]}")
                    log(f"  {kernel:<10} {'causal' if c else 'full':<6} {mode:<8} N={n:<7} {shown}")
                    if rec["status"] == "skipped":
                        break                                  # the same reason for every N
    return out
