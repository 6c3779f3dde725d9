"""Column (a) of the claims table: how far the performance model can be trusted for a claim's methods,
read from the emulated runs' own check of it. Every emulated run writes ``emulation_report.txt``
(``experiments.cluster.report``), whose model table (``perfmodel.emulated.validate.error_table``) gives
predicted / measured - 1 per method and N. The page reads that table rather than re-predicting: the
report measures nothing and the number shown is the one the run printed.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from ..cluster.report import REPORT_FILE
from ..perfmodel.emulated.validate import TARGET
from .evidence import Root, experiments

# the header error_table writes above its rows, and one of its rows: N, method, measured s, predicted s,
# pred/meas, error % (the columns after it, critical comm, load, flag and case, are not needed here)
_HEADER = "performance model (experiments.perfmodel) vs measured"
_ROW = re.compile(r"^\s*(\d+)\s+(\S+)\s+\d+\.\d+\s+\d+\.\d+\s+\d+\.\d+\s+([+-]\d+\.\d+)%")


def model_rows(text: str) -> list[tuple[int, str, float]]:
    """(N, method, error) of every row of a report's model table; [] when the report has none."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith(_HEADER)), None)
    if start is None:
        return []
    out = []
    for line in lines[start + 2:]:
        m = _ROW.match(line)
        if m is None:
            break
        out.append((int(m.group(1)), m.group(2), float(m.group(3)) / 100))
    return out


@dataclass(frozen=True)
class ModelCheck:
    """One emulated run's check of the model, for the methods of one claim."""
    experiment: str
    root: Root
    cluster: str                   # how the run was emulated, as its report's first line says
    seqlen: int | None             # the largest N the claim's methods ran at
    errors: tuple[tuple[str, float], ...]   # (method, the largest |error| of its rows at that N, signed)

    @property
    def worst(self) -> float | None:
        return max((abs(e) for _, e in self.errors), default=None)

    def text(self) -> str:
        where = f"{self.experiment} ({self.cluster}; {self.root.path.name})"
        if not self.errors:
            return f"{where}: none of the claim's methods"
        return f"{where} at N={self.seqlen}: " + ", ".join(f"{m} {e:+.0%}" for m, e in self.errors)


def _cluster(text: str) -> str:
    first = text.split("\n", 1)[0]
    return first.split(": ", 1)[-1].split(" (", 1)[0]


def check(exp_name: str, root: Root, text: str, methods: tuple[str, ...]) -> ModelCheck:
    rows = [r for r in model_rows(text) if r[1] in methods]
    top = max((n for n, _, _ in rows), default=None)
    worst: dict[str, float] = {}
    for n, m, e in rows:
        if n == top and abs(e) >= abs(worst.get(m, 0.0)):
            worst[m] = e
    return ModelCheck(exp_name, root, _cluster(text), top, tuple(sorted(worst.items())))


def checks(roots: list[Root], patterns: tuple[str, ...], methods: tuple[str, ...]) -> list[ModelCheck]:
    """Every copy of the named emulated experiments (each results root keeps its own: one per cluster
    profile) that has an emulation report."""
    out = []
    for root in roots:
        for exp in experiments([root], patterns):
            path = exp.path / REPORT_FILE
            if path.exists():
                out.append(check(exp.name, root, path.read_text(encoding="utf-8"), methods))
    return out


@dataclass(frozen=True)
class Validation:
    """Column (a): the checks of a claim's methods, and which of its methods no check has."""
    checks: tuple[ModelCheck, ...]
    unvalidated: tuple[str, ...]
    target: float = TARGET

    @property
    def worst(self) -> float | None:
        return max((c.worst for c in self.checks if c.worst is not None), default=None)

    @property
    def trusted(self) -> bool | None:
        """False: a method is outside the bound; True: every method checked and inside it; None: some
        method has no check."""
        if self.worst is not None and self.worst > self.target:
            return False
        return None if self.unvalidated or self.worst is None else True


def validate(roots: list[Root], patterns: tuple[str, ...], methods: tuple[str, ...]) -> Validation:
    cs = tuple(checks(roots, patterns, methods)) if patterns else ()
    seen = {m for c in cs for m, _ in c.errors}
    return Validation(cs, tuple(m for m in dict.fromkeys(methods) if m not in seen))
