"""The memory model against CUDA's counters: one attention call and one model step, on one GPU.

``make gpu-check``'s ``memory`` step runs ``specs()`` through the runner at world size 1 (the
records carry ``mem_allocated_peak_bytes`` and ``mem_reserved_peak_bytes``: the allocator's whole
``max_memory_allocated`` / ``max_memory_reserved`` over one step, ``experiments/harness/memory.py``),
then ``compare`` sets each record beside the suite's one memory formula for it:

* op level: ``perfmodel.memory.peak_memory`` through ``predict_case`` (inputs + the registry
  method's kept bytes + the schedule's largest transient set);
* model level: ``perfmodel.model_level.model_memory`` through ``predict_model`` (weights, gradients,
  optimizer state, activations, logits and the attention's transient buffers at the step's largest
  moment).

The hardware profile only sets the capacity verdict; the bytes do not depend on it.
"""
from __future__ import annotations

from pathlib import Path

from .harness import results as R
from .harness.case import Case
from .perfmodel.model import predict_case
from .perfmodel.model_level import predict_model

HARDWARE = "h200_sxm_ib_4x8"
MODEL = "llama2_7b_2l"      # LLaMA-2 7B's layers, 2 of them (burst_impl/model/config.py)
GIB = 2 ** 30


def specs() -> list[dict]:
    """One attention call (burst on PyTorch's CUDA kernel, forward + backward) and one training step."""
    common = {"cluster": "local", "warmup": 2, "repeats": 5, "seed": 0, "timeouts": {"case_s": 120, "pg_s": 120},
              "description": "make gpu-check's memory step (experiments/gpu_memory.py)"}
    op = {"name": "memory_op", "methods": ["burst"], "kernels": ["cuda_sdpa"],
          "sweep": {"seqlen": [8192, 32768], "world_size": 1, "heads": 32, "kv_heads": [32, 8], "head_dim": 128,
                    "dtype": "bfloat16", "causal": True},
          "measure": {"modes": ["fwd_bwd"], "level": "op", "memory": True, "comm": False}, **common}
    model = {"name": "memory_model", "methods": ["burst"],
             "sweep": {"seqlen": [4096, 16384], "world_size": 1, "batch": 1, "dtype": "bfloat16", "causal": True},
             "measure": {"modes": ["train"], "level": "model", "memory": True},
             "model": {"name": MODEL, "optimizer": "adamw"}, **common}
    return [op, model]


def modelled(rec: dict, hardware: str = HARDWARE) -> dict:
    """The memory formula's parts for the case of a measured record (bytes)."""
    case = Case.from_dict(rec["config"])
    if case.level == "model":
        mp = predict_model(case.method, case.model, case.shape, mode="fwd_bwd", hardware=hardware,
                           checkpoint=case.checkpoint, loss=case.loss)
        return {"total_bytes": mp.memory["total_bytes"], "parts": mp.memory["parts"]}
    pred = predict_case(case.method, case.shape, mode=case.mode, level="op", hardware=hardware)
    m = pred.memory
    return {"total_bytes": m["total_bytes"], "parts": {"inputs": m["inputs_bytes"], "kept": m["kept_bytes"],
                                                       "transient": m["transient_bytes"]}}


def compare(records: list[dict], hardware: str = HARDWARE) -> list[dict]:
    """One row per ok GPU record: the measured peak (the suite's one definition, ``mem_peak_bytes``: the
    step's inputs and weights plus the allocator's peak increase over the step), the model's total, and
    CUDA's whole counters beside them (``max_memory_allocated`` / ``max_memory_reserved``, which also
    hold whatever the worker kept from the cases before, so only a process's first case reads clean)."""
    rows = []
    for r in records:
        if r["status"] != "ok" or r.get("mem_allocated_peak_bytes") is None:
            continue
        m = modelled(r, hardware)
        peak, total = r["mem_peak_bytes"], m["total_bytes"]
        rows.append({"case_id": r["case_id"], "level": r["level"], "seqlen": r["seqlen"], "kv_heads": r["kv_heads"],
                     "peak_gib": peak / GIB, "model_gib": total / GIB, "error": total / peak - 1,
                     "allocated_whole_gib": r["mem_allocated_peak_bytes"] / GIB,
                     "reserved_whole_gib": r["mem_reserved_peak_bytes"] / GIB,
                     "saved_gib": (r.get("mem_saved_bytes") or 0) / GIB,
                     "model_kept_gib": m["parts"]["kept"] / GIB if "kept" in m["parts"] else None,
                     "model_parts_gib": {k: v / GIB for k, v in m["parts"].items()}})
    return rows


def read(root: Path) -> list[dict]:
    """The latest record of every case of ``specs()`` under ``root``."""
    out = []
    for s in specs():
        out += R.latest_by_case(R.read_records(R.experiment_dir(root, s["name"]) / R.RESULTS_FILE)).values()
    return out


def table(rows: list[dict]) -> str:
    head = f"{'case':<58} {'peak GiB':>8} {'model GiB':>9} {'error':>7} {'alloc*':>7} {'resv*':>7}"
    lines = [head] + [f"{r['case_id'][:58]:<58} {r['peak_gib']:8.2f} {r['model_gib']:9.2f} {r['error']:+7.1%} "
                      f"{r['allocated_whole_gib']:7.2f} {r['reserved_whole_gib']:7.2f}" for r in rows]
    return "\n".join(lines + ["* CUDA's whole counters over the step (GiB), earlier cases' leftovers included"])
