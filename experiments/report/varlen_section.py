"""The field's mask benchmark (issue 37): each method's varlen-causal TFLOP/s as a fraction of its own causal
TFLOP/s, modelled at MagiAttention's H100 setup (``varlen_magiattention_h100``), beside MagiAttention's published
fractions (read off their figures, ``experiments/paper/*_readings.yaml``) and, when present, the 2 x 4 emulated
mirror (``cpu_varlen_magiattention_2x4``). Fractions, not absolute TFLOP/s: their baselines run FlashAttention-3,
the suite's H100 model FlashAttention-2. E: out of memory, X: could not run (the field's marks); "—": not a
case of the spec. Both ranks' times: the slowest's (the suite's default) and the mean's (what their code
reports)."""
from __future__ import annotations

from ..harness import rank_times as RT
from .context import Context
from .doc import Heading, Link, Para, Table
from .readings import Readings, load_readings

MODELLED = ("varlen_magiattention_h100",)
MEASURED = ("cpu_varlen_magiattention_2x4",)
TARGET = ("burst", "balanced", 0.85)      # the check: burst on the balanced layout keeps >= 85% at 64 GPUs


def field_mask(r: dict) -> str:
    """The field's name of a record's mask: full, causal, varlen-full, varlen-causal, window (causal)."""
    m, c = r.get("mask") or "", bool(r.get("causal"))
    if not m:
        return "causal" if c else "full"
    if m.startswith("docs:"):
        return "varlen-causal" if c else "varlen-full"
    return m + (", causal" if c else "")


def _rows(records) -> dict[tuple[str, str], dict[tuple[int, str], dict]]:
    """(method, layout) -> (world size, field mask) -> record, in the records' order."""
    out: dict = {}
    for r in records:
        if r.get("variant_of"):      # the model's variants (Burst without LAO): not the benchmark's methods
            continue
        out.setdefault((r["method"], r["layout"]), {})[(int(r["world_size"]), field_mask(r))] = r
    return out


def _tflops(r: dict | None, which: str) -> float | str:
    if r is None:
        return "—"
    if r.get("status") == "oom":
        return "E"
    if r.get("status") != "ok":
        return "X"
    v = RT.tflops_per_rank(r, which)
    return "—" if v is None else v


def fraction_cell(causal: dict | None, varlen: dict | None, which: str = RT.SLOWEST) -> str:
    """'causal → varlen-causal TFLOP/s (fraction)', or the mark of whichever could not be had."""
    c, v = _tflops(causal, which), _tflops(varlen, which)
    marks = [x for x in (c, v) if isinstance(x, str)]
    if marks:
        return next((x for x in marks if x != "—"), "—")
    return f"{c:.3g} → {v:.3g} ({v / c:.2f})"


def fraction(causal: dict | None, varlen: dict | None, which: str = RT.SLOWEST) -> float | None:
    c, v = _tflops(causal, which), _tflops(varlen, which)
    return None if isinstance(c, str) or isinstance(v, str) else v / c


def _model_tables(records, sizes) -> list:
    rows = _rows(records)
    out = []
    for which, what in ((RT.SLOWEST, "the slowest rank's time (the suite's)"),
                        (RT.MEAN, "the mean rank's time (what MagiAttention's code divides by)")):
        body = tuple((f"{m} ({lay})", *[fraction_cell(by.get((g, "causal")), by.get((g, "varlen-causal")), which)
                                         for g in sizes]) for (m, lay), by in rows.items())
        out += [Para((f"Modelled TFLOP/s per GPU, causal → varlen-causal (fraction), from {what}:",)),
                Table(("method (layout)", *[f"{g} GPUs" for g in sizes]), body)]
    return out


def _published(ctx: Context, rd: Readings) -> list:
    sizes = rd.world_sizes
    body = []
    for m in rd.methods:
        f, fw, bw = rd.fraction(m), rd.fraction(m, "fwd"), rd.fraction(m, "bwd")
        suite = rd.suite_method(m)
        body.append((m, *[f"{a:.2f} ({b:.2f}, {c:.2f})" for a, b, c in zip(f, fw, bw)],
                     f"{suite[0]} ({suite[1]})" if suite else "—"))
    return [Para(("Published (MagiAttention, H100, FlashAttention-3 baselines; read off a figure, ±",
                  f"{rd.uncertainty:g} TFLOP/s per value):", Link(rd.path_rel, ctx.href(rd.path_rel)),
                  "varlen-causal / causal for forward + backward (combined from their two passes as 3.5 / (1/fwd + "
                  "2.5/bwd)), then forward and backward alone; their time is the mean rank's.")),
            Table(("their method", *[f"{g} GPUs" for g in sizes], "closest here"), tuple(body))]


def _side_by_side(rd: Readings, records) -> list:
    rows = _rows(records)
    body = []
    for m in rd.methods:
        suite = rd.suite_method(m)
        by = rows.get(suite) if suite else None
        if not by:
            continue
        theirs = rd.fraction(m)
        cells = []
        for g, t in zip(rd.world_sizes, theirs):
            ours = fraction(by.get((g, "causal")), by.get((g, "varlen-causal")), RT.MEAN)
            cells.append(f"{'—' if ours is None else f'{ours:.2f}'} / {t:.2f}")
        body.append((f"{suite[0]} ({suite[1]}) / {m}", *cells))
    return [Para(("Modelled (mean rank's time) / published fraction, where the field has a counterpart:",)),
            Table(("ours / theirs", *[f"{g} GPUs" for g in rd.world_sizes]), tuple(body))] if body else []


def _check(records) -> Para:
    m, lay, target = TARGET
    by = _rows(records).get((m, lay), {})
    g = max((k[0] for k in by), default=None)
    f = fraction(by.get((g, "causal")), by.get((g, "varlen-causal"))) if g else None
    if f is None:
        return Para((f"Check: no modelled {m} ({lay}) records with both masks.",))
    return Para((f"Check (issue 37): {m} on the {lay} layout keeps {f:.2f} of its causal TFLOP/s on varlen-causal "
                 f"at {g} GPUs, modelled (slowest rank); target ≥ {target:.2f}: "
                 + ("met." if f >= target else "not met (docs/masks.md says why)."),))


def _measured(ctx: Context) -> list:
    exps = ctx.measured(MEASURED)
    if not exps:
        return [Para((f"Measured: no records of {', '.join(MEASURED)} yet (the 2 x 4 emulated mirror).",))]
    out = []
    for e in exps:
        rows = _rows(e.records)
        g = max((k[0] for by in rows.values() for k in by), default=0)
        body = tuple((f"{m} ({lay})", fraction_cell(by.get((g, "causal")), by.get((g, "varlen-causal"))),
                      fraction_cell(by.get((g, "causal")), by.get((g, "varlen-causal")), RT.MEAN),
                      _balance(by.get((g, "varlen-causal")))) for (m, lay), by in rows.items())
        out += [Para(("Measured:", Link(e.rel, ctx.href(e.path)), f"({g} ranks; TFLOP/s per rank, causal → "
                      "varlen-causal (fraction)):")),
                Table(("method (layout)", "slowest rank", "mean rank", "work max/mean, varlen-causal (rows / cols)"),
                      body)]
    return out


def _balance(r: dict | None) -> str:
    if not r or r.get("work_imbalance_rows") is None:
        return "—"
    return f"{r['work_imbalance_rows']:.3f} / {r['work_imbalance_cols']:.3f}"


def varlen_section(ctx: Context) -> list:
    head = [Heading(2, "The field's mask benchmark: varlen-causal against causal", "varlen-benchmark",
                    nav="varlen masks")]
    exps = ctx.modelled(MODELLED)
    readings = [r for r in load_readings() if r.id.startswith("magiattention")]
    if not exps and not readings:
        return head + [Para(("No records of", ", ".join(MODELLED), "and no published readings.",))]
    out = head + [Para(("MagiAttention's context-parallel benchmark (8K tokens per GPU, GQA 64:8, d 128, bf16; "
                        "docs/masks.md): each method's varlen-causal TFLOP/s over its own causal TFLOP/s. E = out "
                        "of memory, X = could not run, — = not a case of the spec.",))]
    for e in exps:
        recs = list(e.records)
        sizes = sorted({int(r["world_size"]) for r in recs})
        out += [Para(("Modelled:", Link(e.rel, ctx.href(e.path)),
                      f"({recs[0].get('hardware_profile', '?')}, FlashAttention-2 efficiency)."))]
        out += _model_tables(recs, sizes) + [_check(recs)]
    for rd in readings:
        out += _published(ctx, rd)
        for e in exps:
            out += _side_by_side(rd, list(e.records))
    return out + _measured(ctx)
