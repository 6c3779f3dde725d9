"""An inference spec through the model: records (``"source": "modelled"``), the table, and the crossover.

    files = write_inference_spec(spec, results_root="results/modelled", plots_root="plots/modelled")

Writes ``<experiment>/results.jsonl`` (one record per case: one attention layer, as the benchmark measures
it) and, when the spec names ``inference.model``, ``<experiment>_model_level/results.jsonl`` (the whole
decoder: TPOT, TTFT, its memory and the context that fits, ``mem_kv_capacity_tokens``), with
``spec.resolved.yaml`` and ``table_modelled.md`` beside the figures' folder. ``crossover(rows)`` is the
context from which a context-parallel row decodes faster than TP, per G and concurrency (the report and
docs/inference.md read it, from modelled and measured records alike).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import yaml

from ..harness import record, results as R
from ..harness.inference_cases import ROW_LABELS, row_of
from ..harness.spec import Case, Spec
from .inference import ASSUMPTIONS, InferencePrediction, predict_inference, predict_inference_model
from .predict import RESULTS_ROOT, PLOTS_ROOT, experiment_name, hardware_record, spec_hardware

CP_ROWS = ("cp_all_gather", "cp_heads")


def _record(case: Case, p: InferencePrediction, experiment: str, level: str, model: str | None = None) -> record.Record:
    """A modelled record of ``case``: one layer (``level`` "layer") or the whole ``model`` ("model")."""
    case = dataclasses.replace(case, experiment=experiment)
    reason = "" if p.status == "ok" else (
        f"modelled {p.memory['total_bytes'] / 2**30:.1f} GiB per rank (weights {p.memory['weights_bytes'] / 2**30:.1f}"
        f" + K/V {p.memory['kv_bytes'] / 2**30:.1f}) exceeds the {p.memory['capacity_bytes'] / 2**30:.0f} GiB of "
        f"{p.hardware.accelerator.name}")
    rec = R.base_record(case, p.status, reason)
    row = row_of(case.method, case.merge)
    t = p.time_s if p.status == "ok" else None
    table = p.registry_bytes
    sent = p.bytes_per_rank.get(0, {}) if p.bytes_per_rank else {}
    rec.update({
        "source": "modelled", "machine": "modelled", "hardware_profile": p.hardware.name,
        "hardware": hardware_record(p.hardware, case.world_size), "variant": row, "variant_label": ROW_LABELS[row],
        "versions": {**rec.get("versions", {}), "perfmodel": "experiments.perfmodel.inference"},
        "time_model_s": p.time_s, "time_median_s": t,
        "mem_kv_bytes_per_rank": p.kv_bytes_per_rank, "mem_kv_formula_bytes": max(p.kv_bytes_per_rank),
        "prediction": {"breakdown": {"critical_comm_s": p.critical_comm_s, "critical_compute_s": p.critical_compute_s},
                       "parts_s": p.parts, "memory": p.memory, "assumptions": list(ASSUMPTIONS), "notes": p.notes,
                       "level": level},
    })
    if t is not None and case.mode != "kv_capacity":
        rec["tpot_s" if case.mode == "decode" else "ttft_s"] = t / max(1, case.new_tokens)
    if p.memory:
        rec.update({"mem_kv_capacity_tokens": p.memory["kv_capacity_tokens"],
                    "mem_total_bytes": p.memory["total_bytes"],
                    "mem_parts_bytes": {"weights": p.memory["weights_bytes"], "kv": p.memory["kv_bytes"]}})
    if table:
        rec.update({"comm_fwd_bytes": sum(sent.values()), "comm_fwd_formula_bytes": sum(table.values()),
                    "comm_bytes_by_kind": {f"{a}/{b}": v for (a, b), v in sorted(sent.items())},
                    "comm_formula_by_kind": {f"{a}/{b}": v for (a, b), v in sorted(table.items())},
                    "comm_measured_over": "modelled schedule (bytes placed from decode_layer_bytes / "
                                          "prefill_layer_bytes)" + (", one layer" if level == "model" else "")})
    if level == "model":
        rec.update({"level": "model", "model_config": model,
                    "case_id": rec["case_id"].replace(".inference.", ".model."),
                    "config": {**rec["config"], "level": "model", "model": model}})
    return rec


def predict_inference_spec(spec: Spec, hardware: str | None = None):
    """(experiment, layer records, whole-model records) of an inference spec (module docstring)."""
    hw = spec_hardware(spec, hardware)
    exp = experiment_name(spec, hw, hardware)
    model = spec.inference.model
    layers, whole = [], []
    for case in spec.cases():
        row = row_of(case.method, case.merge)
        p = predict_inference(row, case.shape, mode=case.mode, hardware=hw, new_tokens=case.new_tokens)
        layers.append(_record(case, p, exp, "layer"))
        if model is not None:
            m = predict_inference_model(row, model, case.shape, mode=case.mode, hardware=hw, new_tokens=case.new_tokens)
            whole.append(_record(case, m, f"{exp}_model_level", "model", model))
    return exp, layers, whole


def crossover(rows: list[dict], key: str = "tpot_s") -> list[dict]:
    """Per (G, concurrency): every context's fastest context-parallel row against TP, and the smallest context
    from which a context-parallel row stays faster (None: never; the first context: always)."""
    groups: dict = {}
    for r in rows:
        if r.get(key) is None or r.get("mode") != "decode":
            continue
        groups.setdefault((r["world_size"], r["batch"]), {}).setdefault(r["seqlen"], {})[r["variant"]] = r[key]
    out = []
    for (g, b), by_n in sorted(groups.items()):
        points = []
        for n in sorted(by_n):
            t = by_n[n]
            cp = min((t[v], v) for v in CP_ROWS if v in t) if any(v in t for v in CP_ROWS) else None
            if cp is not None and "tp" in t:
                points.append((n, cp[1], cp[0] / t["tp"]))
        wins = [p[2] < 1 for p in points]
        first = next((points[i][0] for i in range(len(points)) if all(wins[i:])), None)
        out.append({"world_size": g, "batch": b, "points": points, "crossover": first})
    return out


def table_text(spec: Spec, exp: str, layers: list, whole: list) -> str:
    """``table_modelled.md``: per mode the time per G, concurrency and context, one column per row."""
    lines = [f"# {exp} (modelled)", "", f"{spec.description}. Hardware: {layers[0].get('hardware_profile')}. "
             "Times in ms (one attention layer; the whole decoder below where the spec names a model); "
             "OOM where weights + every layer's cache exceed the accelerator's memory.", ""]
    for title, recs in (("one attention layer", layers), (f"whole model ({spec.inference.model})", whole)):
        if not recs or recs[0].get("mode") == "kv_capacity" and title.startswith("one"):
            continue
        rows = [r.row() for r in recs]
        lines += [f"## {title}", "", "| mode | G | B | N | " + " | ".join(ROW_LABELS.values()) + " |",
                  "|---|---|---|---|" + "---|" * len(ROW_LABELS)]
        cells: dict = {}
        for r in rows:
            v = (f"{r['mem_kv_capacity_tokens']:,} tok" if r["mode"] == "kv_capacity" else
                 "OOM" if r["status"] == "oom" else f"{r['time_model_s'] * 1e3:.3g}")
            cells.setdefault((r["mode"], r["world_size"], r["batch"], r["seqlen"]), {})[r["variant"]] = v
        for (mode, g, b, n), c in sorted(cells.items()):
            lines.append(f"| {mode} | {g} | {b} | {n} | " + " | ".join(c.get(v, "-") for v in ROW_LABELS) + " |")
        cross = crossover([{**r, "tpot_s": r["time_model_s"]} for r in rows if r["status"] == "ok"])
        if cross:
            lines += ["", "Crossover (the smallest context from which a context-parallel row stays faster than TP): "
                      + "; ".join(f"G={c['world_size']} B={c['batch']}: {c['crossover'] or 'never'}" for c in cross)]
        lines.append("")
    return "\n".join(lines)


def write_inference_spec(spec: Spec, *, hardware: str | None = None, results_root: Path | str = RESULTS_ROOT,
                         plots_root: Path | str = PLOTS_ROOT) -> list[Path]:
    exp, layers, whole = predict_inference_spec(spec, hardware)
    files = []
    for name, recs in ((exp, layers), (f"{exp}_model_level", whole)):
        if not recs:
            continue
        out = Path(results_root) / name
        record.write_all(out / R.RESULTS_FILE, recs)
        (out / "spec.resolved.yaml").write_text(yaml.safe_dump({**spec.resolved(), "name": name, "source": "modelled",
                                                                "hardware_profile": recs[0]["hardware_profile"]},
                                                               sort_keys=False))
        files += [out / R.RESULTS_FILE, out / "spec.resolved.yaml"]
    table = Path(plots_root) / exp / "table_modelled.md"
    table.parent.mkdir(parents=True, exist_ok=True)
    table.write_text(table_text(spec, exp, layers, whole))
    return files + [table]
