"""The performance model against the paper, cell by cell: the modelled value at the paper's size, its
relative error, and whether the two agree on out-of-memory. Shown as it is: the model is never tuned
toward these numbers (experiments/paper/), so this is its honest error."""
from __future__ import annotations

import statistics
from dataclasses import dataclass

from .compare import method_select
from .evidence import Experiment, select
from .paper import OOM, MethodMap, PaperTable, PaperValue, values
from .quantities import QUANTITIES


@dataclass(frozen=True)
class Cell:
    paper: PaperValue
    record: dict | None
    ours: float | None          # the modelled value, None when OOM or absent

    @property
    def status(self) -> str | None:
        return self.record.get("status") if self.record else None

    @property
    def error(self) -> float | None:
        p = self.paper.value
        return self.ours / p - 1 if isinstance(p, (int, float)) and p and self.ours is not None else None

    @property
    def oom_agrees(self) -> bool | None:
        """Both say OOM, or both ran; None where either side has nothing to say."""
        if self.status not in ("ok", "oom") or self.paper.value is None:
            return None
        return (self.paper.value == OOM) == (self.status == "oom")

    def text(self) -> str:
        if self.record is None:
            return "not modelled"
        if self.status == "oom":
            return "OOM" + (" (agrees)" if self.paper.value == OOM else " (paper ran)")
        if self.ours is None:
            return self.status or "?"
        err = self.error
        tail = f" ({err:+.0%})" if err is not None else " (paper: OOM)" if self.paper.value == OOM else ""
        return f"{self.ours:.4g}{tail}"


def cells(table: PaperTable, methods: dict[str, MethodMap], exps: list[Experiment]) -> list[Cell]:
    out = []
    for pv in values(table, methods):
        sel = {**table.select, **pv.column.select, **method_select(pv.method, measured=False)}
        rec = next((r for e in exps for r in select(e.records, sel) if r.get("status") in ("ok", "oom")), None)
        ours = QUANTITIES[pv.quantity].read(rec) if rec and rec.get("status") == "ok" else None
        out.append(Cell(pv, rec, ours))
    return out


@dataclass(frozen=True)
class Summary:
    compared: int
    median_abs: float | None
    worst: Cell | None
    oom_agree: int
    oom_known: int

    def text(self) -> str:
        if not self.compared and not self.oom_known:
            return "nothing to compare (no modelled records at the paper's cells)"
        med = f"median |error| {self.median_abs:.0%}" if self.median_abs is not None else "no numeric cell"
        worst = (f", worst {self.worst.error:+.0%} ({self.worst.paper.row.label}, {self.worst.paper.column.label})"
                 if self.worst else "")
        return f"{self.compared} cells: {med}{worst}; OOM agreement {self.oom_agree} of {self.oom_known} cells"


def summarise(cs: list[Cell]) -> Summary:
    num = [c for c in cs if c.error is not None]
    worst = max(num, key=lambda c: abs(c.error)) if num else None
    known = [c for c in cs if c.oom_agrees is not None]
    return Summary(len(num), statistics.median(abs(c.error) for c in num) if num else None, worst,
                   sum(c.oom_agrees for c in known), len(known))
