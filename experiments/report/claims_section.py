"""The page's top: each claim in one sentence, its verdict here (measured on this machine or the
committed reference), its verdict at the paper's size (modelled), and links to the evidence."""
from __future__ import annotations

from .compare import CONTRADICTED, INCONCLUSIVE, MISSING, NO_INTERVAL, REPRODUCED
from .context import Context
from .doc import Heading, Link, Para, Table
from .verdict import Verdict, judge

LABELS = {REPRODUCED: "reproduced in direction", CONTRADICTED: "contradicted",
          "mixed": "mixed: reproduced in one comparison, contradicted in another",
          INCONCLUSIVE: "inconclusive: the difference is inside the measurement's interval",
          NO_INTERVAL: "not decided: the records have no interval",
          f"{REPRODUCED} in part": "reproduced in direction in part (other comparisons inside the interval)",
          f"{CONTRADICTED} in part": "contradicted in part (other comparisons inside the interval)"}


def label(status: str, measured: bool) -> str:
    if status == MISSING:
        return "not measurable here" if measured else "not modelled"
    return LABELS.get(status, status)


def verdict_text(v: Verdict, measured: bool) -> str:
    detail = v.reason or "; ".join(o.detail for o in v.outcomes if o.status != MISSING)
    return f"{label(v.status, measured)}: {detail}" if detail else label(v.status, measured)


def verdicts(ctx: Context):
    """(claim, measured verdict, modelled verdict) for every claim."""
    out = []
    for c in ctx.claims:
        meas, mod = ctx.measured(c.measured), ctx.modelled(c.modelled)
        out.append((c, judge(c, meas, ctx.methods, measured=True, tables=ctx.tables, patterns=c.measured),
                    judge(c, mod, ctx.methods, measured=False, tables=ctx.tables, patterns=c.modelled)))
    return out


def _evidence(ctx: Context, c, *vs) -> tuple:
    links = [Link(f"§ {c.table}", f"#table-{c.table}")] if c.table else []
    for v in vs:
        for o in v.outcomes:
            if o.experiment is not None and o.status != MISSING:
                links.append(Link(f"{o.experiment.name} ({o.experiment.root.kind})", ctx.href(o.experiment.path)))
    return tuple(dict.fromkeys(links))


def claims_section(ctx: Context) -> list:
    rows = [(c.id, c.paper, c.claim, verdict_text(m, True), verdict_text(p, False), _evidence(ctx, c, m, p))
            for c, m, p in verdicts(ctx)]
    how = ("Verdicts compare times at the largest sequence length both methods have. A measured speedup "
           "counts only when the 95% intervals of the two medians do not overlap 1 (t_other_lo / t_claimed_hi "
           "> 1); a record without an interval decides nothing; modelled values are deterministic. Bytes "
           "are counted on the wire, so they are exact. The CPU runs are at CPU scale (2-4 ranks, small "
           "heads): they test the direction of a claim in that regime, not its size.")
    return [Heading(2, "Claims and verdicts", "claims", nav="claims"), Para((how,)),
            Table(("id", "paper", "the claim", "verdict here (measured)", "at the paper's size (modelled)",
                   "evidence"), tuple(rows), css="claims")]
