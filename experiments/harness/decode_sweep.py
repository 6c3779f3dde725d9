"""Decode attention on one device against the HBM roofline the performance model charges it at.

The model prices a decode step's attention (``perfmodel/decode_costs.py``) at its roofline: the K and
V read once from HBM at the profile's nominal ``hbm_gbytes_s`` (or the FLOPs at the flash efficiency,
whichever is longer). This measures what the suite's kernels take for it on the device it runs on:

* ``rows``: ``q`` new tokens of ``batch`` sequences over ``context`` cached keys, one kernel call
  (``kernels.attn_forward``, unmasked: the cached keys all precede the new token), per backend; bytes
  are the roofline's (K and V read, q and out), the achieved rate bytes / median time;
* ``copy``: a device-to-device copy of ``COPY_BYTES``, read + write, the streaming ceiling of the HBM.

Time from the suite's timing module (warm-up, CUDA events, median and interval). One dict per point;
a point that runs out of memory is kept with ``status: "oom"``, one a kernel refuses with ``"failed"``.

    rows = run_decode(torch.device("cuda"), kernels=("cuda_flash",), contexts=(4096, 65536))
"""
from __future__ import annotations

import time
from typing import Callable

import torch

from burst_impl.kernels import attn_forward, default_scale

from .timing import summarize, time_steps

COPY_BYTES = 4 << 30
# (query heads, kv heads): Llama-3 8B (and Llama-2 7B's GQA-less 32:32), Llama-3 70B at d = 128
HEADS = ((32, 8), (32, 32), (64, 8))


def roofline_bytes(batch: int, q: int, context: int, heads: int, kv_heads: int, head_dim: int, elem: int) -> int:
    """What the model's ``decode_attention`` reads and writes: K and V once, q and out (per sequence, x batch)."""
    return batch * (2 * context * kv_heads * head_dim + 2 * q * heads * head_dim) * elem


# PyTorch's efficient-attention kernel (``cuda_sdpa``, kv heads repeated to Z) hit an illegal memory access on an
# H200 at B 1, N 1M, Z 32:8 (K of 2^32 elements as it reads it; torch 2.11, 2026-12-04, twice), which leaves the
# CUDA context unusable for every later point: not run from 2^31 elements (the int32 index range) up.
SDPA_MAX_ELEMENTS = 2 ** 31


def measure_decode(kernel: str, batch: int, q: int, context: int, heads: int, kv_heads: int, device: torch.device,
                   *, head_dim: int = 128, dtype=torch.bfloat16, warmup: int = 3, repeats: int = 10) -> dict:
    row = dict(kernel=kernel, batch=batch, q=q, context=context, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
               dtype=str(dtype).removeprefix("torch."))
    if kernel == "cuda_sdpa" and batch * context * heads * head_dim >= SDPA_MAX_ELEMENTS:
        return dict(row, status="skipped", reason="K as cuda_sdpa reads it (kv heads repeated) has >= 2^31 "
                                                  "elements: an illegal memory access on an H200 (SDPA_MAX_ELEMENTS)")
    gen = torch.Generator(device=device).manual_seed(0)
    try:
        qt = torch.randn(batch, q, heads, head_dim, device=device, dtype=dtype, generator=gen)
        k, v = (torch.randn(batch, context, kv_heads, head_dim, device=device, dtype=dtype, generator=gen)
                for _ in range(2))
        scale = default_scale(head_dim, None)
        samples = time_steps(lambda: attn_forward(qt, k, v, causal=False, scale=scale, backend=kernel),
                             warmup=warmup, repeats=repeats, device=device)
    except torch.OutOfMemoryError as e:
        return dict(row, status="oom", reason=str(e).splitlines()[0][:200])
    except RuntimeError as e:          # a kernel that refuses the shape: kept, with its message
        return dict(row, status="failed", reason=f"{type(e).__name__}: {str(e)[:300]}")
    finally:
        qt = k = v = None
        if device.type == "cuda":
            torch.cuda.empty_cache()
    stats = summarize(samples)
    nbytes = roofline_bytes(batch, q, context, heads, kv_heads, head_dim, torch.finfo(dtype).bits // 8)
    return dict(row, status="ok", bytes=nbytes, time_median_s=stats["time_median_s"],
                time_ci_lo_s=stats["time_ci_lo_s"], time_ci_hi_s=stats["time_ci_hi_s"],
                gbytes_s=nbytes / stats["time_median_s"] / 1e9, time_samples_s=samples)


def measure_copy(device: torch.device, nbytes: int = COPY_BYTES, *, warmup: int = 3, repeats: int = 10) -> dict:
    """A device-to-device copy: the rate is (read + write) / time, what a streaming kernel can reach."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    samples = time_steps(lambda: dst.copy_(src), warmup=warmup, repeats=repeats, device=device)
    t = summarize(samples)["time_median_s"]
    return dict(kernel="copy", bytes=2 * nbytes, time_median_s=t, gbytes_s=2 * nbytes / t / 1e9, status="ok",
                time_samples_s=samples)


def run_decode(device: torch.device, *, kernels=("cuda_flash", "cuda_cudnn", "cuda_sdpa"),
               contexts=(4096, 16384, 65536, 262144, 1048576), batches=(1, 16), heads=HEADS, queries=(1,),
               max_tokens: int = 1 << 22, budget_s: float | None = None, copy_bytes: int = COPY_BYTES,
               warmup: int = 3, repeats: int = 10, log: Callable[[str], None] = print) -> list[dict]:
    """The copy ceiling, then every (heads, batch, new tokens, context, kernel) with batch x context <=
    ``max_tokens``; points past ``budget_s`` are left out (and counted in the log). ``queries``: new
    tokens per sequence (1: plain decode; more: speculative decode, or a chunk of a prefill over a cache)."""
    points = [(z, zkv, b, q, n, k) for z, zkv in heads for b in batches for q in queries for n in contexts
              if b * n <= max_tokens for k in kernels]
    out, t0 = [measure_copy(device, copy_bytes, warmup=warmup, repeats=repeats)], time.perf_counter()
    log(f"  copy {out[0]['bytes'] / 2**30:.0f} GiB moved: {out[0]['gbytes_s']:7.0f} GB/s")
    for z, zkv, b, q, n, k in points:
        if budget_s is not None and time.perf_counter() - t0 > budget_s:
            log(f"  decode: budget {budget_s:.0f} s spent; {len(points) - len(out) + 1} points not run")
            break
        row = measure_decode(k, b, q, n, z, zkv, device, warmup=warmup, repeats=repeats)
        out.append(row)
        rate = f"{row['gbytes_s']:7.0f} GB/s" if row["status"] == "ok" else row["status"]
        log(f"  {k:<11} Z {z:>2}:{zkv:<2} B {b:>2} q {q:>4} N {n:>8}  {rate}")
    return out
