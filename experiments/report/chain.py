"""A claim's verdict chain: (a) the model's error against the emulated cluster (``validation``), (b) the
modelled verdict at the paper's size, (c) the measured verdict on an emulated cluster of the paper's
shape, (d) the measured direction at CPU scale, and the headline, (b) qualified by (a)
(``experiments/paper/verdict_rules.yaml``).

The one rule that keeps regimes apart: a measured comparison outside the regime its claim speaks of
(``claims.Regime``: fewer tokens, ranks or nodes, or a CPU where the claim is about GPUs) is labelled
``Rules.out_of_regime`` with the direction it points in, never "reproduced" or "contradicted".
"""
from __future__ import annotations

from dataclasses import dataclass

from .claims import Claim, Regime, Rules
from .compare import CONTRADICTED, INCONCLUSIVE, MISSING, NO_INTERVAL, REPRODUCED, combine, method_select, shape
from .evidence import Experiment, Root, experiments
from .paper import MethodMap, PaperTable
from .validation import Validation, validate
from .verdict import Outcome, Verdict, judge

LABELS = {REPRODUCED: "reproduced in direction", CONTRADICTED: "contradicted",
          "mixed": "mixed: reproduced in one comparison, contradicted in another",
          INCONCLUSIVE: "inconclusive: the difference is inside the measurement's interval",
          NO_INTERVAL: "not decided: the records have no interval",
          f"{REPRODUCED} in part": "reproduced in direction in part (other comparisons inside the interval)",
          f"{CONTRADICTED} in part": "contradicted in part (other comparisons inside the interval)"}
# what an out-of-regime comparison may say: which way it points, nothing more
DIRECTION = {REPRODUCED: "the claim's direction", CONTRADICTED: "the opposite direction",
             "mixed": "mixed directions", INCONCLUSIVE: "no direction (inside the interval)",
             NO_INTERVAL: "no direction (no interval)", f"{REPRODUCED} in part": "the claim's direction in part",
             f"{CONTRADICTED} in part": "the opposite direction in part"}


def label(status: str, measured: bool) -> str:
    if status == MISSING:
        return "not measurable here" if measured else "not modelled"
    return LABELS.get(status, status)


def verdict_text(v: Verdict, measured: bool) -> str:
    detail = v.reason or "; ".join(o.detail for o in v.outcomes if o.status != MISSING)
    return f"{label(v.status, measured)}: {detail}" if detail else label(v.status, measured)


def _nodes(rec: dict) -> int:
    return int((rec.get("cluster") or {}).get("nodes") or 1)


def _on_gpu(rec: dict) -> bool:
    return bool((rec.get("hardware") or {}).get("gpu_count"))


def speaks(regime: Regime, o: Outcome) -> bool:
    """Whether the comparison ``o`` ran inside ``regime``: every shape it compared (or, for a kind that
    compares no one shape, every record) has the claim's tokens and ranks, on its nodes and hardware."""
    if regime.unbounded:
        return True
    recs = o.experiment.records if o.experiment is not None else ()
    shapes = o.shapes or tuple(shape(r) for r in recs)
    if not recs or not shapes:
        return False
    if any((s[1] or 0) < regime.min_tokens or (s[2] or 0) < regime.min_ranks for s in shapes):
        return False
    if min(_nodes(r) for r in recs) < regime.min_nodes:
        return False
    return regime.hardware != "gpu" or all(_on_gpu(r) for r in recs)


@dataclass(frozen=True)
class Column:
    """A measured column: its text, and the verdict of the comparisons inside the claim's regime
    (MISSING when none is)."""
    text: str
    in_regime: str = MISSING
    verdict: Verdict | None = None


def _detail(o: Outcome, where: bool) -> str:
    return f"{o.detail} [{o.experiment.root.path.name}]" if where and o.experiment is not None else o.detail


def measured_column(v: Verdict, regime: Regime, rules: Rules, *, where: bool = False) -> Column:
    """``v`` with the regime rule applied: in-regime comparisons keep their verdict, the others show a
    direction. ``where``: name each outcome's results root (several roots hold the same experiment)."""
    found = [o for o in v.outcomes if o.status != MISSING]
    if not found:
        return Column(verdict_text(v, True))
    inside = [o for o in found if speaks(regime, o)]
    outside = [o for o in found if not speaks(regime, o)]
    parts, status = [], combine([o.status for o in inside]) if inside else MISSING
    if inside:
        parts.append(f"{label(status, True)}: " + "; ".join(_detail(o, where) for o in inside))
    if outside:
        parts.append(f"{rules.out_of_regime} (outside {regime.text()}), "
                     f"{DIRECTION.get(combine([o.status for o in outside]), 'no direction')}: "
                     + "; ".join(_detail(o, where) for o in outside))
    return Column(" | ".join(parts), status, v)


def _emulated_shape(exp: Experiment) -> tuple[int, int] | None:
    cl = (exp.records[0].get("cluster") or {}) if exp.records else {}
    if cl.get("scheduler") != "emulated" and not cl.get("emulated"):
        return None
    return int(cl.get("nodes") or 1), int(cl.get("ranks_per_node") or 0)


def _shape_text(exp: Experiment) -> str:
    s = _emulated_shape(exp)
    return f"{s[0]}x{s[1]} emulated" if s else "not emulated"


def _unselected(methods: dict[str, MethodMap]) -> dict[str, MethodMap]:
    # an emulated run is attention-level: its records have no variant, zero or model to select on
    return {n: MethodMap(m.method, {}, m.measured_as) for n, m in methods.items()}


def emulated_column(c: Claim, roots: list[Root], methods: dict[str, MethodMap], tables: dict[str, PaperTable],
                    rules: Rules) -> Column:
    """Column (c): the claim judged on the runs of an emulated cluster of the paper's shape, every copy."""
    want = c.emulated
    if not want.experiments:
        return Column(f"no emulated {want.text()} run: {want.why_not}")
    found = [e for r in roots for e in experiments([r], want.experiments)]
    fits = [e for e in found if _emulated_shape(e) == (want.nodes, want.ranks_per_node)]
    if not fits:
        seen = ", ".join(dict.fromkeys(f"{e.name} ({_shape_text(e)})" for e in found)) or \
            f"no records of {', '.join(want.experiments)}"
        return Column(f"no run on an emulated {want.text()} cluster (found: {seen})"
                      + (f"; {want.why_not}" if want.why_not else ""))
    ms = methods if c.kind == "steps" else _unselected(methods)
    v = judge(c, fits, ms, measured=True, tables=tables, patterns=want.experiments)
    return measured_column(v, c.regime, rules, where=True)


def suite_methods(c: Claim, methods: dict[str, MethodMap], tables: dict[str, PaperTable]) -> tuple[str, ...]:
    """The suite's methods a claim compares, as its measured runs realise them."""
    names = [r.method for r in tables[c.table].rows] if c.kind == "steps" else [c.method, *c.against]
    return tuple(dict.fromkeys(method_select(methods[n], True).get("method", methods[n].method) for n in names))


def validation_text(c: Claim, val: Validation, rules: Rules) -> str:
    if not c.validation:
        return f"{rules.not_validated}: {c.validation_why_not}"
    if not val.checks:
        return f"{rules.not_validated}: no emulation report of {', '.join(c.validation)} in the results"
    parts = [ch.text() for ch in val.checks]
    if val.unvalidated:
        parts.append(f"in no emulated run: {', '.join(val.unvalidated)}")
    return "; ".join(parts) + f" (bound |error| <= {val.target:.0%})"


def qualifier(c: Claim, val: Validation, rules: Rules) -> str:
    if val.trusted:
        return f"{rules.validated} (worst |error| {val.worst:.0%} <= {val.target:.0%} on the emulated cluster)"
    if val.trusted is False:
        return f"{rules.not_trusted} (off by up to {val.worst:.0%} on the emulated cluster; bound {val.target:.0%})"
    why = c.validation_why_not if not c.validation else \
        f"no emulated run has {', '.join(val.unvalidated)}" if val.unvalidated else "no emulation report"
    return f"{rules.not_validated} ({why})"


def headline(c: Claim, modelled: Verdict, val: Validation, in_regime: str, rules: Rules) -> str:
    """(b) qualified by (a); a claim the model cannot speak to takes its in-regime measurement."""
    measured = f"measured in the claim's regime: {label(in_regime, True)}" if in_regime != MISSING else ""
    if not c.modelled:
        if rules.without_model == "measured in regime" and measured:
            return f"{label(in_regime, True)}, measured in the claim's regime ({c.regime.text()}); the model " \
                   f"does not speak to it ({c.validation_why_not or c.why_not})"
        return f"not judged: no modelled evidence and no measurement in the claim's regime ({c.regime.text()})"
    if modelled.status == MISSING:
        return f"{label(MISSING, False)} at the paper's size" + (f"; {measured}" if measured else "")
    return f"{label(modelled.status, False)} (modelled at the paper's size); {qualifier(c, val, rules)}" + \
        _margin(modelled, val, rules) + (f"; {measured}" if measured else "")


def _margin(modelled: Verdict, val: Validation, rules: Rules) -> str:
    margins = [abs(r - 1) for o in modelled.outcomes for r in o.ratios]
    if not margins or val.worst is None or min(margins) >= val.worst:
        return ""
    return f"; {rules.inside_error} (smallest modelled margin {min(margins):.0%} < worst |error| {val.worst:.0%})"


@dataclass(frozen=True)
class Chain:
    claim: Claim
    headline: str
    validation: str        # (a)
    modelled: str          # (b)
    emulated: str          # (c)
    cpu: str               # (d)
    verdicts: tuple[Verdict, ...]     # the verdicts behind (b), (c) and (d), for the evidence links
    checks: Validation


def chain(c: Claim, *, measured_roots: list[Root], measured: Verdict, modelled: Verdict,
          methods: dict[str, MethodMap], tables: dict[str, PaperTable], rules: Rules) -> Chain:
    val = validate(measured_roots, c.validation, suite_methods(c, methods, tables))
    cpu = measured_column(measured, c.regime, rules)
    emu = emulated_column(c, measured_roots, methods, tables, rules)
    in_regime = combine([s for s in (cpu.in_regime, emu.in_regime) if s != MISSING])
    return Chain(c, headline(c, modelled, val, in_regime, rules), validation_text(c, val, rules),
                 verdict_text(modelled, False), emu.text, cpu.text,
                 tuple(v for v in (measured, modelled, emu.verdict) if v is not None), val)
