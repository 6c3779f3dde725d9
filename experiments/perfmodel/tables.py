"""Markdown tables of modelled records (``plots/modelled/<experiment>/table_modelled.md``).

One table per quantity: time per layer, TFLOP/s per GPU (the suite's FLOP
convention, from the slowest rank's time) and MFU, the same from the mean rank's
time (what codes averaging over ranks report; ``harness/rank_times.py``), peak
memory per rank, and the communication left exposed on the critical path; rows
are the swept axis (sequence length, world size or batch; "N / G" where both
grow together), columns the methods (and model-only variants), "method
(layout)" where the spec sweeps layouts; a spec sweeping masks gets one table
per mask under each quantity. Every file says
"MODELLED", names the hardware profile with its numbers, what one cell is
(one layer's attention operator or layer), and the assumptions behind it.
"""
from __future__ import annotations

from pathlib import Path

from ..profiles.hardware import Hardware
from ..harness import rank_times
from ..harness.axes import human
from ..harness.env import repo_relative
from ..harness.spec import Spec
from .model import ASSUMPTIONS
from .schedules import VARIANTS
from .model_level import ASSUMPTIONS as MODEL_ASSUMPTIONS

X_AXES = ("seqlen", "world_size", "batch")
MODE_TEXT = {"forward": "forward", "backward": "backward", "fwd_bwd": "forward + backward"}
LEVEL_TEXT = {"op": "attention operator (local q, k, v shards in, local output out; no projections)",
              "layer": "attention layer (QKV projection, attention, output projection)"}


def _x_axis(records: list[dict]) -> str:
    for a in X_AXES:
        if len({r[a] for r in records}) > 1:
            return a
    return "seqlen"


def _cell(rec: dict | None, what: str, peak_tflops: float) -> str:
    if rec is None:
        return "–"
    if what == "mem":
        return f"{rec['prediction']['memory']['total_bytes'] / 2**30:.1f}"
    if rec["status"] == "oom":
        return f"OOM ({rec['prediction']['memory']['total_bytes'] / 2**30:.0f} GiB)"
    t = rec["time_median_s"]
    if what == "time":
        return f"{t * 1e3:.3g}" if t < 1 else f"{t * 1e3:,.0f}"
    if what == "tflops":
        return f"{rec['tflops_per_rank']:.0f} ({100 * rec['tflops_per_rank'] / peak_tflops:.0f}%)"
    if what == "tflops_mean":
        v = rank_times.tflops_per_rank(rec, rank_times.MEAN)
        return "–" if v is None else f"{v:.0f} ({100 * v / peak_tflops:.0f}%)"
    if what == "exposed":
        b = rec["prediction"]["breakdown"]
        return f"{100 * b['critical_comm_s'] / b['makespan_s']:.0f}%" if b["makespan_s"] else "0%"
    raise ValueError(what)


def _column(rec: dict, by_layout: bool) -> str:
    return f"{rec['method']} ({rec['layout']})" if by_layout else rec["method"]


def _grid(records, methods, x, what, peak, *, by_layout: bool = False) -> list[str]:
    xs = sorted({r[x] for r in records})
    cols = [c for m in methods for c in dict.fromkeys(_column(r, by_layout) for r in records if r["method"] == m)]
    # seqlen and world size grown together (a fixed number of tokens per rank): rows say both
    with_g = x == "seqlen" and len({r["world_size"] for r in records}) > 1
    head = [("N / G" if with_g else "N") if x == "seqlen" else x] + cols
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] + ["---:"] * len(cols)) + "|"]
    for v in xs:
        here = [r for r in records if r[x] == v]
        label = human(v) if x == "seqlen" else str(v)
        if with_g:
            label += " / " + ", ".join(str(g) for g in sorted({r["world_size"] for r in here}))
        row = [label]
        for c in cols:
            rec = next((r for r in here if _column(r, by_layout) == c), None)
            row.append(_cell(rec, what, peak))
        lines.append("| " + " | ".join(row) + " |")
    return lines


def mask_name(causal: bool, mask: str) -> str:
    """A mask as the field names it: full, causal, varlen-full / varlen-causal (documents), else the spec string
    with "causal" where the causal axis intersects it."""
    if not mask:
        return "causal" if causal else "full"
    if mask.startswith("docs:"):
        return f"{'varlen-causal' if causal else 'varlen-full'} ({mask})"
    return f"{mask}, causal" if causal else mask


def _facets(records: list[dict]) -> list[tuple[str, list[dict]]]:
    """The records by mask (the causal axis and the mask spec) when the spec sweeps them, else one group."""
    keys = list(dict.fromkeys((bool(r["causal"]), r.get("mask") or "") for r in records))
    if len(keys) == 1:
        return [("", records)]
    return [(mask_name(*k), [r for r in records if (bool(r["causal"]), r.get("mask") or "") == k]) for k in keys]


def _hardware_lines(hw: Hardware, dtype: str) -> list[str]:
    a = hw.accelerator
    lines = [f"- hardware profile `{hw.name}` ({repo_relative(hw.path)}): {hw.description}",
             f"- {a.name}: {a.peak_tflops.get(dtype)} TFLOP/s peak ({dtype}), {a.hbm_gib} GiB HBM at "
             f"{a.hbm_gbytes_s} GB/s; flash-attention efficiency (fwd+bwd) {list(a.attn_efficiency)}"
             + (f", forward {list(a.attn_efficiency_forward)}" if a.attn_efficiency_forward else
                " (no forward-only table: the same efficiency for every mode)")
             + f"; GEMM efficiency {a.gemm_efficiency}",
             f"- intra-node: {hw.intra.kind} {hw.intra.bytes_per_s / 1e9:.1f} GB/s per rank per direction, "
             f"{hw.intra.latency_us} µs"]
    if hw.inter is not None:
        lines.append(f"- inter-node: {hw.inter.kind} {hw.inter.gbits_s} Gb/s per link x "
                     f"{hw.nics_per_node or '?'} per node, efficiency {hw.inter.efficiency}, "
                     f"{hw.inter.bytes_per_s / 1e9:.2f} GB/s per rank when all {hw.devices_per_node} ranks of a "
                     f"node cross at once, {hw.inter.latency_us} µs")
    lines.append(f"- sources: {a.source}; {hw.intra.source}" + (f"; {hw.inter.source}" if hw.inter else ""))
    return lines


def write_table(spec: Spec, experiment: str, hw: Hardware, records: list[dict], variant_records: list[dict],
                out_dir: Path) -> Path:
    recs = records + variant_records
    methods = [m for m in spec.methods if any(r["method"] == m for r in recs)]
    methods += [v for v in VARIANTS if any(r["method"] == v for r in recs)]
    r0 = records[0]
    x = _x_axis(records)
    by_layout = len({r["layout"] for r in records}) > 1
    mode, level = MODE_TEXT[r0["mode"]], r0["level"]
    peak = hw.accelerator.peak_tflops.get(r0["dtype"], float("nan"))
    one_g = len({r["world_size"] for r in records}) == 1
    fixed = (f"B={r0['batch']}" if x != "batch" else "") + (f", G={r0['world_size']}" if one_g else "") \
        + f", Z={r0['heads']}" + (f"/{r0['kv_heads']}kv" if r0["kv_heads"] != r0["heads"] else "") \
        + f", d={r0['head_dim']}, {r0['dtype']}" \
        + (f", {'causal' if r0['causal'] else 'full'}" if len(_facets(records)) == 1 else ", masks below") \
        + (f", {r0['layout']}" if not by_layout else ", layouts in the columns") \
        + (f", N={human(r0['seqlen'])}" if x != "seqlen" else "")
    what = f"one layer's {LEVEL_TEXT[level]}, {mode}"
    out = [f"# {experiment}: {spec.paper_ref or spec.description} — MODELLED",
           "",
           f"**Modelled, not measured**: predictions of `experiments.perfmodel` on hardware profile "
           f"`{hw.name}` ({hw.description}). Every cell is **{what}** "
           f"({fixed}); the whole model's step (all layers, MLPs, LM head) is `{experiment}_model_level` where the "
           "spec is a layer of a paper model.",
           ""]
    if level == "layer" and r0["mode"] == "forward":
        out += ["This is NOT the paper's first-token latency of the whole model: it is the attention layer of "
                "ONE layer. Multiplying by the layer count would still leave out the MLPs, norms and LM head.", ""]
    variants = [v for v in VARIANTS if v in methods]
    if variants:
        out += ["Model-only variants (not registry methods, nothing runs them): "
                + "; ".join(f"`{v}` = {VARIANTS[v][2]}" for v in variants) + ".", ""]
    sections = [("time", f"Time per layer (ms), {mode}"),
                ("tflops", f"TFLOP/s per GPU (suite FLOP convention: causal halved, bwd = 2.5x fwd; the slowest "
                           f"rank's time) and % of the {peak:g} TFLOP/s peak"),
                ("tflops_mean", "TFLOP/s per GPU from the mean rank's time (what codes averaging over ranks report)"),
                ("mem", "Modelled peak memory per rank (GiB; inputs + kept activations + transient buffers)"),
                ("exposed", "Share of the time that is communication on the critical path (not hidden by compute)")]
    if not any(r.get("time_mean_rank_s") is not None for r in recs):
        sections = [sc for sc in sections if sc[0] != "tflops_mean"]
    for key, title in sections:
        out += [f"## {title}", ""]
        for name, part in _facets(recs):
            out += ([f"### {name}", ""] if name else []) + _grid(part, methods, x, key, peak,
                                                                  by_layout=by_layout) + [""]
    out += ["## Hardware", ""] + _hardware_lines(hw, r0["dtype"]) + [""]
    out += ["## Assumptions", ""] + [f"- {a}" for a in ASSUMPTIONS]
    notes = []
    for r in recs:
        for n in r["prediction"]["notes"]:
            line = f"- `{r['method']}`: {n}"
            if line not in notes:
                notes.append(line)
    out += ["", "## Method notes", ""] + notes + [""]
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "table_modelled.md"
    path.write_text("\n".join(out), encoding="utf-8")
    return path


def _model_cell(rec: dict | None, what: str) -> str:
    if rec is None:
        return "–"
    mem = rec["prediction"]["memory"]
    if what == "mem":
        return f"{mem['total_bytes'] / 2**30:.1f}" + (" (OOM)" if mem["oom"] else "")
    if rec["status"] == "oom":
        why = "layer" if mem["layer_oom"] else f"{mem['total_bytes'] / 2**30:.0f} GiB"
        return f"OOM ({why}; {rec['time_model_s']:.3g} s if it fit)" if what == "time" else f"OOM ({why})"
    t = rec["time_median_s"]
    if what == "time":
        return f"{t:.3g}"
    if what == "mfu":
        return f"{100 * rec['mfu']:.1f}%"
    if what == "tokens":
        return f"{rec['tokens_per_s'] / rec['world_size']:,.0f}"
    if what == "exposed":
        b = rec["prediction"]["breakdown"]
        return f"{100 * b['critical_comm_s'] / b['makespan_s']:.0f}%"
    raise ValueError(what)


_MEM_NOTE = ("Training: `burst_impl.model.memory.step_memory` (weights, AdamW state, gradients by sharding; "
             "activations by checkpoint mode; the loss's buffers by loss mode) plus the attention layer's "
             "transient buffers. The parts overlap in time: the step's peak is the largest of its moments, "
             "not their sum. Not counted: CUDA context, allocator fragmentation, communication-library buffers.")

_PREFILL_NOTE = ("Prefill memory: the weights, the attention layer's modelled peak (its input, weights, kept and "
                 "transient buffers) and one layer's MLP activations on the local tokens; the KV cache a server "
                 "would keep for decoding is not counted.")


def _setup_lines(records: list[dict]) -> list[str]:
    """Each row's training setup: method, loss, checkpoint mode (as run), ZeRO stage and offload."""
    out = ["## Training setup of each row", "",
           "| row | method | loss | checkpoint (as run) | weights | ZeRO stage | offload |",
           "|---|---|---|---|---|---:|---|"]
    for row, r in _one_per_row(records):
        m = r["prediction"]["memory"]
        out.append(f"| {r.get('variant_label') or row} | `{r['method']}` | {m['loss']} | {m['checkpoint']} | "
                   f"{m['weights']} | {r.get('zero_stage', 3 if m['weights'] == 'fsdp2' else 0)} | "
                   f"{r.get('offload', 'none')} |")
    return out + [""]


def _one_per_row(records: list[dict]):
    """(row, its first record): a row is a spec's variant, or its method where it has none."""
    seen = set()
    for r in records:
        row = r.get("variant") or r["method"]
        if row not in seen:
            seen.add(row)
            yield row, r


def _variant_tables(records: list[dict], meta: dict, hbm: str) -> list[str]:
    """A table whose rows are a spec's variants (model_cases.ModelVariant), columns its (N, G) cells."""
    names = list(meta.get("methods", []))
    labels = {row["name"]: row["label"] or row["name"] for row in meta.get("rows", [])}
    cells = sorted({(r["world_size"], r["seqlen"]) for r in records})
    # a spec that sweeps the mask or the layout (BurstEngine's sparse training) has a row per variant and
    # (mask, layout); otherwise a row per variant
    swept = len({(r.get("mask") or "", r.get("layout")) for r in records}) > 1
    rows = [(n, ml) for n in names for ml in (list(dict.fromkeys((r.get("mask") or "causal", r.get("layout"))
                                                                  for r in records if r.get("variant") == n))
                                             if swept else [None]) or [None]]
    out = []
    for key, title in (("tokens", "Tokens/s per GPU"), ("mem", f"Memory per rank (GiB, modelled; OOM above {hbm})"),
                       ("time", "Time per step (s)"), ("mfu", "MFU"),
                       ("exposed", "Share of the step that is communication on the critical path")):
        out += [f"## {title}", "", "| row | " + " | ".join(f"N={human(n)}, G={g}" for g, n in cells) + " |",
                "|---|" + "---:|" * len(cells)]
        for name, ml in rows:
            rec = {(r["world_size"], r["seqlen"]): r for r in records if r.get("variant") == name
                   and (ml is None or ((r.get("mask") or "causal"), r.get("layout")) == ml)}
            label = labels.get(name, name) + ("" if ml is None else f", mask {ml[0]}, layout {ml[1]}")
            # a cell the spec excludes (e.g. heads that do not split over G ranks for Ulysses) says so
            out.append(f"| {label} | " + " | ".join(_model_cell(rec.get(c), key) if c in rec else
                                                   "– (excluded by the spec)" for c in cells) + " |")
        out.append("")
    return out + [_MEM_NOTE, ""]


def _ablation_tables(records: list[dict], hbm: str) -> list[str]:
    """An ablation's rows in order (``ablation_step``): time, tokens/s, speedup over the first row, exposed
    communication and memory, then each row's memory parts and its training setup."""
    out: list[str] = []
    rows = sorted(records, key=lambda r: r["ablation_step"])
    out += ["| step | method | time per step (s) | tokens/s per GPU | speedup over the first row | MFU | "
            "exposed comm | memory per rank (GiB) |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    t0 = rows[0]["time_model_s"]
    for r in rows:
        out.append(f"| {r['ablation_label']} | `{r['method']}` | {_model_cell(r, 'time')} | "
                   f"{_model_cell(r, 'tokens')} | {t0 / r['time_model_s']:.3f} | {_model_cell(r, 'mfu')} | "
                   f"{_model_cell(r, 'exposed')} | {_model_cell(r, 'mem')} |")
    out += ["", "A model has no spread: the speedups have no interval (the measured CPU mirror's summary "
                "gives each its 95% bootstrap interval).", ""] + _setup_lines(rows)
    out += ["", f"## Memory per rank per step (GiB, modelled; OOM above {hbm})", "",
            _MEM_NOTE, "",
            "| step | weights | checkpoint | loss | weights + optimizer | gradients | activations kept | "
            "one block recomputed | loss buffers | attention transient | step peak above the state | total |",
            "|---|---|---|---|" + "---:|" * 8]
    def gib(b: int) -> str:
        return f"{b / 2**30:.1f}"

    for r in rows:
        m, p = r["prediction"]["memory"], r["prediction"]["memory"]["parts"]
        out.append(f"| {r['ablation_step']} | {m['weights']} | {m['checkpoint']} | {m['loss']} | "
                   f"{gib(m['resident_bytes'])} | {gib(p['grads'])} | {gib(p['activations'])} | "
                   f"{gib(p['recompute'])} | {gib(p['logits'])} | {gib(p['attention_transient'])} | "
                   f"{gib(m['total_bytes'] - m['resident_bytes'])} | {_model_cell(r, 'mem')} |")
    out.append("")
    return out


def write_model_table(experiment: str, meta: dict, hw: Hardware, records: list[dict], out_dir: Path) -> Path:
    """``table_modelled.md`` of a model-level experiment (``model_figures.py``)."""
    r0 = records[0]
    mode = "prefill (forward, first-token latency)" if r0["mode"] == "forward" else "training step (forward + backward)"
    out = [f"# {experiment}: {meta.get('paper_ref', '')} — MODELLED, whole model",
           "",
           f"**Modelled, not measured**: `experiments.perfmodel` (model level) on hardware profile `{hw.name}` "
           f"({hw.description}). Every cell is one **{mode} of the whole {r0['model_config']} model** "
           f"(B={r0['batch']}, {r0['dtype']}, {'causal' if r0['causal'] else 'full'}, {r0['layout']}). "
           "MFU and tokens/s use the model's FLOP convention (burst_impl/model/flops.py: 6 x matmul params x "
           f"tokens + attention, causal halved, recompute not counted) against {hw.accelerator.name}'s "
           f"{hw.accelerator.peak_tflops.get(r0['dtype'])} TFLOP/s peak.",
           ""]
    hbm = f"the {hw.accelerator.hbm_gib:g} GiB of {hw.accelerator.name}"
    if "ablation_step" in r0:
        out += _ablation_tables(records, hbm)
    elif "variant" in r0:
        out += _variant_tables(records, meta, hbm) + _setup_lines(records)
    else:
        # a column per method and ZeRO setting (Fig. 3's twin has Burst with and without ZeRO, model_figures.twin_zero)
        methods = [(m, z) for m in meta.get("methods", []) for z in (False, True)
                   if any(r["method"] == m and bool(r.get("zero")) == z for r in records)]
        x = _x_axis(records) if len({r["seqlen"] for r in records}) > 1 or len(
            {r["world_size"] for r in records}) > 1 or len({r["batch"] for r in records}) > 1 else "seqlen"
        if x == "seqlen" and len({r["world_size"] for r in records}) > 1:
            x = "world_size"
        xs = sorted({r[x] for r in records})
        weights = sorted({str(r["prediction"]["memory"]["weights"]) for r in records})
        for key, title in (("time", "Time per step (s)"), ("tokens", "Tokens/s per GPU"), ("mfu", "MFU"),
                           ("exposed", "Share of the step that is communication on the critical path"),
                           ("mem", f"Memory per rank (GiB, modelled; weights {' / '.join(weights)}; OOM above "
                                   f"{hbm})")):
            out += [f"## {title}", "", "| " + " | ".join([x if x != "seqlen" else "N"] + [
                        m + ("+ZeRO" if z else "") for m, z in methods]) + " |",
                    "|" + "|".join(["---"] + ["---:"] * len(methods)) + "|"]
            for v in xs:
                row = [human(v) if x == "seqlen" else str(v)]
                row += [_model_cell(next((r for r in records if r["method"] == m and bool(r.get("zero")) == z
                                          and r[x] == v), None), key) for m, z in methods]
                out.append("| " + " | ".join(row) + " |")
            out.append("")
        out += [_MEM_NOTE if r0["mode"] == "fwd_bwd" else _PREFILL_NOTE, ""]
    # where the time goes, largest case of each method
    out += ["## Where the time goes (largest case of each method, seconds, whole model)", "",
            "| method | case | attention layers | MLP blocks | LM head | exposed grad sync | recompute | "
            "cache all-to-alls | exposed ZeRO-3 collectives |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for row, r in _one_per_row(sorted(records, key=lambda r: (-r["seqlen"] * r["batch"], -r["world_size"]))):
        p = r["prediction"]["parts_s"]
        out.append(f"| `{row}` | N={human(r['seqlen'])}, G={r['world_size']}, B={r['batch']} | "
                   f"{p['attention']:.3g} | {p['mlp']:.3g} | {p['head']:.3g} | {p['grad_sync_exposed']:.3g} | "
                   f"{p['recompute']:.3g} | {p.get('cache_a2a', 0.0):.3g} | {p.get('zero3_exposed', 0.0):.3g} |")
    out += ["", "## Hardware", ""] + _hardware_lines(hw, r0["dtype"]) + [""]
    out += ["## Assumptions", ""] + [f"- {a}" for a in ASSUMPTIONS + MODEL_ASSUMPTIONS] + [""]
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "table_modelled.md"
    path.write_text("\n".join(out), encoding="utf-8")
    return path
