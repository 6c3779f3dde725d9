"""Which committed reference records have no interval of their median (older runs stopped before the
sixth sample): the page lists them, so a reader knows which comparisons cannot decide anything until
they are re-measured."""
from __future__ import annotations

from .context import Context
from .doc import Heading, Link, Para, Table
from .evidence import Experiment, experiments


def lacking(ctx: Context) -> list[tuple[Experiment, int, int]]:
    """(experiment folder, ok records without an interval, ok records) for every reference experiment."""
    refs = [r for r in ctx.roots if r.kind == "reference"]
    out = []
    for e in experiments(refs, ("*",)):
        ok = [r for r in e.records if r.get("status") == "ok" and r.get("time_median_s") is not None]
        none = [r for r in ok if r.get("time_ci_lo_s") is None or r.get("time_ci_hi_s") is None]
        out.append((e, len(none), len(ok)))
    return out


def intervals_section(ctx: Context) -> list:
    rows = lacking(ctx)
    bad = [(rel, n, k) for rel, n, k in rows if n]
    text = (f"{len(bad)} of {len(rows)} committed reference experiments have records without a 95% interval "
            "of the median; their comparisons read \"no interval\" above and decide nothing.") if rows else \
        "No committed reference results."
    return [Heading(2, "Reference records without an interval", "intervals", nav="no interval"), Para((text,)),
            Table(("experiment", "ok records without an interval", "ok records"),
                  tuple((Link(e.rel, ctx.href(e.path)), str(n), str(k)) for e, n, k in bad))]
