"""The page's top: each claim in one sentence, its headline verdict and the chain it comes from
(``chain``): (a) the model against the emulated cluster, (b) modelled at the paper's size, (c) measured
on an emulated cluster of the paper's shape, (d) measured at CPU scale; and links to the evidence."""
from __future__ import annotations

from .chain import Chain, chain
from .compare import MISSING
from .context import Context
from .doc import Heading, Link, Para, Table
from .verdict import judge


def chains(ctx: Context) -> list[Chain]:
    """The verdict chain of every claim."""
    out = []
    for c in ctx.claims:
        meas = judge(c, ctx.measured(c.measured), ctx.methods, measured=True, tables=ctx.tables,
                     patterns=c.measured)
        mod = judge(c, ctx.modelled(c.modelled), ctx.methods, measured=False, tables=ctx.tables,
                    patterns=c.modelled)
        out.append(chain(c, measured_roots=ctx.measured_roots, measured=meas, modelled=mod, methods=ctx.methods,
                         tables=ctx.tables, rules=ctx.rules))
    return out


def _evidence(ctx: Context, ch: Chain) -> tuple:
    c = ch.claim
    links = [Link(f"§ {c.table}", f"#table-{c.table}")] if c.table else []
    for v in ch.verdicts:
        for o in v.outcomes:
            if o.experiment is not None and o.status != MISSING:
                links.append(Link(f"{o.experiment.name} ({o.experiment.root.kind})", ctx.href(o.experiment.path)))
    for chk in ch.checks.checks:
        links.append(Link(f"{chk.experiment} emulation report ({chk.root.path.name})",
                          ctx.href(chk.root.path / chk.experiment / "emulation_report.txt")))
    return tuple(dict.fromkeys(links))


HOW = ("Each claim's headline is its verdict at the paper's size (b, modelled), qualified by how well the "
       "model predicts the emulated cluster for the claim's methods at the largest emulated size (a: "
       "|predicted / measured - 1| within the emulator check's bound, or not, or no emulated run has the "
       "method). Measured comparisons count only inside the regime the claim speaks of (its tokens, ranks, "
       "nodes and hardware, experiments/paper/claims.yaml); outside it they show the direction they point in "
       "at CPU scale and never reproduce or contradict the claim (experiments/paper/verdict_rules.yaml). "
       "Verdicts compare times at the largest sequence length both methods have. A measured speedup counts "
       "only when the 95% intervals of the two medians do not overlap 1 (t_other_lo / t_claimed_hi > 1); a "
       "record without an interval decides nothing; modelled values are deterministic. Bytes are counted on "
       "the wire, so they are exact.")

HEADER = ("id", "paper", "the claim", "headline: (b) qualified by (a)", "(a) model vs emulated cluster",
          "(b) at the paper's size (modelled)", "(c) emulated cluster of the paper's shape",
          "(d) measured here (CPU scale)", "evidence")


def claims_section(ctx: Context) -> list:
    rows = tuple((ch.claim.id, ch.claim.paper, f"{ch.claim.claim} [regime: {ch.claim.regime.text()}]",
                  ch.headline, ch.validation, ch.modelled, ch.emulated, ch.cpu, _evidence(ctx, ch))
                 for ch in chains(ctx))
    return [Heading(2, "Claims and verdicts", "claims", nav="claims"), Para((HOW,)),
            Table(HEADER, rows, css="claims")]
