"""Model-level modelled experiments: records, figures and tables of whole-model steps (``model_level.py``).

* every paper spec with a model (``model_level.SPEC_MODELS``) -> ``<spec>_model_level``: BA Tables 2/3
  (prefill latency of the whole model), Fig. 2/3/4a/4b (training step of the whole model), the
  double-ring spec at model level;
* ``burstengine_scaling_14b_model_level``: BurstEngine's scaling/MFU, 14B, 1..32 GPUs at 32K x G tokens,
  with sequence-level checkpointing (``checkpoint="seq"``) as their runs;
* model-level specs that are no attention spec's twin (``write_model_spec``): BurstEngine's main table
  (``model_burstengine_main_*``) and its ablation (``model_burstengine_ablation_14b_1m``, one row per
  cumulative variant), each case with its spec's loss, checkpoint mode and weights.

Written to ``results/modelled/<name>/results.jsonl`` and ``plots/modelled/<name>/`` (figures by
experiments.plots, ``*_modelled.png``; ``table_modelled.md``), "MODELLED" in every title. The
attention-only TFLOP/s benchmark needs no model: it is ``burstengine_attn_tflops_32gpu`` (op level).
Masks: a model-level spec's ``mask`` and ``layout`` axes (BurstEngine's sparse training,
``model_burstengine_sparse_train_*``) reach the attention schedule through the case's shape (each rank's
live tiles of the mask on the layout, ``burst_impl.plan``) and the FLOPs (the mask's area); every record
carries the layout's work per rank under the mask (``balance_report``: max/mean over ranks).

Memory per rank (``model_level.model_memory``): the BurstAttention paper's specs hold replicated weights
(TP: 1/G), BurstEngine's cases FSDP2 (ZeRO-3 over the ranks, docs/papers.md §4); a case over the
accelerator's HBM is "oom" (figures mark it, tables print "OOM" with the time it would take).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import yaml

from baselines import AttnShape, get
from burst_impl.balance import balance_report
from burst_impl.model.checkpoint import method_mode

from ..profiles.hardware import load_hardware
from ..harness import record
from ..harness.model_record import OFFLOAD
from ..harness.spec import Case, Spec, load_spec, resolve_spec_path
from .model_level import ASSUMPTIONS, SPEC_MODELS, SPEC_PREFILL_HEAD, model_record, predict_model, with_layer_level
from .peer_memory import implementation_of
from .predict import VARIANTS_FILE, _record, experiment_name, spec_hardware
from .schedules import VARIANTS
from .. import plots
from .tables import write_model_table

SUFFIX = "_model_level"
BE_HARDWARE = "a800_ib_4x8"         # BurstEngine's cluster: 4 x 8 A800 + InfiniBand
BE_MODEL = "burstengine_14b"
SCALING_WORLD_SIZES = (1, 2, 4, 8, 16, 32)      # BurstEngine's scaling runs, 32K tokens per GPU
SCALING_METHODS = ("burst_double_ring", "burst", "usp")
def _case(exp: str, method: str, shape: AttnShape, mode: str) -> Case:
    return Case(experiment=exp, method=method, level="layer", mode=mode, shape=shape, warmup=0, repeats=0, seed=0)


def _records(exp: str, items, hw) -> list[dict]:
    """``items``: (case, model config, ``predict_model`` keywords, extra fields) -> model-level records."""
    out = []
    for case, cfg, kw, extra in items:
        # the peer implementation the spec's row ran (peer_memory.RUNS): its memory; None: the suite's own
        impl = implementation_of(case.experiment, case.variant or case.method)
        mp = predict_model(case.method, cfg, case.shape, mode=case.mode, hardware=hw, implementation=impl, **kw)
        rec = model_record(_record(case, mp.attention, exp), mp, exp)
        rec.update(extra)
        if impl is not None and mp.mode == "fwd_bwd":
            rec["offload"] = mp.memory["offload"]
        out.append(rec)
    return out


def _write(exp: str, records: list[dict], meta: dict, results_root: Path, plots_root: Path, draw: bool,
           hw, variants: list[dict] = ()) -> list[Path]:
    out = results_root / exp
    record.write_all(out / "results.jsonl", records)
    if variants:                      # model-only variants: the tables, not the figures (as at attention level)
        record.write_all(out / VARIANTS_FILE, list(variants))
    (out / "spec.resolved.yaml").write_text(yaml.safe_dump({**meta, "name": exp, "source": "modelled",
                                                            "level": "model", "hardware_profile": hw.name},
                                                           sort_keys=False))
    files = [out / "results.jsonl", out / "spec.resolved.yaml"]
    if draw:
        files.extend(plots.draw_experiment(results_root, plots_root, exp))
    files.append(write_model_table(exp, meta, hw, records + list(variants), plots_root / exp))
    return files


def twin_zero(spec: Spec) -> dict[str, tuple[bool, ...]]:
    """Method -> the ``zero`` settings (False first) that the model-level spec ``model_<spec>`` runs it with,
    where that spec is ``spec``'s twin (``twin``); {} where there is none. Its ``zero: [false, true]`` and
    ``exclude`` say which rows the paper has (Fig. 3: Burst with and without ZeRO, TP-V3 without)."""
    try:
        other = load_spec(resolve_spec_path("model_" + spec.name))
    except ValueError:
        return {}
    if twin(other) != spec.name:
        return {}
    zeros: dict[str, set] = {}
    for c in other.cases():
        if c.mode == "train":
            zeros.setdefault(c.method, set()).add(c.zero)
    return {m: tuple(sorted(z)) for m, z in zeros.items()}


def _zero_items(case: Case, cfg: str, zeros: dict[str, tuple[bool, ...]]) -> list[tuple]:
    """One item per ``zero`` setting of the case's method (replicated weights, TP: 1/G, when it has none):
    ``zero: true`` is FSDP2 (ZeRO-3) over the G sequence-parallel ranks, as the BurstEngine specs run it."""
    settings = zeros.get(case.method, (False,)) if case.mode == "fwd_bwd" else (False,)
    return [(case, cfg, {"weights": "fsdp2"} if z else {}, {"zero_stage": 3} if z else {}) for z in settings]


def write_spec_model_level(spec: Spec, *, hardware: str | None = None, results_root: Path, plots_root: Path,
                           draw: bool = True) -> list[Path]:
    if spec.name not in SPEC_MODELS:
        return []
    hw = spec_hardware(spec, hardware)
    cfg = SPEC_MODELS[spec.name]
    exp = spec.name + SUFFIX + ("" if not hardware else f"__{hw.name}")
    mode_ok = [c for c in spec.cases() if c.mode in ("forward", "fwd_bwd")]
    zeros = twin_zero(spec)
    # weights replicated (TP: 1/G), as theirs; and FSDP2 where the model-level twin asks for zero: true
    items = [it for c in mode_ok for it in _zero_items(with_layer_level(c), cfg, zeros)]
    extra = [(dataclasses.replace(c, method=name), cfg, {}, {"variant_of": base})
             for c, _, kw, _ in items if not kw for name, (base, _, _) in VARIANTS.items() if base == c.method]
    if spec.name in SPEC_PREFILL_HEAD:     # the paper's timed LM head (model_level.SPEC_PREFILL_HEAD)
        items, extra = ([(c, m, {**kw, "head": SPEC_PREFILL_HEAD[spec.name]} if c.mode == "forward" else kw, x)
                         for c, m, kw, x in lst] for lst in (items, extra))
    variants = _records(exp, extra, hw)
    for r in variants:
        r["config"] = {**r["config"], "variant_of": r["variant_of"]}
    methods = list(spec.methods) + [v for v in VARIANTS if any(r["method"] == v for r in variants)]
    meta = {"paper_ref": spec.paper_ref, "description": f"{spec.description} — whole {cfg} model",
            "baseline": spec.baseline, "methods": methods, "model": cfg}
    records = _records(exp, items, hw)
    for r in records:
        if r["zero"]:            # an attention case has no ".zero" in its id; a measured model-level case has
            r["case_id"] += ".zero"
            r["config"] = {**r["config"], "zero": True}
    return _write(exp, records, meta, results_root, plots_root, draw, hw, variants)


def write_burstengine(*, results_root: Path, plots_root: Path, draw: bool = True) -> list[Path]:
    hw = load_hardware(BE_HARDWARE)
    files = []
    # scaling: 1..32 GPUs at 32K tokens per GPU (BurstEngine's scaling runs), MFU. Their end-to-end runs
    # checkpoint (docs/papers.md §4): without it 14B keeps ~260 GiB of activations per rank at 32K tokens (OOM).
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
    return files


def _setup_fields(case: Case) -> dict:
    """What each modelled record of a model-level spec says about its training setup (as measured ones)."""
    # "checkpoint" (model_record) is the mode as run; the spec's request next to it, as measured records have
    s = case.shape
    return {"offload": OFFLOAD, "zero_stage": 3 if case.zero else 0, "variant_label": case.variant_label,
            "checkpoint_requested": case.checkpoint,
            "checkpoint_effective": method_mode(get(case.method), case.checkpoint),
            # the attention's work per rank under the case's mask and layout (as measured records have it)
            **balance_report(s.attn_mask, s.resolved_layout, s.seqlen, s.world_size)}


def model_spec_records(spec: Spec, hw, exp: str) -> list[dict]:
    """One record per case of a model-level spec (``measure.level: model``, train and prefill modes): its
    method's whole-model step with the case's weights (``zero``: FSDP2 = ZeRO-3, else replicated; TP: its
    own 1/G), loss and checkpoint mode. A cumulative spec's rows (an ablation) carry ``ablation_step``."""
    steps = {v.name: i for i, v in enumerate(spec.model.variants)} if spec.model.cumulative else {}
    items = []
    for c in spec.cases():
        if c.mode not in ("train", "prefill"):           # perplexity is a measurement, not a time
            continue
        layer = dataclasses.replace(c, level="layer", mode="fwd_bwd" if c.mode == "train" else "forward")
        kw = {"weights": "fsdp2" if c.zero else None, "checkpoint": c.checkpoint, "loss": c.loss}
        extra = _setup_fields(c)
        if c.variant in steps:
            extra.update(ablation_step=steps[c.variant], ablation_label=c.variant_label)
        items.append((layer, c.model, kw, extra))
    return _records(exp, items, hw)


def write_model_spec(spec: Spec, *, hardware: str | None = None, results_root: Path, plots_root: Path,
                     draw: bool = True) -> list[Path]:
    """``make model`` for a model-level spec that is not the twin of a modelled attention spec (``twin``):
    BurstEngine's main table and its ablation. Written to ``results/modelled/<spec>/``."""
    hw = spec_hardware(spec, hardware)
    exp = experiment_name(spec, hw, hardware)
    recs = model_spec_records(spec, hw, exp)
    rows = [v.name for v in spec.model.variants] or list(spec.methods)
    meta = {"paper_ref": spec.paper_ref, "description": spec.description, "baseline": spec.baseline,
            "methods": rows, "model": spec.model.name,
            "rows": [{"name": v.name, "label": v.label, "method": v.method, "loss": v.loss, "checkpoint": v.checkpoint}
                     for v in spec.model.variants]}
    return _write(exp, recs, meta, results_root, plots_root, draw, hw)


def twin(spec: Spec) -> str | None:
    """The attention-level spec whose ``<spec>_model_level`` already models this model-level spec, if any
    (``model_fig2_train_7b_8gpu`` is ``fig2_train_7b_8gpu``'s whole model)."""
    name = spec.name.removeprefix("model_")
    return name if name != spec.name and name in SPEC_MODELS else None


__all__ = ["ASSUMPTIONS", "model_spec_records", "twin", "twin_zero", "write_model_spec", "write_spec_model_level",
           "write_burstengine"]
