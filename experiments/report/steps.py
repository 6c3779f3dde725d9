"""The ablation's verdict: does each cumulative step move tokens/s and memory the way the paper's does?

A step counts where the paper's change is larger than ``FLAT`` (smaller changes are the paper's noise,
not a claim); ours must move the same way, by more than its interval where the records have one.
"""
from __future__ import annotations

from .compare import CONTRADICTED, INCONCLUSIVE, MISSING, NO_INTERVAL, REPRODUCED, combine, method_select
from .evidence import Experiment, select
from .paper import MethodMap, PaperTable
from .quantities import QUANTITIES

FLAT = 0.02


def _ours(table: PaperTable, exp: Experiment, methods, measured: bool) -> list[dict | None]:
    out = []
    # the table's select names the paper's size (14B, 1M tokens, 32 GPUs): the modelled records at that
    # size; a measured mirror runs at CPU scale, so there only the rows' own selects apply
    size = {} if measured else table.select
    for row in table.rows:
        recs = [r for r in select(exp.records, {**size, **method_select(methods[row.method], measured)})
                if r.get("status") == "ok"]
        out.append(recs[0] if recs else None)
    return out


def _step(q, before: dict, after: dict, paper_change: float, measured: bool) -> str:
    a, b = q.read(before), q.read(after)
    if a is None or b is None:
        return MISSING
    ours = b / a - 1
    if measured and q.timing:
        ia, ib = q.interval(before), q.interval(after)
        if ia is None or ib is None:
            return NO_INTERVAL
        if ib[0] <= ia[1] and ia[0] <= ib[1]:
            return INCONCLUSIVE
    # the paper's step moved (by more than FLAT): ours must move the same way; not moving at all is not
    # agreeing with a decrease
    return REPRODUCED if ours * paper_change > 0 else CONTRADICTED


def steps_outcome(table: PaperTable, exp: Experiment, methods: dict[str, MethodMap], measured: bool):
    """(status, detail) for one experiment holding the ablation's rows."""
    ours = _ours(table, exp, methods, measured)
    statuses, agree, counted = [], 0, 0
    for ci, col in enumerate(table.columns):
        q = QUANTITIES[col.quantity or table.quantity]
        for i in range(1, len(table.rows)):
            p0, p1 = table.rows[i - 1].values[ci], table.rows[i].values[ci]
            if not all(isinstance(v, (int, float)) for v in (p0, p1)) or abs(p1 / p0 - 1) <= FLAT:
                continue
            if ours[i - 1] is None or ours[i] is None:
                continue
            s = _step(q, ours[i - 1], ours[i], p1 / p0 - 1, measured)
            statuses.append(s)
            counted += 1
            agree += s == REPRODUCED
    if not counted:
        return MISSING, f"{exp.name}: no two consecutive ablation rows in the records"
    return combine(statuses), f"{exp.name}: {agree} of {counted} step changes (tokens/s, memory) go the paper's way"
