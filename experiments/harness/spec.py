"""Experiment specs: YAML -> typed dataclasses, validated on load.

A spec names the methods (registry names), the sweep axes, what to measure,
warm-up/repeat counts, the seed and the target. Every error names the file,
the key and the rule, and is a ``ValueError``.

    name: fig2_train_7b_8gpu          # results/<name>/
    description: ...
    paper_ref: BurstAttention Fig. 2
    methods: [burst, ring, ...]
    baseline: ring                    # speedups in figures are relative to it
    sweep: {seqlen: [...], world_size: [8], batch: 1, heads: 32, kv_heads: 32,
            head_dim: 128, dtype: bfloat16, causal: true, layout: zigzag}
    measure: {modes: [fwd_bwd], level: op, memory: true, comm: true}
    exclude: [{method: ulysses, world_size: 16}]   # optional: drop combinations explicitly
    warmup: 2
    repeats: 10
    seed: 0
    target: a100_8                    # "cpu", "local" or experiments/profiles/<name>.yaml
    timeouts: {case_s: 900, pg_s: 300}

Every sweep axis takes a scalar or a list; the cases are the Cartesian product
(minus ``exclude``). A method name must be registered in ``baselines.METHODS``.
A registered method that cannot run on this machine (an adapter whose package
is missing) has its cases recorded as skipped with the reason; skipped cases
are re-evaluated by every run.
"""
from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from baselines.registry import DTYPES, METHODS, AttnShape
from burst_impl.layout import LAYOUTS

from .flops import MODES
from ..cluster.profile import Profile, load_profile

EXPERIMENTS_DIR = Path(__file__).resolve().parents[1]
LEVELS = ("op", "block")
AXES = ("seqlen", "world_size", "batch", "heads", "kv_heads", "head_dim", "dtype", "causal", "layout")
_AXIS_TYPES = {"seqlen": int, "world_size": int, "batch": int, "heads": int, "kv_heads": int,
               "head_dim": int, "dtype": str, "causal": bool, "layout": str}
_TOP_KEYS = {"name", "description", "paper_ref", "methods", "baseline", "sweep", "measure", "exclude",
             "warmup", "repeats", "seed", "target", "timeouts"}
_MEASURE_KEYS = {"modes", "level", "memory", "comm"}
_TIMEOUT_KEYS = {"case_s", "pg_s"}


@dataclass(frozen=True)
class Sweep:
    seqlen: tuple[int, ...]
    world_size: tuple[int, ...] = (1,)
    batch: tuple[int, ...] = (1,)
    heads: tuple[int, ...] = (32,)
    kv_heads: tuple[int | None, ...] = (None,)   # None: equal to heads (MHA)
    head_dim: tuple[int, ...] = (128,)
    dtype: tuple[str, ...] = ("bfloat16",)
    causal: tuple[bool, ...] = (True,)
    layout: tuple[str, ...] = ("contiguous",)


@dataclass(frozen=True)
class Measure:
    modes: tuple[str, ...] = ("fwd_bwd",)   # forward | backward | fwd_bwd
    level: str = "op"                       # op: the attention operator; block: attention block
    memory: bool = True                     # measure peak memory in a separate untimed step
    comm: bool = True                       # count bytes sent (burst_impl.comm.count_bytes)


@dataclass(frozen=True)
class Timeouts:
    case_s: float = 600.0    # wall clock per case (watchdog in the worker, backstop in the runner)
    pg_s: float = 120.0      # process-group timeout: a rank stuck in a collective errors out


@dataclass(frozen=True)
class Case:
    """One measurement: one method, one shape, one mode. One record in the results."""

    experiment: str
    method: str
    level: str
    mode: str
    batch: int
    seqlen: int
    heads: int
    kv_heads: int
    head_dim: int
    world_size: int
    dtype: str
    causal: bool
    layout: str
    warmup: int
    repeats: int
    seed: int
    measure_memory: bool = True
    measure_comm: bool = True
    case_timeout_s: float = 600.0
    pg_timeout_s: float = 120.0

    @property
    def shape(self) -> AttnShape:
        return AttnShape(batch=self.batch, seqlen=self.seqlen, heads=self.heads, kv_heads=self.kv_heads,
                         head_dim=self.head_dim, world_size=self.world_size, dtype=self.dtype,
                         causal=self.causal, layout=self.layout)

    @property
    def case_id(self) -> str:
        """Stable key for resume: what is measured, not how often."""
        mask = "causal" if self.causal else "full"
        return (f"{self.method}.{self.level}.{self.mode}.N{self.seqlen}.G{self.world_size}.B{self.batch}"
                f".Z{self.heads}.kv{self.kv_heads}.d{self.head_dim}.{self.dtype}.{mask}.{self.layout}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Case":
        return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls) if f.name in d})


@dataclass(frozen=True)
class Spec:
    name: str
    path: str
    methods: tuple[str, ...]
    sweep: Sweep
    measure: Measure
    target: str
    description: str = ""
    paper_ref: str = ""
    baseline: str | None = None
    exclude: tuple[dict, ...] = ()
    warmup: int = 2
    repeats: int = 10
    seed: int = 0
    timeouts: Timeouts = field(default_factory=Timeouts)

    @property
    def profile(self) -> Profile:
        return load_profile(self.target)

    def cases(self) -> list[Case]:
        return expand(self)

    def resolved(self) -> dict:
        """The spec with every default filled in, for results/<name>/spec.resolved.yaml."""
        d = dataclasses.asdict(self)
        d["n_cases"] = len(self.cases())
        return _plain(d)


def _plain(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    return x


# ---------------------------------------------------------------- loading


class _Err:
    def __init__(self, path: Path | str):
        self.path = str(path)

    def __call__(self, key: str, rule: str) -> ValueError:
        return ValueError(f"{self.path}: key {key!r}: {rule}")


def _as_tuple(value: Any) -> tuple:
    return tuple(value) if isinstance(value, (list, tuple)) else (value,)


def _typed(err: _Err, key: str, values: tuple, typ: type) -> tuple:
    out = []
    for v in values:
        if typ is int and (isinstance(v, bool) or not isinstance(v, int)):
            raise err(key, f"value {v!r} must be an integer")
        if typ is bool and not isinstance(v, bool):
            raise err(key, f"value {v!r} must be true or false")
        if typ is str and not isinstance(v, str):
            raise err(key, f"value {v!r} must be a string")
        out.append(v)
    if not out:
        raise err(key, "must not be empty")
    return tuple(out)


def _check_keys(err: _Err, where: str, raw: dict, allowed: set[str]) -> None:
    unknown = set(raw) - allowed
    if unknown:
        raise err(f"{where}{sorted(unknown)[0]}" if where else sorted(unknown)[0],
                  f"unknown key; allowed keys{' under ' + where.rstrip('.') if where else ''}: {sorted(allowed)}")


def parse_spec(raw: Any, path: Path | str = "<memory>", *, target: str | None = None) -> Spec:
    """Build and validate a Spec from a YAML mapping. ``target`` overrides the file's."""
    err = _Err(path)
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: a spec must be a YAML mapping")
    _check_keys(err, "", raw, _TOP_KEYS)
    for key in ("name", "methods", "sweep", "target"):
        if key not in raw and not (key == "target" and target):
            raise err(key, "is required")
    name = raw["name"]
    if not isinstance(name, str) or not name.replace("_", "").replace("-", "").isalnum():
        raise err("name", f"{name!r} must be letters, digits, '_' or '-' (it names results/<name>/)")

    methods = _typed(err, "methods", _as_tuple(raw["methods"]), str)
    for m in methods:
        if m not in METHODS:
            raise err("methods", f"{m!r} is not registered; registered: {sorted(METHODS)}")
    if len(set(methods)) != len(methods):
        raise err("methods", "lists a method twice")
    baseline = raw.get("baseline")
    if baseline is not None and baseline not in methods:
        raise err("baseline", f"{baseline!r} must be one of methods {list(methods)}")

    sw = raw["sweep"]
    if not isinstance(sw, dict):
        raise err("sweep", "must be a mapping of axis -> value or list of values")
    _check_keys(err, "sweep.", sw, set(AXES))
    if "seqlen" not in sw:
        raise err("sweep.seqlen", "is required")
    axes = {}
    for axis in AXES:
        if axis in sw:
            vals = _as_tuple(sw[axis])
            if axis == "kv_heads" and vals == (None,):
                axes[axis] = vals
                continue
            axes[axis] = _typed(err, f"sweep.{axis}", vals, _AXIS_TYPES[axis])
    sweep = Sweep(**axes)
    for axis in ("seqlen", "world_size", "batch", "heads", "head_dim"):
        for v in getattr(sweep, axis):
            if v <= 0:
                raise err(f"sweep.{axis}", f"value {v} must be positive")
    for v in sweep.dtype:
        if v not in DTYPES:
            raise err("sweep.dtype", f"{v!r} is unknown; choose one of {sorted(DTYPES)}")
    for v in sweep.layout:
        if v not in LAYOUTS:
            raise err("sweep.layout", f"{v!r} is unknown; choose one of {list(LAYOUTS)}")

    ms = raw.get("measure", {}) or {}
    if not isinstance(ms, dict):
        raise err("measure", "must be a mapping")
    _check_keys(err, "measure.", ms, _MEASURE_KEYS)
    modes = _typed(err, "measure.modes", _as_tuple(ms.get("modes", "fwd_bwd")), str)
    for mo in modes:
        if mo not in MODES:
            raise err("measure.modes", f"{mo!r} is unknown; choose from {list(MODES)}")
    level = ms.get("level", "op")
    if level not in LEVELS:
        raise err("measure.level", f"{level!r} must be one of {list(LEVELS)}")
    for key in ("memory", "comm"):
        if key in ms and not isinstance(ms[key], bool):
            raise err(f"measure.{key}", "must be true or false")
    measure = Measure(modes=modes, level=level, memory=ms.get("memory", True), comm=ms.get("comm", True))

    ints = {}
    for key, default, low in (("warmup", 2, 0), ("repeats", 10, 1), ("seed", 0, 0)):
        v = raw.get(key, default)
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise err(key, f"{v!r} must be an integer >= {low}")
        ints[key] = v

    to = raw.get("timeouts", {}) or {}
    if not isinstance(to, dict):
        raise err("timeouts", "must be a mapping")
    _check_keys(err, "timeouts.", to, _TIMEOUT_KEYS)
    for key, v in to.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
            raise err(f"timeouts.{key}", f"{v!r} must be a positive number of seconds")
    timeouts = Timeouts(**{k: float(v) for k, v in to.items()})

    exclude = raw.get("exclude", []) or []
    if not isinstance(exclude, list) or not all(isinstance(e, dict) for e in exclude):
        raise err("exclude", "must be a list of mappings (axis or 'method'/'mode' -> value)")
    for e in exclude:
        _check_keys(err, "exclude.", e, set(AXES) | {"method", "mode"})

    tgt = target or raw["target"]
    try:
        load_profile(tgt)
    except ValueError as e:
        raise err("target", str(e)) from None

    spec = Spec(name=name, path=str(path), methods=methods, sweep=sweep, measure=measure, target=tgt,
                description=str(raw.get("description", "")), paper_ref=str(raw.get("paper_ref", "")),
                baseline=baseline, exclude=tuple(exclude), timeouts=timeouts, **ints)
    validate_cases(spec)
    return spec


def load_spec(path: Path | str, *, target: str | None = None) -> Spec:
    p = Path(path)
    try:
        raw = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        raise ValueError(f"{p}: not valid YAML: {e}") from None
    return parse_spec(raw, p, target=target)


# ---------------------------------------------------------------- cases


def _excluded(spec: Spec, values: dict) -> bool:
    return any(all(values.get(k) == v for k, v in e.items()) for e in spec.exclude)


def expand(spec: Spec) -> list[Case]:
    """All cases, grouped by world size (so one launch can run a whole group)."""
    sw = spec.sweep
    out = []
    for ws, batch, heads, kvh, hd, dtype, causal, layout, n, mode, method in itertools.product(
            sw.world_size, sw.batch, sw.heads, sw.kv_heads, sw.head_dim, sw.dtype, sw.causal, sw.layout,
            sw.seqlen, spec.measure.modes, spec.methods):
        kv = heads if kvh is None else kvh
        values = dict(world_size=ws, batch=batch, heads=heads, kv_heads=kv, head_dim=hd, dtype=dtype,
                      causal=causal, layout=layout, seqlen=n, mode=mode, method=method)
        if _excluded(spec, values):
            continue
        out.append(Case(experiment=spec.name, level=spec.measure.level, warmup=spec.warmup,
                        repeats=spec.repeats, seed=spec.seed, measure_memory=spec.measure.memory,
                        measure_comm=spec.measure.comm, case_timeout_s=spec.timeouts.case_s,
                        pg_timeout_s=spec.timeouts.pg_s, **values))
    return out


def case_problem(case: Case) -> str | None:
    """Why ``case`` cannot run on this machine (e.g. an adapter's package is missing), else None.

    Impossible shapes are load errors (``validate_cases``); this covers what
    depends on the machine, so those cases are skipped with a recorded reason
    and re-evaluated by the next run.
    """
    method = METHODS[case.method]
    if not method.available():
        return f"method {case.method!r} is unavailable here (needs {method.external or 'an optional package'})"
    if case.level == "op" and method.level == "block":
        return f"method {case.method!r} is block-only (tensor parallelism); use measure.level: block"
    try:
        method.validate(case.shape)
    except ValueError as e:
        return f"method {case.method!r} cannot run this shape: {e}"
    return None


def validate_cases(spec: Spec) -> None:
    """Impossible combinations are errors naming the file, the key and the rule."""
    err = _Err(spec.path)
    cases = spec.cases()
    if not cases:
        raise err("exclude", "excludes every case of the sweep")
    prof = load_profile(spec.target)
    for ws in spec.sweep.world_size:
        why = prof.world_size_rule(ws)
        if why:
            raise err("sweep.world_size", why)
    for case in cases:
        where = f"seqlen={case.seqlen}, world_size={case.world_size}, layout={case.layout}"
        try:
            case.shape.validate()
        except ValueError as e:
            raise err("sweep", f"combination ({where}) is impossible: {e}") from None
        method = METHODS[case.method]
        if case.level == "op" and method.level == "block":
            raise err("measure.level", f"method {case.method!r} is block-only (tensor parallelism): "
                                       "it needs measure.level: block")
        try:
            method.validate(case.shape)
        except ValueError as e:
            raise err("sweep", f"combination ({where}, heads={case.heads}, kv_heads={case.kv_heads}) is "
                               f"impossible for method {case.method!r}: {e}; drop it with 'exclude'") from None


# ---------------------------------------------------------------- presets


@dataclass(frozen=True)
class Preset:
    name: str
    path: str
    specs: tuple[Spec, ...]
    description: str = ""


def resolve_spec_path(name: str) -> Path:
    """A path, or a bare spec name looked up in experiments/specs and experiments/cpu."""
    p = Path(name)
    if p.suffix in (".yaml", ".yml") and p.exists():
        return p
    for d in ("specs", "cpu"):
        cand = EXPERIMENTS_DIR / d / f"{name}.yaml"
        if cand.exists():
            return cand
    raise ValueError(f"{name!r} is neither a spec file, a spec in experiments/specs or experiments/cpu, "
                     f"nor a preset in experiments/presets")


def load_preset(path: Path | str, *, target: str | None = None) -> Preset:
    p = Path(path)
    raw = yaml.safe_load(p.read_text()) or {}
    err = _Err(p)
    if not isinstance(raw, dict):
        raise ValueError(f"{p}: a preset must be a mapping")
    _check_keys(err, "", raw, {"name", "description", "specs", "target"})
    if not isinstance(raw.get("specs"), list) or not raw["specs"]:
        raise err("specs", "must be a non-empty list of spec files (relative to experiments/)")
    tgt = target or raw.get("target")
    specs = tuple(load_spec(EXPERIMENTS_DIR / s, target=tgt) for s in raw["specs"])
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise err("specs", f"two specs share a name: {names}")
    return Preset(name=raw.get("name", p.stem), path=str(p), specs=specs,
                  description=str(raw.get("description", "")))


def load_any(name: str, *, target: str | None = None) -> Preset:
    """A preset name/file or a single spec, always returned as a Preset."""
    preset_file = EXPERIMENTS_DIR / "presets" / f"{name}.yaml"
    if preset_file.exists():
        return load_preset(preset_file, target=target)
    p = Path(name)
    if p.exists() and p.parent.name == "presets":
        return load_preset(p, target=target)
    spec = load_spec(resolve_spec_path(name), target=target)
    return Preset(name=spec.name, path=spec.path, specs=(spec,))
