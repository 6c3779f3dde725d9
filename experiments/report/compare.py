"""Two methods' records at the same shape, and what their times say: the speedup with its interval
(``harness.speedup``, the one definition the summaries, figures and emulator reports use). A difference
inside the interval is not a speedup; a measured pair without an interval decides nothing (modelled
records are deterministic: their exact ratio decides by its value).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..harness.speedup import MODELLED, speedup
from ..model_only import MODEL_ONLY
from .evidence import select
from .paper import MethodMap

# the axes two records must share to be compared (all but the method and what realises it)
SHAPE_KEYS = ("mode", "seqlen", "world_size", "batch", "heads", "head_dim", "dtype", "mask", "model")
DONE = ("ok", "oom")

REPRODUCED, CONTRADICTED, INCONCLUSIVE, NO_INTERVAL, MISSING = (
    "reproduced", "contradicted", "inconclusive", "no interval", "not measurable")


def shape(rec: dict) -> tuple:
    # a model-level record's ``model`` may be its whole config: its name is the axis
    return tuple((v.get("name") if isinstance(v, dict) else v) for v in (rec.get(k) for k in SHAPE_KEYS))


def method_select(m: MethodMap, measured: bool) -> dict:
    """Record fields of a paper method: a model-only variant is realised by a kernel in a measured run."""
    realised = m.measured_as or (MODEL_ONLY[m.method].measured_as if m.method in MODEL_ONLY else {})
    if measured and realised:
        return {**m.select, **realised}
    return {**m.select, "method": m.method}


def by_shape(records, m: MethodMap, measured: bool, extra: dict) -> dict[tuple, dict]:
    out: dict[tuple, dict] = {}
    for r in select(records, {**extra, **method_select(m, measured)}):
        if r.get("status") in DONE:
            out.setdefault(shape(r), r)
    return out


def largest_common(tables: list[dict[tuple, dict]]) -> tuple | None:
    """The shape with the largest sequence length that every method has (ok or OOM)."""
    common = set(tables[0]).intersection(*tables[1:]) if tables else set()
    return max(common, key=lambda s: (s[1] or 0, s[2] or 0, str(s))) if common else None


@dataclass(frozen=True)
class Ratio:
    """t(slower) / t(faster-claimed): > 1 means the claimed method is faster."""
    value: float | None
    lo: float | None
    hi: float | None
    status: str
    note: str = ""

    def text(self) -> str:
        if self.value is None:
            return self.note
        iv = f" [{self.lo:.2f}, {self.hi:.2f}]" if self.lo is not None else ""
        return f"{self.value:.2f}x{iv}" + (f" ({self.note})" if self.note else "")


def time_ratio(fast: dict, slow: dict) -> Ratio:
    """Speedup of ``fast`` over ``slow`` (``harness.speedup``) as a verdict; out of memory decides by itself."""
    if fast["status"] == "oom" or slow["status"] == "oom":
        if fast["status"] == slow["status"]:
            return Ratio(None, None, None, INCONCLUSIVE, "both out of memory")
        return Ratio(None, None, None, REPRODUCED if slow["status"] == "oom" else CONTRADICTED,
                     f"{(slow if slow['status'] == 'oom' else fast)['method']} out of memory")
    s = speedup(fast, slow)
    faster = s.faster()
    status = REPRODUCED if faster else CONTRADICTED if faster is False else INCONCLUSIVE
    if s.how == MODELLED:
        return Ratio(s.value, None, None, status, "modelled")
    if not s.has_interval:
        return Ratio(s.value, None, None, NO_INTERVAL, "no interval: decides nothing")
    return Ratio(s.value, s.lo, s.hi, status, "" if status != INCONCLUSIVE else "within the interval")


def _base(statuses: list[str]) -> list[str]:
    """Combined statuses back into the comparisons they stand for, so combining nests."""
    out: list[str] = []
    for s in statuses:
        if s == "mixed":
            out += [REPRODUCED, CONTRADICTED]
        elif s.endswith(" in part"):
            out += [s[: -len(" in part")], INCONCLUSIVE]
        else:
            out.append(s)
    return out


def combine(statuses: list[str]) -> str:
    """One verdict from several comparisons: agreement decides, disagreement is said."""
    statuses = _base(statuses)
    conclusive = {s for s in statuses if s in (REPRODUCED, CONTRADICTED)}
    if not statuses or all(s == MISSING for s in statuses):
        return MISSING
    if conclusive == {REPRODUCED, CONTRADICTED}:
        return "mixed"
    if not conclusive:
        return NO_INTERVAL if all(s in (NO_INTERVAL, MISSING) for s in statuses) else INCONCLUSIVE
    (only,) = conclusive
    return only if all(s == only for s in statuses if s != MISSING) else f"{only} in part"
