"""One section per paper table or figure: the paper's values, the model's at the paper's size with the
error per cell, each measurement found (CPU loopback, emulated cluster, GPU) with its intervals and
regime, and the figures drawn from them."""
from __future__ import annotations

from .compare import SHAPE_KEYS, method_select, shape
from .context import Context
from .doc import Heading, Image, Link, Para, Table
from .evidence import Experiment, regime, select
from .figures import paper_figure
from .model_error import cells, summarise
from .paper import PaperTable
from .parity import parity_blocks
from .quantities import QUANTITIES
from .utilisation import utilisation_blocks


def _paper_table(t: PaperTable) -> Table:
    return Table(("row", *[c.label for c in t.columns]),
                 tuple((r.label, *["—" if v is None else str(v) for v in r.values]) for r in t.rows))


def _modelled(ctx: Context, t: PaperTable) -> list:
    exps = ctx.modelled(t.modelled)
    if not exps:
        names = ", ".join(t.modelled) or "any experiment"
        return [Para((f"Modelled: no records of {names} under results/modelled/.",))]
    cs = cells(t, ctx.methods, exps)
    ncol = len(t.columns)
    rows = tuple((r.label, *[cs[i * ncol + j].text() for j in range(ncol)]) for i, r in enumerate(t.rows))
    links = tuple(x for e in exps for x in (Link(e.rel, ctx.href(e.path)), f"({regime(e.records)})"))
    return [Para(("Modelled at the paper's size, error against the paper per cell:", *links)),
            Table(("row", *[c.label for c in t.columns]), rows),
            Para((f"Model error: {summarise(cs).text()}.",)), *utilisation_blocks(t, cs)]


def _value(q, rec: dict) -> str:
    if rec.get("status") != "ok":
        return str(rec.get("status", "?")).upper() if rec.get("status") == "oom" else rec.get("status", "?")
    v = q.read(rec)
    if v is None:
        return "—"
    iv = q.interval(rec)
    return f"{v:.4g} [{iv[0]:.4g}, {iv[1]:.4g}]" if iv else f"{v:.4g}" + (" (no interval)" if q.timing else "")


def _order(s: tuple) -> tuple:
    # numbers in numeric order (512 before 1024), anything else after them by name
    return tuple((0, x, "") if isinstance(x, (int, float)) else (1, 0, str(x)) for x in s)


def _measured_table(ctx: Context, t: PaperTable, exp: Experiment) -> Table | str:
    """The records' values per paper row and shape, or why there is no table."""
    q = QUANTITIES[t.quantity]
    rows_by: dict[str, dict] = {}
    for r in t.rows:
        m = ctx.methods[r.method]
        recs = {shape(x): x for x in select(exp.records, method_select(m, measured=True))}
        if recs:
            how = ", ".join(f"{k} {v}" for k, v in method_select(m, measured=True).items())
            rows_by.setdefault(f"{r.label} ({how})", recs)
    if not rows_by:
        return "None of the paper's methods in these records."
    found = [x for recs in rows_by.values() for x in recs.values()]
    # a table of dashes says nothing: prefill records have no losses, so no perplexity
    if all(x.get("status") == "ok" and q.read(x) is None for x in found):
        return f"These records of the paper's methods have no {q.label}."
    shapes = sorted({s for recs in rows_by.values() for s in recs}, key=_order)
    vary = [i for i in range(len(SHAPE_KEYS)) if len({s[i] for s in shapes}) > 1] or [1]
    head = [", ".join(f"{SHAPE_KEYS[i]}={s[i]}" for i in vary) for s in shapes]
    rows = tuple((label, *[_value(q, recs[s]) if s in recs else "" for s in shapes]) for label, recs in rows_by.items())
    return Table((f"{q.label} ({q.unit})" if q.unit else q.label, *head), rows)


def _measured(ctx: Context, t: PaperTable) -> list:
    exps = ctx.measured(t.measured)
    if not exps:
        return [Para((f"Measured: no records of {', '.join(t.measured)} in any measured results folder.",))]
    out = []
    for e in exps:
        tab = _measured_table(ctx, t, e)
        out.append(Para(("Measured:", Link(e.rel, ctx.href(e.path)), f"— regime: {regime(e.records)}.",
                         tab if isinstance(tab, str) else "")))
        if not isinstance(tab, str):
            out.append(tab)
        out += parity_blocks(e.records)      # model.loss_parity: the rows' losses against the unsharded model's
    return out


def _paper_vs_model(ctx: Context, t: PaperTable) -> list:
    """The paper's table in its own form with the model's values beside it (reports/figures/<id>.png)."""
    exps = ctx.modelled(t.modelled)
    if not exps:
        return []
    out = ctx.page_dir / "figures" / f"{t.id}.png"
    commit = sorted({str((r.get("git") or {}).get("commit", "?"))[:7] for e in exps for r in e.records[:1]})
    line = f"paper: {t.path_rel} · modelled: {', '.join(e.rel for e in exps)} at {', '.join(commit)}"
    paper_figure(t, cells(t, ctx.methods, exps), out, line)
    return [Image(f"figures/{out.name}", f"{t.id}: paper vs modelled")]


def _figures(ctx: Context, t: PaperTable) -> list:
    exps = ctx.modelled(t.modelled) + ctx.measured(t.measured)
    drawn = [Image(ctx.href(f), f"{e.rel}: {f.rsplit('/', 1)[-1]}") for e in exps for f in ctx.figures(e, t.figures)]
    return _paper_vs_model(ctx, t) + drawn


def table_section(ctx: Context, t: PaperTable) -> list:
    return [Heading(2, f"{t.source}: {t.title}", f"table-{t.id}", nav=t.id),
            Para(("The paper's values, transcribed in", Link(t.path_rel, ctx.href(t.path_rel)),
                  f"({QUANTITIES[t.quantity].label}):")),
            _paper_table(t), *_modelled(ctx, t), *_measured(ctx, t), *_figures(ctx, t)]
