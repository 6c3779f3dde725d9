"""The papers' claims as data (``experiments/paper/claims.yaml``): one sentence each, the methods it
compares (the papers' names, mapped by methods.yaml), the kind of verdict (``verdict.KINDS``), where
its evidence is looked for, the regime it speaks of, the emulated runs that validate the model for it and
the emulated cluster of the paper's shape. How those columns make one headline is data too
(``experiments/paper/verdict_rules.yaml``, ``Rules``). Checked on load: a ValueError naming the file,
the key and the rule.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..harness.schema import FileErr, from_mapping
from .paper import CLAIMS_FILE, PAPER_DIR, RULES_FILE, MethodMap, _read_yaml, load_methods

KINDS = ("less_bytes", "speedup", "speedup_best", "equal_loss", "steps", "ordering")
HARDWARE = ("any", "gpu")
WITHOUT_MODEL = ("measured in regime", "none")


def _kind(k: str) -> str | None:
    return None if k in KINDS else f"unknown kind {k!r}; known: {list(KINDS)}"


def _hardware(h: str) -> str | None:
    return None if h in HARDWARE else f"unknown hardware {h!r}; known: {list(HARDWARE)}"


def _at_least(lo: int):
    return lambda v: None if v >= lo else f"must be >= {lo}, got {v}"


def _tokens(n: int) -> str:
    """A token count as the papers write it: 4K, 128K, 1M."""
    for unit, size in (("M", 2 ** 20), ("K", 2 ** 10)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


@dataclass(frozen=True)
class Regime:
    """What a claim speaks of. A measurement below any bound (fewer tokens or ranks, fewer nodes, a CPU
    where the claim is about GPUs) shows a direction at its own scale, never a verdict on the claim."""
    min_tokens: int = field(default=0, metadata={"check": _at_least(0)})
    min_ranks: int = field(default=0, metadata={"check": _at_least(0)})
    min_nodes: int = field(default=0, metadata={"check": _at_least(0)})
    hardware: str = field(default="any", metadata={"check": _hardware})
    source: str = ""                           # where the paper states it

    @property
    def unbounded(self) -> bool:
        return not (self.min_tokens or self.min_ranks or self.min_nodes) and self.hardware == "any"

    def text(self) -> str:
        if self.unbounded:
            return "any size"
        bits = [f">= {_tokens(self.min_tokens)} tokens" if self.min_tokens else "", f">= {self.min_ranks} ranks"
                if self.min_ranks else "", f">= {self.min_nodes} nodes" if self.min_nodes else "",
                "on GPUs" if self.hardware == "gpu" else ""]
        return ", ".join(b for b in bits if b)


@dataclass(frozen=True)
class PaperShape:
    """The paper's cluster at emulated scale: the shape an emulated run must have to fill column (c)."""
    nodes: int = field(metadata={"check": _at_least(1)})
    ranks_per_node: int = field(metadata={"check": _at_least(1)})
    experiments: tuple[str, ...] = ()          # measured experiment names or globs run on such a cluster
    why_not: str = ""                          # why no emulated run of that shape exists, when none can

    def text(self) -> str:
        return f"{self.nodes}x{self.ranks_per_node}"


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
    regime: Regime = field(default_factory=Regime)
    emulated: PaperShape | None = None         # required: column (c)
    validation: tuple[str, ...] = ()           # emulated experiments whose emulation_report.txt is column (a)
    validation_why_not: str = ""               # why no emulated run validates the model for this claim


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
    if c.emulated is None:
        raise err(f"[{i}].emulated", "every claim names its paper's cluster at emulated scale (nodes, "
                                     "ranks_per_node) for column (c)")
    if not c.emulated.experiments and not c.emulated.why_not:
        raise err(f"[{i}].emulated.why_not", "without emulated experiments, say why none can be run")
    if not c.validation and not c.validation_why_not:
        raise err(f"[{i}].validation_why_not", "without validation experiments, say why the model is not "
                                               "validated for this claim")


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


@dataclass(frozen=True)
class Rules:
    """How the claims table reads its columns into one headline (``experiments/paper/verdict_rules.yaml``)."""
    out_of_regime: str                  # what a measurement outside the claim's regime is labelled, at most
    not_validated: str                  # the headline's qualifier where no emulated run has a claim's method
    validated: str                      # ... where every method's |error| is inside the validation bound
    not_trusted: str                    # ... where one is outside it
    inside_error: str                   # ... where a modelled time ratio is nearer 1 than the model's error
    without_model: str = field(default="measured in regime", metadata={"check": lambda v: None if v in
                               WITHOUT_MODEL else f"unknown rule {v!r}; known: {list(WITHOUT_MODEL)}"})


def load_rules(paper_dir: Path = PAPER_DIR) -> Rules:
    path = paper_dir / RULES_FILE
    raw = _read_yaml(path)
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: must be a mapping of the verdict rules")
    return from_mapping(Rules, raw, FileErr(path))
