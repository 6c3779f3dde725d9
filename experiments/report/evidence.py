"""Where the report's evidence comes from: every results folder that exists, found generically (no list of
files), and the records of the experiments a paper table or claim names (names or glob patterns).

Roots, in the order a same-named experiment is taken from: this machine's run (``results/<machine>/``),
other machines' runs, ``results/gpu_check/``, the committed ``results/reference/<machine>/``; the
performance model's ``results/modelled/`` is a class of its own. A run on this machine supersedes the
reference records of the same experiment, so the page shows the newest measurement.
"""
from __future__ import annotations

import fnmatch
import functools
from dataclasses import dataclass
from pathlib import Path

from ..harness import results as R
from ..harness.env import REPO

RECORD_FILES = (R.RESULTS_FILE, "variants.jsonl")   # variants: the perf model's model-only rows
_RANK = {"this machine": 0, "other machine": 1, "gpu check": 2, "reference": 3, "modelled": 4}


@dataclass(frozen=True)
class Root:
    path: Path
    kind: str                 # this machine | other machine | gpu check | reference | modelled
    base: Path | None = None  # the results base it was found under

    @property
    def rel(self) -> str:
        """The root relative to the repository (or, outside it, to its results base's parent): what the
        page prints; never an absolute path."""
        p = self.path.resolve()
        if p.is_relative_to(REPO):
            return p.relative_to(REPO).as_posix()
        anchor = (self.base or p).resolve().parent
        return p.relative_to(anchor).as_posix() if p.is_relative_to(anchor) else p.name


@dataclass(frozen=True)
class Experiment:
    root: Root
    name: str
    records: tuple[dict, ...]

    @property
    def rel(self) -> str:
        return f"{self.root.rel}/{self.name}"

    @property
    def path(self) -> Path:
        return self.root.path / self.name


def _kind(path: Path, base: Path, machine: str) -> str:
    first = path.relative_to(base).parts[0] if path != base else ""
    if first in ("modelled", "reference"):
        return first
    if first == "gpu_check":
        return "gpu check"
    return "this machine" if path.name == machine else "other machine"


def find_roots(base: Path = R.RESULTS_BASE, machine: str | None = None) -> list[Root]:
    machine = machine or R.current_machine()
    roots = [Root(p, _kind(p, base, machine), base) for p in R.result_roots(base) if p != base]
    return sorted(roots, key=lambda r: (_RANK[r.kind], r.rel))


@functools.lru_cache(maxsize=None)
def _read(folder: Path) -> tuple[dict, ...]:
    recs = []
    for name in RECORD_FILES:
        recs.extend(R.latest_by_case(R.read_records(folder / name)).values())
    return tuple(recs)     # rows (record.Record.row): the config's keys at the top, as the papers' selects use


def experiments(roots: list[Root], patterns: tuple[str, ...]) -> list[Experiment]:
    """Experiments matching ``patterns`` (in pattern order), each from the first root that has it."""
    out: dict[str, Experiment] = {}
    for pat in patterns:
        for root in roots:
            for d in sorted(p for p in root.path.iterdir() if p.is_dir() and not p.name.startswith(".")):
                if fnmatch.fnmatchcase(d.name, pat) and d.name not in out and (d / R.RESULTS_FILE).exists():
                    out[d.name] = Experiment(root, d.name, _read(d))
    return list(out.values())


def select(records, sel: dict) -> list[dict]:
    """Records whose fields equal ``sel``'s. A key a record does not have is not applied (attention-level
    records have no ``zero`` or ``model``); without a ``kernel`` key, records of the ``math`` kernel
    are left out, since they are the papers' "without LAO / FlashAttention" rows, not the method's."""
    def has(r: dict, k: str) -> bool:
        # a row names every record field (None where unset): a key "a record has" is a value or a config key
        return r.get(k) is not None or k in (r.get("config") or {})

    def ok(r: dict) -> bool:
        if "kernel" not in sel and r.get("kernel") == "math":
            return False
        return all(r.get(k) == v for k, v in sel.items() if has(r, k))
    return [r for r in records if ok(r)]


def regime(records) -> str:
    """How the records ran: modelled (hardware profile), on GPUs, on an emulated cluster, or on loopback."""
    recs = list(records)
    if not recs:
        return "no records"
    r = recs[0]
    if r.get("source") == "modelled":
        return f"modelled for {r.get('hardware_profile') or (r.get('hardware') or {}).get('profile', '?')}"
    cl, hw = r.get("cluster") or {}, r.get("hardware") or {}
    if hw.get("gpu_count"):
        return f"GPU: {hw.get('gpu_count')} x {hw.get('gpu_name')}"
    if cl.get("scheduler") == "emulated":
        return f"emulated cluster {cl.get('profile')} on CPU ({hw.get('summary', '')})"
    return f"loopback, CPU ({hw.get('summary', 'gloo')})"
