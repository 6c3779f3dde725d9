"""The performance model's error against the papers, table by table and overall: median and worst
relative error, and how often it agrees with the paper on out-of-memory."""
from __future__ import annotations

from .context import Context
from .doc import Heading, Link, Para, Table
from .model_error import cells, summarise


def model_section(ctx: Context) -> list:
    rows, everything = [], []
    for t in ctx.tables.values():
        exps = ctx.modelled(t.modelled)
        if not exps:
            rows.append((Link(t.id, f"#table-{t.id}"), t.source, "not modelled (no records)"))
            continue
        cs = cells(t, ctx.methods, exps)
        everything += cs
        rows.append((Link(t.id, f"#table-{t.id}"), t.source, summarise(cs).text()))
    return [Heading(2, "The performance model against the papers", "model-error", nav="model error"),
            Para(("Modelled, not measured: nothing in the model is fitted to the papers (docs/perfmodel.md), "
                  f"so this is its error as it stands. Overall: {summarise(everything).text()}.",)),
            Table(("table", "source", "error of the model"), tuple(rows))]
