"""The papers' claims as data (``experiments/paper/claims.yaml``): one sentence each, the methods it
compares (the papers' names, mapped by methods.yaml), the kind of verdict (``verdict.KINDS``) and where
its evidence is looked for. Checked on load: a ValueError naming the file, the key and the rule.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..harness.schema import FileErr, from_mapping
from .paper import CLAIMS_FILE, PAPER_DIR, MethodMap, _read_yaml, load_methods

KINDS = ("less_bytes", "speedup", "speedup_best", "equal_loss", "steps", "ordering")


def _kind(k: str) -> str | None:
    return None if k in KINDS else f"unknown kind {k!r}; known: {list(KINDS)}"


@dataclass(frozen=True)
class Claim:
    id: str
    paper: str
    claim: str                                 # the claim in one sentence
    kind: str = field(metadata={"check": _kind})
    method: str = ""                           # a methods.yaml name (not for kind steps)
    against: tuple[str, ...] = ()
    paper_value: float | None = None
    tolerance: float | None = None             # equal_loss: the largest relative spread that is "equal"
    measured: tuple[str, ...] = ()             # experiment names or globs, measured roots
    modelled: tuple[str, ...] = ()             # experiment names or globs, results/modelled/
    select: dict = field(default_factory=dict)
    table: str = ""                            # the paper table (experiments/paper/<id>) it is about
    why_not: str = ""                          # why evidence may be missing here (shown with "not measurable")


def _check(c: Claim, methods: dict[str, MethodMap], tables: set[str], err: FileErr, i: int) -> None:
    for key, name in [("method", c.method)] + [("against", a) for a in c.against]:
        if name and name not in methods:
            raise err(f"[{i}].{key}", f"{name!r} is not a method of methods.yaml")
    if c.kind != "steps" and not (c.method and c.against):
        raise err(f"[{i}].against", f"kind {c.kind} compares a method with at least one other")
    if c.kind == "equal_loss" and c.tolerance is None:
        raise err(f"[{i}].tolerance", "kind equal_loss needs the relative spread that counts as equal")
    if c.table and c.table not in tables:
        raise err(f"[{i}].table", f"{c.table!r} is not a paper table id: {sorted(tables)}")


def load_claims(table_ids: set[str], paper_dir: Path = PAPER_DIR) -> list[Claim]:
    path = paper_dir / CLAIMS_FILE
    raw = _read_yaml(path)
    if not isinstance(raw, list):
        raise ValueError(f"{path}: must be a list of claims")
    err, methods = FileErr(path), load_methods(paper_dir)
    claims = [from_mapping(Claim, c, err, prefix=f"[{i}].") for i, c in enumerate(raw)]
    for i, c in enumerate(claims):
        _check(c, methods, table_ids, err, i)
    return claims
