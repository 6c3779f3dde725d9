"""The report's "Inference beyond the papers" section (issue 36, docs/inference.md): time to first token and time
per output token, modelled at the papers' hardware (the whole decoder, ``<spec>_model_level``) and measured on
the emulated 2 x 4 cluster (one attention layer), KV capacity per rank, the model's error against the emulated
runs (``inference_validation.json``, ``perfmodel/emulated/validate_decode.py``), and the crossover: the context
from which sharded (context-parallel) decode stays faster than TP decode, per G and concurrency
(``perfmodel.inference_records.crossover``), modelled and measured."""
from __future__ import annotations

import json

from ..harness.axes import human
from ..harness.inference_cases import ROW_LABELS
from ..perfmodel.emulated.validate_decode import VALIDATION_FILE
from ..perfmodel.inference_records import CP_ROWS, crossover
from .doc import Heading, Link, Para, Table

MODELLED = {"decode": ("decode_tpot_*_model_level",), "ttft": ("ttft_*_model_level",),
            "kv_capacity": ("kv_capacity_*_model_level",)}
MEASURED = {"decode": ("cpu_decode_*",), "ttft": ("cpu_ttft_*",), "kv_capacity": ("cpu_kv_capacity*",)}
KEY = {"decode": "tpot_s", "ttft": "ttft_s"}


def _ok(exp, mode):
    return [r for r in exp.records if r.get("mode") == mode]


def _ms(v) -> str:
    return "-" if v is None else f"{v * 1e3:.3g}"


def _cp_vs_tp(recs, key) -> str:
    """"CP a / TP b" in ms: the faster context-parallel row against TP (OOM where the model says so)."""
    by = {r["variant"]: r for r in recs}
    cell = []
    for name, rows in (("CP", [by[v] for v in CP_ROWS if v in by]), ("TP", [by["tp"]] if "tp" in by else [])):
        live = [r[key] for r in rows if r.get("status") == "ok" and r.get(key) is not None]
        cell.append(f"{name} {_ms(min(live)) if live else ('OOM' if rows else '-')}")
    return " / ".join(cell)


def _grid(exp, mode, ctx, title: str) -> list:
    """One modelled experiment: rows (G, B), columns the contexts, cells CP vs TP, the crossover last."""
    recs, key = _ok(exp, mode), KEY[mode]
    ns = sorted({r["seqlen"] for r in recs})
    cells: dict = {}
    for r in recs:
        cells.setdefault((r["world_size"], r["batch"]), {}).setdefault(r["seqlen"], []).append(r)
    cross = {(c["world_size"], c["batch"]): c["crossover"] for c in crossover(
        [{**r, key: r.get(key)} for r in recs if r.get("status") == "ok"], key)} if mode == "decode" else {}
    rows = tuple((str(g), str(b), *(_cp_vs_tp(by.get(n, []), key) for n in ns))
                 + ((human(cross[(g, b)]) if cross.get((g, b)) else "never",) if mode == "decode" else ())
                 for (g, b), by in sorted(cells.items()))
    hw = recs[0].get("hardware_profile", "?") if recs else "?"
    header = ("G", "B", *(human(n) for n in ns)) + (("CP faster from",) if mode == "decode" else ())
    return [Para((Link(exp.rel, ctx.href(exp.path)), f": {title}, {recs[0].get('model_config') if recs else ''} "
                  f"on {hw} (modelled, ms)",)), Table(header, rows)]


def _capacity(exps, ctx) -> list:
    rows = []
    for exp in exps:
        recs = _ok(exp, "kv_capacity")
        by: dict = {}
        for r in recs:
            by.setdefault(r["world_size"], {})[r["variant"]] = r.get("mem_kv_capacity_tokens")
        for g, v in sorted(by.items()):
            rows.append((Link(exp.name, ctx.href(exp.path)), str(g),
                         *(f"{v[k]:,}" if v.get(k) is not None else "-" for k in ROW_LABELS)))
    if not rows:
        return [Para(("No modelled records (make model).",))]
    return [Para(("Tokens of context (all sequences together) whose K/V fit beside the row's weights in one rank's "
                  "memory, the whole decoder:",)),
            Table(("experiment (modelled)", "G", *(f"{v}: tokens" for v in ROW_LABELS.values())), tuple(rows))]


def _validation(exp) -> dict:
    path = exp.path / VALIDATION_FILE
    return json.loads(path.read_text()) if path.exists() else {}


def _measured(exp, mode, ctx) -> list:
    """A measured experiment: every record with its interval, the model's prediction and error beside it."""
    recs, key = _ok(exp, mode), KEY.get(mode)
    val = {(r["mode"], r["world_size"], r["batch"], r["seqlen"], r["row"]): r for r in _validation(exp).get("rows", [])}
    rows = []
    for r in sorted(recs, key=lambda r: (r["world_size"], r["batch"], r["seqlen"], r["variant"])):
        v = val.get((mode, r["world_size"], r["batch"], r["seqlen"], r["variant"]))
        ci = (f"[{_ms(r.get('time_ci_lo_s'))}, {_ms(r.get('time_ci_hi_s'))}]"
              if r.get("time_ci_lo_s") is not None else "no interval")
        rows.append((str(r["world_size"]), str(r["batch"]), human(r["seqlen"]), ROW_LABELS.get(r["variant"], "?"),
                     f"{_ms(r.get(key))} {ci}" if r.get("status") == "ok" else r.get("status", "?"),
                     _ms(v["predicted_s"]) if v else "-", f"{v['error']:+.0%}" if v else "-"))
    head = [Para((Link(exp.rel, ctx.href(exp.path)), f": {mode} of one attention layer, measured (ms, median "
                  "[95% interval]) beside the model's prediction with today's emulated terms",))]
    out = head + [Table(("G", "B", "N", "row", "measured", "modelled", "error"), tuple(rows))]
    if mode == "decode":
        cross = crossover([r for r in recs if r.get("status") == "ok"])
        out.append(Para(("Measured crossover (CP faster from): " + ("; ".join(
            f"G={c['world_size']} B={c['batch']}: {human(c['crossover']) if c['crossover'] else 'never'}"
            for c in cross) or "no decode records"),)))
    return out


def _errors(exps) -> list:
    rows = [(e.name, f"{v['worst_abs_error']:.0%}", "met" if v["met"] else "NOT met", str(len(v["rows"])))
            for e in exps if (v := _validation(e))]
    text = ("The model against the emulated runs (target |predicted / measured - 1| <= 20% for every record; "
            "today's host and link terms, nothing fitted for inference):")
    return [Para((text,)), Table(("experiment", "worst |error|", "target", "records"), tuple(rows))] if rows else \
        [Para((text + " no emulated inference run has been compared yet (run the cpu_inference preset).",))]


def inference_section(ctx) -> list:
    out = [Heading(2, "Inference beyond the papers", "inference", nav="inference"),
           Para(("Context-parallel decode on a sharded KV cache (all-gather merge of a replicated model, or the "
                 "heads merge of Helix's layout) against tensor-parallel decode, and the prompt's prefill (Burst "
                 "ring, pass-KV). Modelled at the papers' hardware for the whole decoder; measured on the emulated "
                 "2 x 4 cluster for one attention layer. ", Link("docs/inference.md", ctx.href("docs/inference.md")),
                 " explains the benchmarks and the model.",))]
    for mode, title in (("decode", "time per output token"), ("ttft", "time to first token")):
        out.append(Heading(3, f"{title[0].upper()}{title[1:]}, modelled", f"inference-{mode}-modelled"))
        exps = ctx.modelled(MODELLED[mode])
        out += [b for e in exps for b in _grid(e, mode, ctx, title)] or [Para(("No modelled records (make model).",))]
    out.append(Heading(3, "KV capacity per rank, modelled", "inference-kv"))
    out += _capacity(ctx.modelled(MODELLED["kv_capacity"]), ctx)
    out.append(Heading(3, "Measured on the emulated cluster", "inference-measured"))
    measured = [(e, m) for m in ("decode", "ttft") for e in ctx.measured(MEASURED[m])]
    out += [b for e, m in measured for b in _measured(e, m, ctx)] or [
        Para(("No measured inference records (make reproduce PRESET=cpu_inference).",))]
    out += _errors([e for e, _ in measured])
    return out
