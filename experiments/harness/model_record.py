"""The fields of a model-level record (``measure.level: model``), next to the common ones.

Throughput: ``tokens_per_s`` (global batch tokens B*N per step time) and
``tokens_per_s_per_rank`` (/ G, the papers' "tokens/s per GPU").

FLOPs and MFU: ``burst_impl.model.flops.model_flops``, stated in every record
(``flops_convention``): 6 x matmul parameters x tokens for training (2x for
prefill, whose LM head runs on the last token only) plus the attention FLOPs
of the suite's formula, causal halved, recomputation not counted.
``mfu`` = model FLOP/s / (G x peak dense FLOP/s of the accelerator in the
case's dtype), with the peak from the cluster profile's hardware
(``experiments/hardware``); only on a GPU of that profile. On CPU (and the
emulated cluster, whose CPUs stand in for GPUs) it is None and
``mfu_peak_source`` says why; ``tflops_per_rank`` is the model TFLOP/s per rank.

Bytes: measured by the counted collectives over one step (max over ranks;
FSDP2's own collectives are not counted, their bytes are a formula), the
formula per step (``comm_formula_by_kind``: layers x per-layer closed form,
gradient all-reduce, FSDP2), and per layer: ``comm_layer_bytes`` (measured
bytes of the per-layer kinds / layers) next to ``comm_layer_formula_bytes``.
"""
from __future__ import annotations

import re

import torch

from baselines.registry import get
from burst_impl.balance import balance_report
from burst_impl.model.checkpoint import method_mode
from burst_impl.model.flops import model_flops
from burst_impl.model.config import num_params

from . import results as R
from burst_impl.flops import tflops_per_s, tokens_per_s
from .model_parity import parity_fields
from .model_steps import ModelRun, layer_bytes
from .spec import Case
from ..profiles.cluster import load_profile
from ..profiles.hardware import known_hardware, load_hardware

FLOPS_CONVENTION = ("6 x matmul params x tokens (train; prefill 2x, LM head on the last token) + attention "
                    "4BN^2Zd per layer forward, causal halved (a mask: 4BZd x its live entries), x3.5 "
                    "forward+backward; recomputation not counted")


def _by_gpu_name(dtype: str, device: torch.device) -> tuple[float | None, str]:
    """The peak of the hardware profiles whose accelerator is this GPU's model (A100, H100, ...), when
    they agree on it (SXM and PCIe parts of one model may not: then no MFU)."""
    gpu = torch.cuda.get_device_name(device)
    model = next((w for w in re.split(r"[\s-]+", gpu) if re.fullmatch(r"[A-Z]+\d{2,4}[A-Z]?", w)), None)
    peaks = {}
    for name in known_hardware():
        acc = load_hardware(name).accelerator
        if model and model in acc.name.split() and dtype in acc.peak_tflops:
            peaks[acc.peak_tflops[dtype]] = acc.name
    if len(peaks) != 1:
        return None, f"no MFU: no single hardware-profile peak for GPU {gpu!r} in {dtype} ({peaks or 'none'})"
    (peak, acc_name), = peaks.items()
    return peak * 1e12, f"{acc_name} {dtype} dense peak (matched by GPU name {gpu!r})"


def peak_flops(dtype: str, device: torch.device) -> tuple[float | None, str]:
    """(peak dense FLOP/s of one device in ``dtype``, where it comes from) for MFU: the cluster profile's
    hardware profile when the run names one, else the hardware profiles matching this GPU's name."""
    if device.type != "cuda":
        return None, "no MFU on CPU: no published peak for this CPU (model TFLOP/s per rank recorded)"
    name = R.cluster_info(1).get("profile")
    try:
        hw = load_profile(name).hardware if name else None
        acc = load_hardware(hw).accelerator if hw else None
    except ValueError:
        acc = None
    if acc is None or dtype not in acc.peak_tflops:
        return _by_gpu_name(dtype, device)
    return acc.peak_tflops[dtype] * 1e12, f"{acc.name} {dtype} dense peak (hardware profile {hw})"


OFFLOAD = "none (the suite implements no activation or optimizer offload)"


def training_setup(case: Case, cfg) -> dict:
    """What a model-level record says about its training setup: loss and checkpoint mode (the one the
    blocks run: seq/whole fall back to full for methods without the operator's backward), ZeRO stage
    (3: FSDP2 over the sequence group; TP shards its own weights) and offload."""
    ck = method_mode(get(case.method), case.checkpoint)
    return {"loss": cfg.loss, "checkpoint": case.checkpoint, "checkpoint_effective": ck,
            "zero_stage": 3 if case.zero else 0, "offload": OFFLOAD}


def _kinds_total(counts: dict[str, int], keys) -> int:
    return sum(counts.get(f"{p}/{k}", 0) for p, k in keys)


def model_fields(case: Case, run: ModelRun, median_s: float, per_rank: list[dict], device: torch.device) -> dict:
    s, cfg, G = case.shape, run.cfg, case.world_size
    mode = "train" if case.mode == "train" else "prefill"
    f = model_flops(cfg, s.batch, s.seqlen, mode=mode, causal=s.causal)
    peak, source = peak_flops(s.dtype, device)
    out = {
        "model": case.model,
        "zero": case.zero,
        "model_params": num_params(cfg),
        "flops": f["total"],
        "flops_matmul": f["matmul"],
        "flops_attention": f["attention"],
        "flops_convention": FLOPS_CONVENTION,
        "tflops_total": tflops_per_s(f["total"], median_s),
        "tflops_per_rank": tflops_per_s(f["total"], median_s) / G,
        "tokens_per_s": tokens_per_s(s.batch, s.seqlen, median_s),
        "tokens_per_s_per_rank": tokens_per_s(s.batch, s.seqlen, median_s) / G,
        "mfu": f["total"] / median_s / (G * peak) if peak and median_s > 0 else None,
        "mfu_peak_flops": peak,
        "mfu_peak_source": source,
        "weights": "fsdp2" if case.zero else ("tensor_parallel" if case.method.startswith("tp_") else "replicated"),
        **training_setup(case, run.cfg),
        "losses": [float(x) for x in run.losses],
        **parity_fields(case, run, device),       # model.loss_parity: against the unsharded model's losses
        # the attention's work per rank under the case's mask and layout (as op-level records have it)
        **balance_report(s.attn_mask, s.resolved_layout, s.seqlen, G),
    }
    states = [r.get("state_bytes") for r in per_rank]
    if all(x is not None for x in states):
        out["mem_state_bytes_per_rank"] = states
    per_layer = layer_bytes(case, cfg)
    if case.mode != "train":
        per_layer = {k: v for k, v in per_layer.items() if k[0] == "forward"}
    out["comm_layer_formula_by_kind"] = {f"{p}/{k}": int(v) for (p, k), v in sorted(per_layer.items())}
    out["comm_layer_formula_bytes"] = int(sum(per_layer.values()))
    if case.measure_comm and per_rank[0].get("comm") is not None:
        formula = run.comm_formula(case)
        fsdp = {k for _, k in run.fsdp_bytes()}
        out.update({
            "comm_fwd_bytes": max(r["comm_fwd"] for r in per_rank),
            "comm_bwd_bytes": max(r["comm_bwd"] for r in per_rank) if case.mode == "train" else None,
            "comm_bytes_by_kind": per_rank[0]["comm"],
            "comm_formula_by_kind": {f"{p}/{k}": int(v) for (p, k), v in sorted(formula.items())},
            # formula of what the counters see (FSDP2's collectives apart: comm_fsdp_formula_bytes)
            "comm_fwd_formula_bytes": int(sum(v for (p, k), v in formula.items() if p == "forward" and k not in fsdp)),
            "comm_bwd_formula_bytes": int(sum(v for (p, k), v in formula.items() if p == "backward" and k not in fsdp)),
            "comm_fsdp_formula_bytes": int(sum(v for (p, k), v in formula.items() if k in fsdp)),
            # measured bytes of the per-layer kinds, per layer (max over ranks)
            "comm_layer_bytes": max(_kinds_total(r["comm"], per_layer) for r in per_rank) / cfg.n_layers,
            "comm_not_counted": ("FSDP2 all-gathers and reduce-scatters run inside torch (formula only: "
                                 "comm_formula_by_kind fsdp.*)") if case.zero else "",
            "comm_notes": per_rank[0]["notes"],
            "comm_measured_over": "prefill" if case.mode == "prefill" else "train step",
        })
    return out
