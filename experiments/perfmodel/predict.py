"""A spec -> one modelled record per case, in the measured records' schema (``"source": "modelled"``).

    from experiments.perfmodel.predict import predict_spec, write_experiment
    exp, records, variant_records = predict_spec(load_spec(...))          # hardware: the target's
    write_experiment(spec, results_root="results/modelled", plots_root="plots/modelled")

Records carry what measured ones carry where it has a meaning (the resolved
case, git state, the FLOPs and TFLOP/s of the suite's convention, bytes per
rank next to the registry formula, peak memory per rank), plus the hardware
profile by name and its numbers, the model's breakdown (critical path,
busy time per resource class) and the assumptions. ``time_median_s`` is the
predicted time (a model has no spread; ``time_samples_s`` stays empty), None
for a case the model says runs out of memory (``time_model_s`` keeps what it
would take). The model is deterministic, so a run rewrites the files.

The paper's "TP without FlashAttention" and "Burst without LAO" are not
registry methods; where a spec has their base method they are modelled as
variants and written to ``variants.jsonl`` and the tables, not to the figures.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import yaml

from ..profiles.hardware import Hardware, known_hardware, load_hardware
from ..profiles.cluster import emulated_target, known_profiles, load_profile
from ..harness import record, results as R
from ..harness.env import REPO
from burst_impl.flops import case_flops, tflops_per_s, tokens_per_s
from ..harness.spec import Case, Spec
from .model import ASSUMPTIONS, Prediction, predict_case
from .memory import peer_prediction
from .placement import Placement
from .schedules import VARIANTS
from ..harness.env import repo_relative
from . import tables
from .. import plots

RESULTS_ROOT = REPO / "results" / "modelled"
PLOTS_ROOT = REPO / "plots" / "modelled"
VARIANTS_FILE = "variants.jsonl"


def spec_hardware(spec: Spec, override: str | None = None) -> Hardware:
    """The hardware profile a spec is modelled on: ``override`` (a hardware profile, or an emulated cluster
    profile: the hardware it emulates at its shape and NICs, ``emulated_target``), else its target's
    ``hardware:`` (an emulated target's at the emulated shape)."""
    if override:
        if override not in known_hardware() and override in known_profiles():
            return emulated_target(load_profile(override))
        return load_hardware(override)
    if spec.profile.scheduler == "emulated":
        return emulated_target(spec.profile)
    name = load_profile(spec.cluster).hardware
    if not name:
        raise ValueError(f"{spec.path}: cluster {spec.cluster!r} names no hardware profile (key 'hardware'); "
                         "pass hardware= (--hardware) to model it")
    return load_hardware(name)


def experiment_name(spec: Spec, hw: Hardware, override: str | None) -> str:
    """The spec's name on its own hardware; ``<spec>__<hardware>`` when another profile is asked for."""
    own = load_profile(spec.cluster).hardware
    return spec.name if not override or override in (own, spec.cluster) else f"{spec.name}__{hw.name}"


def hardware_record(hw: Hardware, world_size: int) -> dict:
    place = Placement.of(hw, world_size)

    def link(lk):
        return None if lk is None else dataclasses.asdict(lk)

    return {
        # short: figure titles print it whole
        "summary": f"MODELLED: {hw.name}, {place.nodes} node{'s' if place.nodes > 1 else ''} x "
                   f"{min(world_size, hw.devices_per_node)} {hw.accelerator.name}",
        "description": hw.description,
        "profile": hw.name,
        "path": repo_relative(hw.path),
        "nodes": place.nodes,
        "devices_per_node": hw.devices_per_node,
        "nics_per_node": hw.nics_per_node,
        "world_size": world_size,
        "gpu_name": hw.accelerator.name,
        "accelerator": dataclasses.asdict(hw.accelerator),
        "intra": link(hw.intra),
        "inter": link(hw.inter),
    }


def _record(case: Case, pred: Prediction, experiment: str, *, variant_of: str | None = None) -> R.Record:
    case = dataclasses.replace(case, experiment=experiment)
    rec = R.base_record(case, pred.status, pred.reason)
    s, hw = pred.shape, pred.hardware
    # the FLOPs of what the time covers: the attention (op) or the whole layer with its projections
    flops, scope = case_flops(case.level, s, case.mode)
    t = pred.time_s if pred.status == "ok" else None
    sim_bytes = pred.bytes_per_rank
    per_rank = [sim_bytes.get(g, {}) for g in range(s.world_size)]
    phase_max = {p: max(sum(v for (ph, _), v in r.items() if ph == p) for r in per_rank)
                 for p in ("forward", "backward")}
    formula = pred.registry_bytes
    rec.update({
        "source": "modelled",
        "machine": "modelled",
        "flops_scope": scope,
        "hardware_profile": hw.name,
        "hardware": hardware_record(hw, s.world_size),
        "versions": {**rec.get("versions", {}), "perfmodel": "experiments.perfmodel (attention and model level)"},
        "time_model_s": pred.time_s,
        "time_median_s": t,
        # the mean rank's time beside the slowest's (each rank's last task: simulator.Schedule.rank_ends)
        "time_mean_rank_s": pred.breakdown.get("mean_rank_end_s") if t else None,
        "flops": flops,
        "tflops_total": tflops_per_s(flops, t) if t else None,
        "tflops_per_rank": tflops_per_s(flops, t) / s.world_size if t else None,
        "tokens_per_s": tokens_per_s(s.batch, s.seqlen, t) if t else None,
        "mem_peak_bytes": pred.memory["above_inputs_bytes"],
        "mem_model_bytes": pred.memory["kept_bytes"],
        "mem_method": pred.memory.get("method", "modelled: registry memory model + transient buffers (above inputs)"),
        "mem_measured_over": "modelled " + ("forward" if case.mode == "forward" else "forward + backward"),
        "comm_fwd_bytes": phase_max["forward"],
        "comm_bwd_bytes": phase_max["backward"] if case.mode != "forward" else None,
        "comm_fwd_formula_bytes": sum(v for (p, _), v in formula.items() if p == "forward"),
        "comm_bwd_formula_bytes": sum(v for (p, _), v in formula.items() if p == "backward"),
        "comm_bytes_by_kind": {f"{p}/{k}": v for (p, k), v in sorted(per_rank[0].items())},
        "comm_formula_by_kind": {f"{p}/{k}": v for (p, k), v in sorted(formula.items())},
        "comm_measured_over": "modelled schedule (bytes placed from the registry formula)",
        "prediction": {
            "breakdown": pred.breakdown,
            "memory": pred.memory,
            "assumptions": list(ASSUMPTIONS),
            "notes": pred.notes,
        },
    })
    if variant_of:
        rec["method"] = pred.method
        rec["variant_of"] = variant_of
        rec["config"] = {**rec["config"], "method": pred.method, "variant_of": variant_of}
        rec["case_id"] = pred.method + rec["case_id"][len(case.method):]
    return rec


def predict_spec(spec: Spec, hardware: str | None = None, *, variants: bool = True):
    """(experiment name, records, variant records) for every case of ``spec``."""
    hw = spec_hardware(spec, hardware)
    exp = experiment_name(spec, hw, hardware)
    records, extra = [], []
    for case in spec.cases():
        pred = peer_prediction(spec.name, case, predict_case(case.method, case.shape, mode=case.mode,
                                                             level=case.level, hardware=hw))
        records.append(_record(case, pred, exp))
        if variants:
            for name, (base, _, _) in VARIANTS.items():
                if base == case.method:
                    vp = predict_case(name, case.shape, mode=case.mode, level=case.level, hardware=hw)
                    extra.append(_record(case, vp, exp, variant_of=base))
    return exp, records, extra


def write_experiment(spec: Spec, *, hardware: str | None = None, results_root: Path | str = RESULTS_ROOT,
                     plots_root: Path | str = PLOTS_ROOT, draw: bool = True, variants: bool = True) -> list[Path]:
    """Records, resolved spec, figures and tables of one spec; returns the files written."""
    results_root, plots_root = Path(results_root), Path(plots_root)
    hw = spec_hardware(spec, hardware)
    exp, records, extra = predict_spec(spec, hardware, variants=variants)
    out = results_root / exp
    record.write_all(out / R.RESULTS_FILE, records)
    files = [out / R.RESULTS_FILE]
    if extra:
        record.write_all(out / VARIANTS_FILE, extra)
        files.append(out / VARIANTS_FILE)
    resolved = {**spec.resolved(), "name": exp, "source": "modelled", "hardware_profile": hw.name}
    (out / "spec.resolved.yaml").write_text(yaml.safe_dump(resolved, sort_keys=False))
    files.append(out / "spec.resolved.yaml")
    if draw:
        files.extend(plots.draw_experiment(results_root, plots_root, exp))
    files.append(tables.write_table(spec, exp, hw, records, extra, plots_root / exp))
    return files
