"""The performance model's GPU constants, measured on the GPU the check runs on.

A hardware profile (``experiments/hardware/*.yaml``) charges attention at ``attn_efficiency`` /
``attn_efficiency_forward`` of the peak, a table over the kernel's block size, and GEMMs at
``gemm_efficiency``. The profiles took them from papers' charts; this measures them:

* ``attention_table``: PyTorch's SDPA with one backend pinned (``kernel_sweep.SDPA_PINNED``) in the
  setup of the FlashAttention papers' speed charts the H100 profile was read from (Shah et al. 2024,
  arXiv 2407.08608): head dim 128, hidden 2048 (16 heads), batch x N = 16K tokens, N = 512..16K,
  bf16, forward and forward + backward, full and causal. ``efficiency`` turns the records into the
  profile's tables: TFLOP/s over the profile's peak under the suite's FLOP convention
  (``burst_impl/flops.py``; forward + backward 3.5x the forward, causal halved), so the combined
  entry is 3.5 / (1/fwd + 2.5/bwd) as the profile's comment defines it.
* ``gemm_table``: ``harness.gemm_sweep`` (the model's layer shapes and a grid); its best shape over
  the peak is the profile's ``gemm_efficiency``.
* ``decode_table``: ``harness.decode_sweep`` (one kernel call of a decode step's attention over a cache,
  and a device copy) beside what the model's ``decode_attention`` charges for it on the profile: the
  roofline at the nominal ``hbm_gbytes_s``, which no kernel measured here is fitted to.
"""
from __future__ import annotations

import time
from pathlib import Path

import torch

from .harness import decode_sweep as DS
from .harness import gemm_sweep as GS
from .harness import kernel_sweep as KS
from .perfmodel.decode_costs import DecodeCosts
from .profiles.hardware import load_hardware

PROFILE = "h200_sxm_ib_4x8"           # whose peak the efficiencies are taken over
TABLE_TOKENS = 16384                  # batch x N, the FlashAttention papers' charts
TABLE_HEADS = 16                      # hidden 2048 at head dim 128
TABLE_SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
TABLE_KERNELS = ("torch_sdpa_flash", "torch_sdpa_cudnn", "torch_sdpa_efficient")
TABLE_SETUP = (f"B x N = {TABLE_TOKENS} tokens, Z={TABLE_HEADS}, d=128, bfloat16 "
               "(the FlashAttention papers' speed charts)")      # the table's figure and file say it


def peak_tflops(profile: str = PROFILE, dtype: str = "bfloat16") -> float:
    return load_hardware(profile).accelerator.peak_tflops[dtype]


def attention_table(out: Path, device: torch.device, *, budget_s: float, seqlens=TABLE_SEQLENS,
                    kernels=TABLE_KERNELS, warmup: int = 3, repeats: int = 10) -> list[dict]:
    """The records of every (kernel, mask, mode, N) in the charts' setup (experiment ``sdpa_profile``)."""
    recs, t0 = [], time.perf_counter()
    for n in seqlens:
        shape = KS.SweepShape(batch=max(1, TABLE_TOKENS // n), heads=TABLE_HEADS, head_dim=128)
        left = budget_s - (time.perf_counter() - t0)
        recs += KS.run_sweep(list(kernels), [n], device=device, results_root=out, experiment="sdpa_profile",
                             shape=shape, warmup=warmup, repeats=repeats, budget_s=max(0.0, left))
    return recs


def efficiency(records: list[dict], peak: float) -> dict:
    """{kernel: {"full"/"causal": {"forward"/"fwd_bwd": [[N, TFLOP/s / peak], ...]}}} of the ok records."""
    out: dict = {}
    for r in sorted((r for r in records if r["status"] == "ok"), key=lambda r: r["seqlen"]):
        mask = "causal" if r["causal"] else "full"
        out.setdefault(r["method"], {}).setdefault(mask, {}).setdefault(r["mode"], []).append(
            [r["seqlen"], round(r["tflops_total"] / peak, 3)])
    return out


def gemm_table(device: torch.device, *, budget_s: float, peak: float) -> dict:
    """Every GEMM row, the best shape and its efficiency over ``peak`` (``gemm.json``)."""
    rows = GS.run_gemms(device, budget_s=budget_s)
    top = GS.best(rows)
    return {"rows": rows, "best": top, "peak_tflops": peak,
            "gemm_efficiency": round(top["tflops"] / peak, 3) if top else None,
            "layer_efficiency": {r["name"] + f"/T{r['m']}": round(r["tflops"] / peak, 3)
                                 for r in rows if r["kind"] == "layer"}}


def modelled_decode(row: dict, profile: str = PROFILE) -> float:
    """Seconds the model charges one decode row (``perfmodel.decode_costs``: per sequence, x batch)."""
    cost = DecodeCosts(load_hardware(profile), row["dtype"])
    t, _ = cost.decode_attention(row["q"], row["context"], row["heads"], row["kv_heads"], row["head_dim"])
    return row["batch"] * t


def decode_table(device: torch.device, *, budget_s: float, profile: str = PROFILE, **sweep) -> dict:
    """Every decode row with the model's time beside it, and the copy ceiling, as fractions of the
    profile's nominal HBM rate (``decode.json``); ``sweep``: ``decode_sweep.run_decode``'s options."""
    rows = DS.run_decode(device, budget_s=budget_s, **sweep)
    hbm = load_hardware(profile).accelerator.hbm_gbytes_s
    for r in rows:
        r["hbm_fraction"] = round(r["gbytes_s"] / hbm, 3) if r["status"] == "ok" else None
        if r["kernel"] != "copy" and r["status"] == "ok":
            r["modelled_s"] = modelled_decode(r, profile)
            r["measured_over_modelled"] = round(r["time_median_s"] / r["modelled_s"], 3)
    return {"profile": profile, "hbm_gbytes_s": hbm, "rows": rows}
