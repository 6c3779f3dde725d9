"""Experiment specs: YAML -> typed dataclasses, validated on load.

A spec names the methods (registry names), the sweep, what to measure,
warm-up/repeat counts, the seed and the cluster profile it runs on. The
dataclasses below are the schema (``experiments.harness.schema``); the sweep
axes are the fields of the problem shape (``experiments.harness.axes``).
Every error names the file, the key and the rule, and is a ``ValueError``.
Loading a spec builds its plan once (``Spec.plan``, ``experiments.harness.plan``): its cases and
the checks that make an impossible combination a load error live there.

    name: fig2_train_7b_8gpu          # results/<name>/
    description: ...
    paper_ref: BurstAttention Fig. 2
    methods: [burst, ring, ...]
    baseline: ring                    # speedups in figures are relative to it
    sweep: {seqlen: [...], world_size: [8], batch: 1, heads: 32, kv_heads: 32,
            head_dim: 128, dtype: bfloat16, causal: true, layout: zigzag}
    measure: {modes: [fwd_bwd], level: layer, memory: true, comm: true}   # level op|layer|model
    kernels: [flash_attn, xformers]   # optional: local kernels (burst_impl.kernels names, or auto); default automatic
    exclude: [{method: ulysses, world_size: 16}]   # optional: drop combinations explicitly
    warmup: 2
    repeats: 6                        # at least this many timed steps (6: the first n with a 95% interval)
    max_repeats: 30                   # then until the median's 95% interval is within +-ci_target, at most this
    ci_target: 0.05                   # relative half-width of the interval of the median (0.05 = +-5%)
    interleave: true                  # time the methods of one case shape in rounds A B A B (paired ratios)
    seed: 0
    cluster: a100_8                   # "cpu", "local" or experiments/clusters/<name>.yaml
    timeouts: {case_s: 900, pg_s: 300}
    model: {name: llama2_7b, zero: [false, true]}   # only with measure.level: model (model_cases.py)
    # model-level rows with their own loss/checkpoint modes (methods then optional; baseline a variant name):
    # model: {name: llama2_7b, variants: [{name: burst_ring, method: burst_double_ring, loss: fused,
    #                                      checkpoint: seq, label: Burst-Ring}, ...]}

Every sweep axis takes a scalar or a list; the cases are the Cartesian product
(minus ``exclude``), times ``kernels`` when given: each case then passes
``backend=<kernel>`` to the method (its case name ends in ``.<kernel>``), and a
method with a fixed kernel of its own (``Method.kernel``: ring_rsa,
ring_flash_attn) cannot be combined with one. A kernel that cannot run on this
machine (not installed, a CUDA kernel without a GPU) makes the case skipped with
the reason. ``auto`` in the list is the automatic choice (no ``backend=``, no
suffix in the case name), e.g. ``kernels: [auto, math]`` for a row with the
method's usual kernel beside one with materialised scores (the papers'
"without LAO / FlashAttention"). Every record names the kernel that ran (``kernel``).
A method name must be registered in ``baselines.METHODS``.
A registered method that cannot run on this machine (an adapter whose package
is missing) has its cases recorded as skipped with the reason
(``Method.problem``); skipped cases are re-evaluated by every run.

Repeats (``experiments.harness.timing``): ``repeats`` timed steps at least; with
``max_repeats`` (default: ``repeats``, a fixed count) more until the 95% interval
of the median is within +-``ci_target``, or the cap, or about half the case's
wall-clock budget (``timeouts.case_s``) is spent timing, whichever comes first;
each record says which (``repeat_stop``). With ``interleave`` the cases that
share a shape, mode and kernel are timed together in rounds, and their
watchdog budget is the sum of theirs.

A CPU mirror of a paper spec names it as ``base: <spec name>`` and states only what
changes; the loader merges the two once, on load (``experiments.harness.overrides``:
mappings merge key by key, lists and scalars replace, ``null`` restores the default).

Names: a *preset* (``experiments/presets/``) is a named list of specs; a
*cluster profile* (``experiments/clusters/``, ``experiments.profiles.cluster``)
is where a spec runs. ``target:`` is the old name of ``cluster:`` and is
still accepted.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from baselines.registry import METHODS
from burst_impl.kernels import BACKENDS as KERNELS

from ..profiles.cluster import Profile, load_profile
from . import axes
from burst_impl.flops import MODES
from .case import AUTO_KERNEL, Case
from .env import repo_relative
from .overrides import read_mapping, resolve_base
from .plan import RunPlan, plan_of
from .model_cases import MODEL_MODES, ModelSetup, check_setup, fill_sweep
from .inference_cases import INFERENCE_MODES, InferenceSetup, inference_sweep
from .schema import FileErr, check_keys, check_type, fields_from, from_mapping, plain

EXPERIMENTS_DIR = Path(__file__).resolve().parents[1]
# op: the operator on local shards; layer: the attention layer; model: a whole decoder (model_cases.py);
# inference: an attention layer's prefill and decode on a KV cache (inference_cases.py)
LEVELS = ("op", "layer", "model", "inference")
# Names the spec format no longer has: a file that uses one fails, naming the current one.
_RENAMED_LEVELS = {"block": "layer"}
_RENAMED_KEYS = {"target": "cluster"}


def _one_of(choices):
    return lambda values: next((f"{v!r} is unknown; choose from {list(choices)}"
                                for v in (values if isinstance(values, tuple) else (values,))
                                if v not in choices), None)


def _at_least(low):
    return lambda v: None if v >= low else f"{v!r} must be an integer >= {low}"


def _positive_seconds(v):
    return None if v > 0 else f"{v!r} must be a positive number of seconds"


@dataclass(frozen=True)
class Measure:
    # forward/backward/fwd_bwd at levels op and layer; train/prefill at level model
    modes: tuple[str, ...] = field(default=("fwd_bwd",),
                                   metadata={"check": _one_of(MODES + MODEL_MODES + INFERENCE_MODES)})
    # op: the attention operator on local shards; layer: the attention layer (projections too);
    # model: a whole decoder trained or prefilled (experiments.harness.model_cases)
    level: str = field(default="op", metadata={"check": _one_of(LEVELS)})
    memory: bool = True    # measure peak memory in a separate untimed step
    comm: bool = True      # count bytes sent (burst_impl.comm.count_bytes)
    # levels op and layer: a timed sample runs calls (forward or fwd_bwd) back to back until it lasts this long
    # (steps.consecutive); 0: one call a sample, the regime the performance model's host terms are measured in
    # (docs/emulator.md). Inference specs set theirs in ``inference:``
    min_sample_s: float = field(default=0.0, metadata={
        "check": lambda v: None if v >= 0 else f"{v!r} must be >= 0 (seconds)"})


@dataclass(frozen=True)
class Timeouts:
    # wall clock per case (watchdog in the worker, backstop in the runner)
    case_s: float = field(default=600.0, metadata={"check": _positive_seconds})
    # process-group timeout: a rank stuck in a collective errors out
    pg_s: float = field(default=120.0, metadata={"check": _positive_seconds})


def _check_name(name: str) -> str | None:
    if not name.replace("_", "").replace("-", "").isalnum():
        return f"{name!r} must be letters, digits, '_' or '-' (it names results/<name>/)"
    return None


def _check_kernels(kernels: tuple[str, ...]) -> str | None:
    for k in kernels:
        if k not in KERNELS and k != AUTO_KERNEL:
            return f"{k!r} is not a kernel; kernels: {[*KERNELS, AUTO_KERNEL]}"
    if len(set(kernels)) != len(kernels):
        return "lists a kernel twice"
    return None


def _check_methods(methods: tuple[str, ...]) -> str | None:
    for m in methods:
        if m not in METHODS:
            return f"{m!r} is not registered; registered: {sorted(METHODS)}"
    if len(set(methods)) != len(methods):
        return "lists a method twice"
    return None


@dataclass(frozen=True)
class Spec:
    name: str = field(metadata={"check": _check_name})
    # required, except at measure.level: model with model.variants (then the variants' methods)
    methods: tuple[str, ...] = field(metadata={"check": _check_methods, "parsed_by": "parse_spec"})
    sweep: dict = field(metadata={"parsed_by": "axes.parse_sweep"})   # {axis: tuple of values}
    cluster: str = field(metadata={"check": lambda c: _cluster_problem(c)})
    path: str = "<memory>"
    measure: Measure = field(default_factory=Measure)
    description: str = ""
    paper_ref: str = ""
    baseline: str | None = None
    exclude: tuple[dict, ...] = ()
    kernels: tuple[str, ...] = field(default=(), metadata={"check": _check_kernels})   # (): automatic
    warmup: int = field(default=2, metadata={"check": _at_least(0)})
    repeats: int = field(default=10, metadata={"check": _at_least(1)})
    max_repeats: int | None = field(default=None,
                                    metadata={"check": lambda v: v is not None and _at_least(1)(v) or None})
    ci_target: float = field(default=0.05, metadata={"check": lambda v: None if 0 < v < 1 else
                                                     f"{v!r} must be a relative half-width in (0, 1), e.g. 0.05"})
    interleave: bool = True
    seed: int = field(default=0, metadata={"check": _at_least(0)})
    timeouts: Timeouts = field(default_factory=Timeouts)
    model: ModelSetup | None = None   # required at measure.level: model, refused otherwise
    inference: InferenceSetup | None = None   # required at measure.level: inference, refused otherwise

    @functools.cached_property
    def profile(self) -> Profile:
        # read once per loaded spec: the driver, the model and the report ask for it many times
        return load_profile(self.cluster)

    @functools.cached_property
    def plan(self) -> RunPlan:
        """The resolved plan (``experiments.harness.plan``), built once; ``parse_spec`` builds it on load."""
        return plan_of(self)

    def cases(self) -> list[Case]:
        return [p.case for p in self.plan.cases]

    def resolved(self) -> dict:
        """The spec with every default filled in, for results/<name>/spec.resolved.yaml."""
        d = plain(self)
        d["path"] = repo_relative(self.path)    # no checkout's absolute path in a committed results folder
        d["n_cases"] = len(self.cases())
        return d


def _cluster_problem(name: str) -> str | None:
    try:
        load_profile(name)
    except ValueError as e:
        return str(e)
    return None


# ---------------------------------------------------------------- loading


def _check_renamed(raw: dict, err) -> None:
    """ValueError for a key or level of the format's old names (``_RENAMED_KEYS``, ``_RENAMED_LEVELS``)."""
    for old, new in _RENAMED_KEYS.items():
        if old in raw:
            raise err(old, f"was renamed {new!r}; call it {new!r}")
    measure = raw.get("measure")
    level = measure.get("level") if isinstance(measure, dict) else None
    if isinstance(level, str) and level in _RENAMED_LEVELS:
        raise err("measure.level", f"{level!r} was renamed {_RENAMED_LEVELS[level]!r}; call it "
                                   f"{_RENAMED_LEVELS[level]!r}")


def _check_top_keys(raw: dict, err) -> None:
    """Old names, then unknown keys, of one file of a ``base:`` chain (named by ``err``)."""
    _check_renamed(raw, err)
    check_keys(raw, [f.name for f in dataclasses.fields(Spec) if f.name != "path"] + ["base"], err)


def _spec_file(name: str) -> Path | None:
    return next((p for d in ("specs", "cpu") if (p := EXPERIMENTS_DIR / d / f"{name}.yaml").exists()), None)


def spec_mapping(path: Path | str) -> dict:
    """A spec file's mapping with its ``base:`` merged in: what the schema validates."""
    return resolve_base(read_mapping(Path(path)), path, find=_spec_file, check=_check_top_keys)


def parse_spec(raw: Any, path: Path | str = "<memory>", *, cluster: str | None = None) -> Spec:
    """Build and validate a Spec from a YAML mapping (``base:`` merged in). ``cluster`` overrides the file's."""
    err = FileErr(path)
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: a spec must be a YAML mapping")
    raw = dict(resolve_base(raw, path, find=_spec_file, check=_check_top_keys))
    if cluster:
        raw["cluster"] = cluster
    kw = fields_from(Spec, {k: v for k, v in raw.items() if k not in ("sweep", "methods")}, err,
                     skip=("sweep", "path", "methods"))
    if "sweep" not in raw:
        raise err("sweep", "is required")
    kw["sweep"] = axes.parse_sweep(raw["sweep"], err)
    methods = None
    if "methods" in raw:
        methods = check_type(raw["methods"], tuple[str, ...], err, "methods")
        why = _check_methods(methods)
        if why:
            raise err("methods", why)
    if kw.get("max_repeats") is not None and kw["max_repeats"] < kw.get("repeats", 10):
        raise err("max_repeats", f"{kw['max_repeats']} must be >= repeats ({kw.get('repeats', 10)}), the minimum")
    level = kw.get("measure", Measure()).level
    if level == "model":
        if kw.get("model") is None:
            raise err("model", "is required at measure.level: model (e.g. {name: llama2_7b})")
        kw["sweep"] = fill_sweep(kw["sweep"], raw["sweep"], kw["model"], err)
        methods = check_setup(kw["model"], methods, kw.get("measure", Measure()).modes, err)
    elif kw.get("model") is not None:
        raise err("model", f"is only for measure.level: model, not {level!r}")
    if level == "inference":
        kw["sweep"] = inference_sweep(kw.get("inference"), kw["sweep"], raw["sweep"], err)
    elif kw.get("inference") is not None:
        raise err("inference", f"is only for measure.level: inference, not {level!r}")
    if methods is None:
        raise err("methods", "is required")
    kw["methods"] = methods
    variants = kw["model"].variants if kw.get("model") is not None else ()
    rows = [v.name for v in variants] or list(methods)
    if kw.get("baseline") is not None and kw["baseline"] not in rows:
        raise err("baseline", f"{kw['baseline']!r} must be one of {'variants' if variants else 'methods'} {rows}")
    for e in kw.get("exclude", ()):
        if not isinstance(e, dict):
            raise err("exclude", "must be a list of mappings (axis or 'method'/'mode'/'kernel' -> value)")
        check_keys(e, set(axes.AXES) | {"method", "mode", "kernel", "zero", "variant", "merge"}, err, "exclude.")
    spec = Spec(path=str(path), **kw)
    _ = spec.plan     # expands and validates the cases: a bad combination fails on load
    return spec


def load_spec(path: Path | str, *, cluster: str | None = None) -> Spec:
    p = Path(path)
    return parse_spec(read_mapping(p), p, cluster=cluster)


# ---------------------------------------------------------------- presets


@dataclass(frozen=True)
class Preset:
    name: str
    path: str
    specs: tuple[Spec, ...]
    description: str = ""

    @functools.cached_property
    def _by_name(self) -> dict[str, Spec]:
        return {s.name: s for s in self.specs}

    def spec(self, name: str) -> Spec:
        return self._by_name[name]


@dataclass(frozen=True)
class _PresetFile:
    specs: tuple[str, ...]            # spec files, relative to experiments/
    name: str = ""
    description: str = ""
    cluster: str | None = None        # overrides every spec's cluster


def resolve_spec_path(name: str) -> Path:
    """A path, or a bare spec name looked up in experiments/specs and experiments/cpu."""
    p = Path(name)
    if p.suffix in (".yaml", ".yml") and p.exists():
        return p
    found = _spec_file(name)
    if found is not None:
        return found
    raise ValueError(f"{name!r} is neither a spec file, a spec in experiments/specs or experiments/cpu, "
                     f"nor a preset in experiments/presets")


def load_preset(path: Path | str, *, cluster: str | None = None) -> Preset:
    p = Path(path)
    err = FileErr(p)
    raw = yaml.safe_load(p.read_text()) or {}
    if isinstance(raw, dict):
        _check_renamed(raw, err)
    pf = from_mapping(_PresetFile, raw, err)
    specs = tuple(load_spec(EXPERIMENTS_DIR / s, cluster=cluster or pf.cluster) for s in pf.specs)
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise err("specs", f"two specs share a name: {names}")
    return Preset(name=pf.name or p.stem, path=str(p), specs=specs, description=pf.description)


def load_any(name: str, *, cluster: str | None = None) -> Preset:
    """A preset name/file or a single spec, always returned as a Preset."""
    preset_file = EXPERIMENTS_DIR / "presets" / f"{name}.yaml"
    if preset_file.exists():
        return load_preset(preset_file, cluster=cluster)
    p = Path(name)
    if p.exists() and p.parent.name == "presets":
        return load_preset(p, cluster=cluster)
    spec = load_spec(resolve_spec_path(name), cluster=cluster)
    return Preset(name=spec.name, path=spec.path, specs=(spec,))
