"""The papers' published values as typed data: ``experiments/paper/*.yaml``, transcribed from the papers
(each file's ``source``), checked on load like the specs (a ValueError naming the file, the key and the rule).

Each table is rows (the paper's method or configuration) x columns (a setting); every cell becomes a
``PaperValue`` that knows its source (table, row, column) and the records it is compared with: the
suite method of ``methods.yaml`` (the one place where the papers' names meet the suite's) and the
record fields both the column and the row select.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from baselines.registry import METHODS

from ..harness.env import REPO
from ..harness.schema import FileErr, fields_from, from_mapping
from ..model_only import MODEL_ONLY
from .quantities import QUANTITIES

PAPER_DIR = Path(__file__).resolve().parent.parent / "paper"
METHODS_FILE = "methods.yaml"
CLAIMS_FILE = "claims.yaml"
RULES_FILE = "verdict_rules.yaml"       # how a claim's columns make its headline (report/claims.py)
READINGS_SUFFIX = "_readings.yaml"      # a benchmark's values read off its figures, not a table (report/readings.py)
OOM = "OOM"


def _known_quantity(q: str | None) -> str | None:
    return None if q is None or q in QUANTITIES else f"unknown quantity {q!r}; known: {sorted(QUANTITIES)}"


def _suite_method(m: str) -> str | None:
    return None if m in METHODS or m in MODEL_ONLY else \
        f"{m!r} is neither a registry method (baselines.registry) nor a model-only variant {sorted(MODEL_ONLY)}"


@dataclass(frozen=True)
class MethodMap:
    """A paper's method name -> the suite's method and the record fields that pick its records."""
    method: str = field(metadata={"check": _suite_method})
    select: dict = field(default_factory=dict)
    measured_as: dict = field(default_factory=dict)    # how a measured run realises it; a model-only variant's: its own


@dataclass(frozen=True)
class Column:
    label: str
    select: dict = field(default_factory=dict)
    quantity: str | None = field(default=None, metadata={"check": _known_quantity})


@dataclass(frozen=True)
class Row:
    label: str
    method: str                 # a key of methods.yaml
    values: tuple[Any, ...]     # a number, "OOM", or null where the source gives none


@dataclass(frozen=True)
class PaperTable:
    id: str
    paper: str
    source: str
    title: str
    quantity: str = field(metadata={"check": _known_quantity})
    columns: tuple[Column, ...]
    rows: tuple[Row, ...]
    select: dict = field(default_factory=dict)
    modelled: tuple[str, ...] = ()       # experiment names or globs under results/modelled/
    measured: tuple[str, ...] = ()       # experiment names or globs under the measured roots
    figures: tuple[str, ...] = ()        # figure file globs drawn for those experiments
    transposed: bool = False             # the paper prints methods as columns, settings as rows
    order: int = 100                     # where the page shows it: the papers' own order
    path: str = ""

    @property
    def path_rel(self) -> str:
        """The YAML file relative to the repository (the page links it; never an absolute path)."""
        p = Path(self.path).resolve()
        return p.relative_to(REPO).as_posix() if p.is_relative_to(REPO) else p.name


@dataclass(frozen=True)
class PaperValue:
    table: PaperTable
    row: Row
    column: Column
    value: float | str | None
    method: MethodMap

    @property
    def quantity(self) -> str:
        return self.column.quantity or self.table.quantity

    @property
    def source(self) -> str:
        r, c = (self.column.label, self.row.label) if self.table.transposed else (self.row.label, self.column.label)
        return f"{self.table.source}, row {r!r}, column {c!r}"

    @property
    def select(self) -> dict:
        """Record fields that pick this cell's records: table, column, then the method's own."""
        return {**self.table.select, **self.column.select, **self.method.select, "method": self.method.method}


def _read_yaml(path: Path) -> Any:
    try:
        return yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ValueError(f"{path}: not valid YAML: {e}") from None


def load_methods(paper_dir: Path = PAPER_DIR) -> dict[str, MethodMap]:
    path = paper_dir / METHODS_FILE
    raw = _read_yaml(path)
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: must be a mapping of the papers' method names")
    return {name: from_mapping(MethodMap, spec, FileErr(path), prefix=f"{name}.") for name, spec in raw.items()}


def _check_table(t: PaperTable, methods: dict[str, MethodMap], err: FileErr) -> None:
    for i, row in enumerate(t.rows):
        if row.method not in methods:
            raise err(f"rows[{i}].method", f"{row.method!r} is not a method of {METHODS_FILE}: {sorted(methods)}")
        if len(row.values) != len(t.columns):
            raise err(f"rows[{i}].values", f"{len(row.values)} values for {len(t.columns)} columns")
        for v in row.values:
            if not (v is None or v == OOM or (isinstance(v, (int, float)) and not isinstance(v, bool))):
                raise err(f"rows[{i}].values", f"{v!r} must be a number, {OOM!r} or null")


def load_table(path: Path, methods: dict[str, MethodMap]) -> PaperTable:
    raw = _read_yaml(path)
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: a paper table must be a YAML mapping")
    err = FileErr(path)
    table = PaperTable(**fields_from(PaperTable, raw, err, skip=("path",)), path=str(path))
    _check_table(table, methods, err)
    return table


def load_tables(paper_dir: Path = PAPER_DIR) -> list[PaperTable]:
    methods = load_methods(paper_dir)
    files = sorted(p for p in paper_dir.glob("*.yaml") if p.name not in (METHODS_FILE, CLAIMS_FILE, RULES_FILE)
                   and not p.name.endswith(READINGS_SUFFIX))
    tables = sorted((load_table(p, methods) for p in files), key=lambda t: (t.order, t.id))
    ids = [t.id for t in tables]
    dup = sorted({i for i in ids if ids.count(i) > 1})
    if dup:
        raise ValueError(f"{paper_dir}: table id {dup[0]!r} is used by more than one file")
    return tables


def values(table: PaperTable, methods: dict[str, MethodMap]) -> list[PaperValue]:
    """Every cell of ``table`` with its source and its suite mapping, row by row."""
    return [PaperValue(table, row, col, v, methods[row.method])
            for row in table.rows for col, v in zip(table.columns, row.values)]
