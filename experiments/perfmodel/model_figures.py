"""Model-level modelled experiments: records, figures and tables of whole-model steps (``model_level.py``).

* every paper spec with a model (``model_level.SPEC_MODELS``) -> ``<spec>_model_level``: BA Tables 2/3
  (prefill latency of the whole model), Fig. 2/3/4a/4b (training step of the whole model), the
  double-ring spec at model level;
* ``burstengine_scaling_14b_model_level``: BurstEngine's scaling/MFU, 14B, 1..32 GPUs at 32K x G tokens,
  with sequence-level checkpointing (``checkpoint="seq"``) as their runs;
* ``burstengine_ablation_14b_1m_model_level``: BurstEngine's ablation, 14B, 1M tokens, 32 GPUs.

Written to ``results/modelled/<name>/results.jsonl`` and ``plots/modelled/<name>/`` (figures by
experiments.plots, ``*_modelled.png``; ``table_modelled.md``), "MODELLED" in every title. The
attention-only TFLOP/s benchmark needs no model: it is ``burstengine_attn_tflops_32gpu`` (op level).
Sparse masks: no sparse mask exists in the suite yet (causal and full only), so their figure is not made.

Memory per rank (``model_level.model_memory``): the BurstAttention paper's specs hold replicated weights
(TP: 1/G), BurstEngine's cases FSDP2 (ZeRO-3 over the ranks, PAPER.md §4); a case over the
accelerator's HBM is "oom" (figures mark it, tables print "OOM" with the time it would take).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import yaml

from baselines import AttnShape

from ..profiles.hardware import load_hardware
from ..harness.spec import Case, Spec
from .model_level import ASSUMPTIONS, SPEC_MODELS, model_record, predict_model, with_layer_level
from .predict import VARIANTS_FILE, _record, _write_jsonl, spec_hardware
from .schedules import VARIANTS
from .. import plots
from .tables import write_model_table

SUFFIX = "_model_level"
BE_HARDWARE = "a800_ib_4x8"         # BurstEngine's cluster: 4 x 8 A800 + InfiniBand
BE_MODEL = "burstengine_14b"
SCALING_WORLD_SIZES = (1, 2, 4, 8, 16, 32)      # BurstEngine's scaling runs, 32K tokens per GPU
SCALING_METHODS = ("burst_double_ring", "burst", "usp")
# (label, method, checkpoint, loss): each row adds one of the ablation's steps (PAPER.md §3 BurstEngine), as
# experiments.benches.ablation.STEPS runs them: weights FSDP2 (ZeRO-3), full-block checkpointing in every row
# before the last (14B at 1M keeps ~260 GiB of activations per rank without it), then sequence-level
# checkpointing, which caches half the attention outputs (more memory than full) to recompute 1/4 of
# the causal attention (less time).
ABLATION = (
    ("RingAttention backward (K/V ring)", "ring", "full", "unfused"),
    ("+ backward communication optimisation (Q ring)", "burst", "full", "unfused"),
    ("+ topology-aware double ring", "burst_double_ring", "full", "unfused"),
    ("+ fused LM head (fused loss: logits never stored; gradients in the forward, no extra head GEMM)",
     "burst_double_ring", "full", "fused"),
    ("+ sequence-level checkpointing (half the attention outputs cached: the recompute runs attention on "
     "the first half only)", "burst_double_ring", "seq", "fused"),
)
ABLATION_SHAPE = AttnShape(batch=1, seqlen=1 << 20, heads=40, kv_heads=40, head_dim=128, world_size=32,
                           dtype="bfloat16", causal=True, layout="zigzag")


def _case(exp: str, method: str, shape: AttnShape, mode: str) -> Case:
    return Case(experiment=exp, method=method, level="layer", mode=mode, shape=shape, warmup=0, repeats=0, seed=0)


def _records(exp: str, items, hw) -> list[dict]:
    """``items``: (case, model config, ``predict_model`` keywords, extra fields) -> model-level records."""
    out = []
    for case, cfg, kw, extra in items:
        mp = predict_model(case.method, cfg, case.shape, mode=case.mode, hardware=hw, **kw)
        rec = model_record(_record(case, mp.attention, exp), mp, exp)
        rec.update(extra)
        out.append(rec)
    return out


def _write(exp: str, records: list[dict], meta: dict, results_root: Path, plots_root: Path, draw: bool,
           hw, variants: list[dict] = ()) -> list[Path]:
    out = results_root / exp
    _write_jsonl(out / "results.jsonl", records)
    if variants:                      # model-only variants: the tables, not the figures (as at attention level)
        _write_jsonl(out / VARIANTS_FILE, list(variants))
    (out / "spec.resolved.yaml").write_text(yaml.safe_dump({**meta, "name": exp, "source": "modelled",
                                                            "level": "model", "hardware_profile": hw.name},
                                                           sort_keys=False))
    files = [out / "results.jsonl", out / "spec.resolved.yaml"]
    if draw:
        files.extend(plots.draw_experiment(results_root, plots_root, exp))
    files.append(write_model_table(exp, meta, hw, records + list(variants), plots_root / exp))
    return files


def write_spec_model_level(spec: Spec, *, hardware: str | None = None, results_root: Path, plots_root: Path,
                           draw: bool = True) -> list[Path]:
    if spec.name not in SPEC_MODELS:
        return []
    hw = spec_hardware(spec, hardware)
    cfg = SPEC_MODELS[spec.name]
    exp = spec.name + SUFFIX + ("" if not hardware else f"__{hw.name}")
    mode_ok = [c for c in spec.cases() if c.mode in ("forward", "fwd_bwd")]
    items = [(with_layer_level(c), cfg, {}, {}) for c in mode_ok]       # weights replicated (TP: 1/G), as theirs
    extra = [(dataclasses.replace(c, method=name), cfg, {}, {"variant_of": base})
             for c, *_ in items for name, (base, _, _) in VARIANTS.items() if base == c.method]
    variants = _records(exp, extra, hw)
    for r in variants:
        r["config"] = {**r["config"], "variant_of": r["variant_of"]}
    methods = list(spec.methods) + [v for v in VARIANTS if any(r["method"] == v for r in variants)]
    meta = {"paper_ref": spec.paper_ref, "description": f"{spec.description} — whole {cfg} model",
            "baseline": spec.baseline, "methods": methods, "model": cfg}
    return _write(exp, _records(exp, items, hw), meta, results_root, plots_root, draw, hw, variants)


def write_burstengine(*, results_root: Path, plots_root: Path, draw: bool = True) -> list[Path]:
    hw = load_hardware(BE_HARDWARE)
    files = []
    # scaling: 1..32 GPUs at 32K tokens per GPU (BurstEngine's scaling runs), MFU. Their end-to-end runs
    # checkpoint (PAPER.md §4): without it 14B keeps ~260 GiB of activations per rank at 32K tokens (OOM).
    exp = "burstengine_scaling_14b" + SUFFIX
    items = []
    for g in SCALING_WORLD_SIZES:
        shape = AttnShape(batch=1, seqlen=32768 * g, heads=40, kv_heads=40, head_dim=128, world_size=g,
                          dtype="bfloat16", causal=True, layout="zigzag")
        for m in SCALING_METHODS:
            items.append((_case(exp, m, shape, "fwd_bwd"), BE_MODEL, {"weights": "fsdp2", "checkpoint": "seq"}, {}))
    meta = {"paper_ref": "BurstEngine scaling (MFU)", "baseline": "burst",
            "description": "14B training step, 1..32 x A800 at 32K tokens per GPU, FSDP2, sequence-level "
                           "checkpointing (usp: full) — whole model",
            "methods": list(SCALING_METHODS), "model": BE_MODEL}
    files += _write(exp, _records(exp, items, hw), meta, results_root, plots_root, draw, hw)
    # ablation: 14B, 1M tokens, 32 GPUs, one row per step
    exp = "burstengine_ablation_14b_1m" + SUFFIX
    meta = {"paper_ref": "BurstEngine ablation", "baseline": "ring", "model": BE_MODEL,
            "description": "14B training step, 1M tokens, 32 x A800 — whole model, one row per ablation step",
            "methods": sorted({row[1] for row in ABLATION})}
    recs = ablation_records(exp, hw)
    files += _write(exp, recs, meta, results_root, plots_root, False, hw)
    return files


def ablation_records(exp: str, hw, shape: AttnShape = ABLATION_SHAPE) -> list[dict]:
    """One model-level record per row of ``ABLATION`` (FSDP2 weights), ``ablation_step`` in its case id."""
    items = [(_case(exp, m, shape, "fwd_bwd"), BE_MODEL, {"checkpoint": ck, "loss": loss, "weights": "fsdp2"},
              {"ablation_step": i, "ablation_label": label}) for i, (label, m, ck, loss) in enumerate(ABLATION)]
    recs = _records(exp, items, hw)
    for r in recs:            # one record per step: the step number keeps case ids apart
        r["case_id"] += f".step{r['ablation_step']}"
    return recs


__all__ = ["ASSUMPTIONS", "ablation_records", "write_spec_model_level", "write_burstengine"]
