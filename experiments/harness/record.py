"""The suite's one record type: what ran (case), how long it took (timing), what it sent (comm), what it held
(memory), what it achieved (work, training, quality) and where it ran (provenance), with a schema version.

Every producer (the worker's measurement, the performance model, the kernel sweep, the perplexity runs,
pytest-benchmark's ``extra_info``, the driver and the executor for cases that did not run) builds a
``Record`` and hands it to ``write``; every consumer reads with ``read`` (records) or ``read_rows`` (the
flat rows pandas, the figures and the report use). On disk a record is one JSON line of its nested parts
(``to_json``); fields that are None are left out.

Each field has one flat name (``Part.ROW`` prefix + field name, or its ``row`` metadata): the row
vocabulary the tables, figures and report were written against (``time_median_s``, ``comm_fwd_bytes``,
``mem_peak_bytes``...). A record is filled through those names (``rec["time_median_s"] = t``,
``rec.update(...)``); a name no part declares is a ``ValueError``, so no untyped key can enter a record.
The row also carries the case's resolved config at its top level (``row``): a part's value wins, a config
key fills in where the part has none.

Schema versions: 3 (this module: nested parts, config once, the model's prediction as ``prediction``).
Records of versions 1 and 2 (flat, config copied to the top) are refused by ``read``; ``experiments.harness.
migrate`` converts a results root once (``burst-bench migrate <root>``).
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Iterable

SCHEMA_VERSION = 3
STATUSES = ("ok", "failed", "oom", "skipped")


def _row(name: str):
    """A field whose flat name is not its part's prefix + its name."""
    return field(default=None, metadata={"row": name})


@dataclass
class CasePart:
    """What ran: the case as the plan resolved it (``config``: every axis and setting, once)."""
    ROW: ClassVar[str] = ""
    experiment: str | None = None
    case_id: str | None = None
    method: str | None = None
    level: str | None = None
    mode: str | None = None
    kernel: str | None = None           # the local attention kernel that ran ("auto" where nothing ran)
    variant: str | None = None           # a model-level row (model_cases.ModelVariant)
    variant_label: str | None = None
    variant_of: str | None = None        # a model-only variant of this registry method
    ablation_step: int | None = None
    ablation_label: str | None = None
    config: dict | None = None


@dataclass
class Timing:
    """Step times (seconds): samples, median and interval (``timing.summarize``), the repeat policy."""
    ROW: ClassVar[str] = "time_"
    samples_s: list | None = None
    median_s: float | None = None
    ci_lo_s: float | None = None
    ci_hi_s: float | None = None
    ci_level: float | None = None
    ci_halfwidth_rel: float | None = None
    p10_s: float | None = None
    p90_s: float | None = None
    mean_s: float | None = None
    min_s: float | None = None
    max_s: float | None = None
    std_s: float | None = None
    model_s: float | None = None         # the performance model's predicted time
    mean_rank_s: float | None = None     # the mean rank's time, beside the slowest rank's (median_s)
    cpu_s_per_rank: list | None = None   # each rank's process CPU seconds per step (median over rounds)
    cpu_main_s_per_rank: list | None = None   # of it, the timing thread's (kernels, host work; not gloo's threads)
    # an emulated run's compute rate in the group's own rounds: the calibration's work timed beside the cases
    # (harness/reference.py: work, the slowest rank's samples, their median, each rank's CPU)
    reference: dict | None = None
    # and its memory rate: the memory stream timed after it (reference.memory_step_for: bytes a call, calls a
    # sample, the slowest rank's samples, their median, each rank's CPU)
    memory_reference: dict | None = None
    ttft_s: float | None = _row("ttft_s")   # decode: time to first token
    tpot_s: float | None = _row("tpot_s")   # decode: time per output token
    repeat_stop: str | None = _row("repeat_stop")
    repeat_policy: dict | None = _row("repeat_policy")
    rounds: int | None = _row("rounds")   # samples taken (the config's ``repeats`` is the minimum)
    # calls each sample ran back to back (timing.autorange; decode: consecutive tokens); samples are per call
    calls_per_sample: int | None = _row("calls_per_sample")
    interleaved_with: list | None = _row("interleaved_with")
    duration_s: float | None = _row("duration_s")


@dataclass
class Comm:
    """Bytes sent (max over ranks unless per rank), next to the method's formula."""
    ROW: ClassVar[str] = "comm_"
    fwd_bytes: int | None = None
    bwd_bytes: int | None = None
    fwd_bytes_per_rank: list | None = None
    bwd_bytes_per_rank: list | None = None
    fwd_formula_bytes: int | None = None
    bwd_formula_bytes: int | None = None
    bytes_by_kind: dict | None = None
    formula_by_kind: dict | None = None
    bytes_by_link_per_rank: list | None = None
    wait_s_per_rank: list | None = None
    notes: dict | None = None
    measured_over: str | None = None
    fsdp_formula_bytes: int | None = None
    layer_bytes: float | None = None
    layer_formula_by_kind: dict | None = None
    layer_formula_bytes: int | None = None
    not_counted: str | None = None
    bytes_source: str | None = _row("bytes_source")   # counted | formula (sends inside another package)


@dataclass
class Memory:
    """Peak memory (one definition: experiments.harness.memory) and the closed-form model beside it."""
    ROW: ClassVar[str] = "mem_"
    peak_bytes: int | None = None
    peak_bytes_per_rank: list | None = None
    inputs_bytes_per_rank: list | None = None
    start_bytes: int | None = None
    saved_bytes: int | None = None
    # GPU: max_memory_allocated and max_memory_reserved over the step, whole (memory.py; max over ranks)
    allocated_peak_bytes: int | None = None
    reserved_peak_bytes: int | None = None
    state_bytes_per_rank: list | None = None
    total_bytes: int | None = None
    parts_bytes: dict | None = None
    method: str | None = None
    definition: str | None = None
    measured_over: str | None = None
    model_bytes: int | None = None
    model_of: str | None = None
    model_error: str | None = None
    # inference (experiments/harness/inference_steps.py): K/V bytes each rank's cache holds, counted, and the
    # largest rank's formula; how many tokens of context fit at the hardware's usable memory (modelled)
    kv_bytes_per_rank: list | None = None
    kv_formula_bytes: int | None = None
    kv_capacity_tokens: int | None = None


@dataclass
class Work:
    """What the time bought: FLOPs and their rates, tokens, the layout's work balance."""
    ROW: ClassVar[str] = ""
    flops: float | None = None
    flops_scope: str | None = None
    flops_convention: str | None = None
    flops_matmul: float | None = None
    flops_attention: float | None = None
    tflops_total: float | None = None
    tflops_per_rank: float | None = None
    tflops_p10: float | None = None
    tflops_p90: float | None = None
    tokens_per_s: float | None = None
    tokens_per_s_per_rank: float | None = None
    mfu: float | None = None
    mfu_peak_flops: float | None = None
    mfu_peak_source: str | None = None
    work_rows_per_rank: list | None = None
    work_cols_per_rank: list | None = None
    work_imbalance_rows: float | None = None
    work_imbalance_cols: float | None = None
    skipped_blocks_per_rank: list | None = None
    live_entries_per_rank: list | None = None


@dataclass
class Training:
    """A model-level record's setup as it ran, its losses, and the perplexity runs' evaluation."""
    ROW: ClassVar[str] = ""
    model: str | None = None
    model_config: str | None = None
    model_params: int | None = None
    zero: bool | None = None
    zero_stage: int | None = None
    weights: str | None = None
    loss: str | None = None
    checkpoint: str | None = None            # the mode the blocks ran
    checkpoint_requested: str | None = None
    checkpoint_effective: str | None = None
    offload: str | bool | None = None
    losses: list | None = None
    train_steps: int | None = None
    train_losses: list | None = None
    lr: float | None = None
    corpus: str | None = None
    eval_tokens: int | None = None
    eval_windows: int | None = None
    perplexity: float | None = None
    perplexity_before: float | None = None
    perplexity_reference: float | None = None
    perplexity_reference_before: float | None = None
    perplexity_rel_diff: float | None = None
    perplexity_rtol: float | None = None
    perplexity_equal: bool | None = None
    reference: str | None = None
    reference_train_losses: list | None = None
    # model.loss_parity (model_parity.py): each step's loss against the reference's
    loss_rel_diff: float | None = None
    loss_rtol: float | None = None
    loss_rtol_reason: str | None = None
    loss_equal: bool | None = None


@dataclass
class Provenance:
    """Where and when: machine, commit and dirty flag, versions, hardware, cluster profile."""
    ROW: ClassVar[str] = ""
    timestamp: str | None = None
    machine: str | None = None
    source: str | None = None                 # "modelled" for the performance model's records
    hardware_profile: str | None = None
    git: dict | None = None
    versions: dict | None = None
    hardware: dict | None = None
    cluster: dict | None = None
    prediction: dict | None = None            # the model's breakdown, memory, assumptions and notes
    traceback: str | None = None


PARTS = {"case": CasePart, "timing": Timing, "comm": Comm, "memory": Memory, "work": Work,
         "training": Training, "provenance": Provenance}


def _flat_name(part: type, f: dataclasses.Field) -> str:
    return f.metadata.get("row") or part.ROW + f.name


# flat name -> (part, field): one table, derived from the dataclasses
FIELDS: dict[str, tuple[str, str]] = {}
for _p, _cls in PARTS.items():
    for _f in dataclasses.fields(_cls):
        _n = _flat_name(_cls, _f)
        assert _n not in FIELDS and _n not in ("schema", "status", "reason"), _n
        FIELDS[_n] = (_p, _f.name)

_TYPES = {"str": str, "int": int, "float": (int, float), "bool": bool, "list": (list, tuple), "dict": dict}


def _check(name: str, value: Any) -> Any:
    """``value`` if it fits the field's annotation (``X | None``), else a ValueError naming it."""
    part, fname = FIELDS[name]
    ann = next(f.type for f in dataclasses.fields(PARTS[part]) if f.name == fname)
    if value is None:
        return None
    kinds = [k.strip() for k in str(ann).split("|") if k.strip() != "None"]
    ok = any(isinstance(value, _TYPES[k]) and not (k in ("int", "float") and isinstance(value, bool))
             for k in kinds)
    if not ok:
        raise ValueError(f"record field {name!r}: value {value!r} must be {' or '.join(kinds)} or None")
    return list(value) if isinstance(value, tuple) else value


@dataclass
class Record:
    status: str
    reason: str = ""
    case: CasePart = field(default_factory=CasePart)
    timing: Timing = field(default_factory=Timing)
    comm: Comm = field(default_factory=Comm)
    memory: Memory = field(default_factory=Memory)
    work: Work = field(default_factory=Work)
    training: Training = field(default_factory=Training)
    provenance: Provenance = field(default_factory=Provenance)
    schema: int = SCHEMA_VERSION

    def __post_init__(self):
        if self.status not in STATUSES:
            raise ValueError(f"status={self.status!r} must be one of {STATUSES}")

    # ---- the flat vocabulary: rec[name], rec.get(name), rec[name] = v, rec.update(...)
    def __setitem__(self, name: str, value: Any) -> None:
        if name in ("status", "reason"):
            if name == "status" and value not in STATUSES:
                raise ValueError(f"status={value!r} must be one of {STATUSES}")
            setattr(self, name, value)
            return
        if name not in FIELDS:
            raise ValueError(f"record field {name!r} is not in the record schema "
                             "(experiments/harness/record.py: add it to the part it belongs to)")
        part, fname = FIELDS[name]
        setattr(getattr(self, part), fname, _check(name, value))

    def update(self, fields: dict | None = None, **kw) -> None:
        for k, v in {**(fields or {}), **kw}.items():
            self[k] = v

    def __getitem__(self, name: str) -> Any:
        row = self.row()
        if name not in row:
            raise KeyError(name)
        return row[name]

    def get(self, name: str, default: Any = None) -> Any:
        v = self.row().get(name)
        return default if v is None else v

    def __contains__(self, name: str) -> bool:
        return self.row().get(name) is not None

    def keys(self):
        return self.row().keys()

    def items(self):
        return self.row().items()

    def __iter__(self):
        return iter(self.row())

    def row(self) -> dict:
        """The flat row: every field by its flat name (None where not applicable), the config's keys filling
        in where no part has a value."""
        out = {"schema": self.schema, "status": self.status, "reason": self.reason}
        for name, (part, fname) in FIELDS.items():
            out[name] = getattr(getattr(self, part), fname)
        for k, v in (self.case.config or {}).items():
            if out.get(k) is None:
                out[k] = v
        return out

    # ---- on disk
    def to_json(self) -> dict:
        out: dict[str, Any] = {"schema": self.schema, "status": self.status, "reason": self.reason}
        for p in PARTS:
            vals = {k: v for k, v in dataclasses.asdict(getattr(self, p)).items() if v is not None}
            if vals:
                out[p] = vals
        return out

    @classmethod
    def from_json(cls, obj: dict, where: str = "record") -> "Record":
        schema = obj.get("schema")
        if schema != SCHEMA_VERSION:
            raise ValueError(f"{where}: schema {schema!r}; this suite reads schema {SCHEMA_VERSION} "
                             "(convert older results once: burst-bench migrate <results root>)")
        unknown = sorted(set(obj) - {"schema", "status", "reason", *PARTS})
        if unknown:
            raise ValueError(f"{where}: unknown record part(s) {unknown}; parts are {sorted(PARTS)}")
        rec = cls(status=obj["status"], reason=obj.get("reason") or "")
        for p, cls_ in PARTS.items():
            vals = obj.get(p) or {}
            names = {f.name: _flat_name(cls_, f) for f in dataclasses.fields(cls_)}
            bad = sorted(set(vals) - set(names))
            if bad:
                raise ValueError(f"{where}: unknown field(s) {bad} in part {p!r}")
            for k, v in vals.items():
                rec[names[k]] = v
        return rec

    @classmethod
    def from_row(cls, row: dict) -> "Record":
        rec = cls(status=row["status"], reason=row.get("reason") or "")
        rec.update({k: v for k, v in row.items() if k not in ("schema", "status", "reason")})
        return rec


REQUIRED = ("experiment", "case_id", "method", "level", "mode", "config", "timestamp", "git", "versions",
            "hardware", "machine")


def _complete(rec: Record) -> Record:
    missing = [k for k in REQUIRED if rec.row().get(k) is None]
    if missing:
        raise ValueError(f"record for {rec.case.case_id} lacks {missing}")
    return rec


def write(path: Path | str, rec: Record) -> None:
    """Append ``rec`` to the results file ``path`` as one line (one write in append mode: concurrent readers
    see whole lines), after checking it names what every record must."""
    _complete(rec)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        f.write(dumps(rec))
        f.flush()
        os.fsync(f.fileno())


def write_all(path: Path | str, records: Iterable[Record]) -> None:
    """``path`` holding exactly ``records`` (the performance model rewrites an experiment's file whole)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(dumps(_complete(r)) for r in records), encoding="utf-8")


def dumps(rec: Record) -> str:
    return json.dumps(rec.to_json(), sort_keys=True, default=str) + "\n"


def parse_lines(lines: Iterable[str], where: str) -> list[Record]:
    """Records of results lines; a torn line (a writer killed mid-line) is skipped."""
    out = []
    for i, line in enumerate(lines, 1):
        line = line.strip()
        if not line:
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            continue
        out.append(Record.from_json(obj, f"{where} line {i}"))
    return out


def read(path: Path | str) -> list[Record]:
    """Every record of a results file, in file (time) order."""
    p = Path(path)
    if not p.exists():
        return []
    return parse_lines(p.read_text(encoding="utf-8").splitlines(), str(p))


def read_rows(path: Path | str) -> list[dict]:
    return [r.row() for r in read(path)]
