"""A claim's verdict from records: one outcome per experiment found, combined (compare.combine).

Kinds (``claims.KINDS``): ``speedup`` (the claimed method faster than each other one at the largest
common sequence length, by the time ratio and its interval), ``speedup_best`` (faster than the fastest
of the others, and with less memory), ``less_bytes`` (fewer bytes sent, forward + backward: counted
bytes are exact, no interval), ``equal_loss`` (the same losses within the paper's own spread),
``ordering`` (each consecutive pair of the paper's order, as ``speedup``), ``steps`` (each ablation
step moves tokens/s and memory the way the paper's does).
"""
from __future__ import annotations

from dataclasses import dataclass

from .claims import Claim
from .compare import (CONTRADICTED, MISSING, REPRODUCED, by_shape, combine, largest_common,
                      time_ratio)
from .evidence import Experiment
from .paper import MethodMap, PaperTable
from .steps import steps_outcome


@dataclass(frozen=True)
class Outcome:
    status: str
    detail: str
    experiment: Experiment | None = None
    shapes: tuple = ()        # the shapes compared (compare.shape), which the claim's regime is checked on
    ratios: tuple = ()        # the time ratios compared (> 1: the claimed method faster), where times decide


@dataclass(frozen=True)
class Verdict:
    status: str
    outcomes: tuple[Outcome, ...]
    reason: str = ""          # why nothing could be measured, when so


def _shapes(claim: Claim, exp: Experiment, methods: dict[str, MethodMap], measured: bool, names):
    return [by_shape(exp.records, methods[n], measured, claim.select) for n in names]


def _pairs(claim, exp, methods, measured):
    """(other method, shape, claim.method's record, other's record) at the largest shape both have."""
    for other in claim.against:
        tabs = _shapes(claim, exp, methods, measured, (claim.method, other))
        at = largest_common(tabs)
        if at is not None:
            yield other, at, tabs[0][at], tabs[1][at]


def _speedup(claim, exp, methods, measured) -> Outcome:
    parts, statuses, shapes, ratios = [], [], [], []
    for other, at, mine, theirs in _pairs(claim, exp, methods, measured):
        r = time_ratio(mine, theirs)
        statuses.append(r.status)
        shapes.append(at)
        ratios += [r.value] if r.value is not None else []
        parts.append(f"vs {other} at N={at[1]}: {r.text()}")
    if not parts:
        return Outcome(MISSING, f"{exp.name}: no shape has both {claim.method} and one of {list(claim.against)}", exp)
    return Outcome(combine(statuses), f"{exp.name}: " + "; ".join(parts), exp, tuple(shapes), tuple(ratios))


def _best(claim, exp, methods, measured) -> Outcome:
    names = (claim.method, *claim.against)
    tabs = _shapes(claim, exp, methods, measured, names)
    present = [(n, t) for n, t in zip(names, tabs) if t]
    if len(present) < 2 or present[0][0] != claim.method:
        return Outcome(MISSING, f"{exp.name}: needs {claim.method} and at least one of {list(claim.against)}", exp)
    at = largest_common([t for _, t in present])
    if at is None:
        return Outcome(MISSING, f"{exp.name}: no shape common to the methods present", exp)
    mine, others = present[0][1][at], [t[at] for _, t in present[1:]]
    ok = [o for o in others if o["status"] == "ok"]
    best = min(ok, key=lambda o: o["time_median_s"]) if ok else others[0]
    r = time_ratio(mine, best)
    mem = [o.get("mem_total_bytes") or o.get("mem_peak_bytes") for o in ok]
    mine_mem = mine.get("mem_total_bytes") or mine.get("mem_peak_bytes")
    lower = bool(mem) and mine_mem is not None and all(m and mine_mem < m for m in mem)
    status = r.status if lower or not mem else (CONTRADICTED if r.status == REPRODUCED else r.status)
    return Outcome(status, f"{exp.name} at N={at[1]}: vs the fastest other ({best['method']}) {r.text()}; "
                           f"memory {'lower' if lower else 'not lower'} than every other", exp, (at,),
                   (r.value,) if r.value is not None else ())


def _bytes(rec: dict) -> float:
    # a model-level record counts one transformer layer (attention + MLP), which is what the paper's
    # volumes count (TP's 4BZNd includes the MLP's all-reduce); otherwise the step's forward + backward
    if rec.get("comm_layer_bytes") is not None:
        return float(rec["comm_layer_bytes"])
    return float(rec.get("comm_fwd_bytes") or rec.get("comm_fwd_formula_bytes") or 0) + \
        float(rec.get("comm_bwd_bytes") or rec.get("comm_bwd_formula_bytes") or 0)


def _less_bytes(claim, exp, methods, measured) -> Outcome:
    parts, statuses, shapes = [], [], []
    for other, at, mine_rec, theirs_rec in _pairs(claim, exp, methods, measured):
        mine, theirs = _bytes(mine_rec), _bytes(theirs_rec)
        if not theirs:
            continue
        less = 1 - mine / theirs
        statuses.append(REPRODUCED if less > 0 else CONTRADICTED)
        shapes.append(at)
        parts.append(f"{abs(less):.0%} {'less' if less > 0 else 'more'} than {other} at N={at[1]}")
    if not parts:
        return Outcome(MISSING, f"{exp.name}: no bytes for {claim.method} next to {list(claim.against)}", exp)
    paper = f" (paper: ~{claim.paper_value:.0%})" if claim.paper_value else ""
    return Outcome(combine(statuses), f"{exp.name}: " + "; ".join(parts) + paper + "; bytes are counted, exact", exp,
                   tuple(shapes))


def _losses(rec: dict) -> list[float] | None:
    """The values a record offers for "the same function": its held-out perplexity (Table 4's own
    quantity, ``measure.modes: [perplexity]``) or else its training losses, step by step."""
    if rec.get("perplexity") is not None:
        return [rec["perplexity"]]
    return rec.get("losses") or None


def _equal_loss(claim, exp, methods, measured) -> Outcome:
    names = (claim.method, *claim.against)
    tabs = [{k: r for k, r in t.items() if _losses(r)} for t in _shapes(claim, exp, methods, measured, names)]
    present = [t for t in tabs if t]
    at = largest_common(present) if len(present) >= 2 else None
    if at is None:
        return Outcome(MISSING, f"{exp.name}: no losses of two of the methods at one shape", exp)
    losses = [_losses(t[at]) for t in present]
    what = "perplexities" if present[0][at].get("perplexity") is not None else "losses"
    spread = max((max(step) - min(step)) / min(step) for step in zip(*losses))
    status = REPRODUCED if spread <= claim.tolerance else CONTRADICTED
    return Outcome(status, f"{exp.name} at N={at[1]}: {len(present)} methods, largest relative spread of the "
                           f"{what} {spread:.1e} (paper's own spread {claim.tolerance:.0e})", exp, (at,))


def _ordering(claim, exp, methods, measured) -> Outcome:
    names = [n for n, t in zip((claim.method, *claim.against), _shapes(claim, exp, methods, measured,
                                                                       (claim.method, *claim.against))) if t]
    parts, statuses, shapes, ratios = [], [], [], []
    for fast, slow in zip(names, names[1:]):
        sub = Claim(claim.id, claim.paper, claim.claim, "speedup", fast, (slow,), select=claim.select)
        o = _speedup(sub, exp, methods, measured)
        statuses.append(o.status)
        shapes += o.shapes
        ratios += o.ratios
        parts.append(f"{fast} > {slow}: {o.detail.split(': ', 1)[-1]}")
    if not parts:
        return Outcome(MISSING, f"{exp.name}: fewer than two of the ordered methods", exp)
    missing = [n for n in (claim.method, *claim.against) if n not in names]
    return Outcome(combine(statuses), f"{exp.name}: " + "; ".join(parts)
                   + (f" (absent: {', '.join(missing)})" if missing else ""), exp, tuple(shapes), tuple(ratios))


_KIND = {"speedup": _speedup, "speedup_best": _best, "less_bytes": _less_bytes, "equal_loss": _equal_loss,
         "ordering": _ordering}


def judge(claim: Claim, exps: list[Experiment], methods: dict[str, MethodMap], *, measured: bool,
          tables: dict[str, PaperTable], patterns: tuple[str, ...]) -> Verdict:
    if not exps:
        where = f"no records of {', '.join(patterns)} in any {'measured' if measured else 'modelled'} results " \
                f"folder" if patterns else "no experiment is named as its evidence"
        return Verdict(MISSING, (), where + (f" ({claim.why_not})" if claim.why_not else ""))
    if claim.kind == "steps":
        outs = [Outcome(*steps_outcome(tables[claim.table], e, methods, measured), e) for e in exps]
    else:
        outs = [_KIND[claim.kind](claim, e, methods, measured) for e in exps]
    status = combine([o.status for o in outs])
    reason = "; ".join(o.detail for o in outs) if status == MISSING else ""
    return Verdict(status, tuple(outs), reason)
