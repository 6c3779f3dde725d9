"""Experiment specs: YAML -> typed dataclasses, validated on load.

A spec names the methods (registry names), the sweep, what to measure,
warm-up/repeat counts, the seed and the cluster profile it runs on. The
dataclasses below are the schema (``experiments.harness.schema``); the sweep
axes are the fields of the problem shape (``experiments.harness.axes``).
Every error names the file, the key and the rule, and is a ``ValueError``.

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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml

from baselines.registry import METHODS
from burst_impl.kernels import BACKENDS as KERNELS
from burst_impl.kernels import check_backend
from burst_impl.shape import AttnShape

from ..profiles.cluster import Profile, load_profile
from . import axes
from burst_impl.flops import MODES
from .overrides import read_mapping, resolve_base
from .model_cases import (MODEL_MODES, ModelSetup, ModelVariant, check_attention_mode, check_model_case,
                          check_setup, fill_sweep)
from .schema import FileErr, check_keys, check_type, fields_from, from_mapping, plain

EXPERIMENTS_DIR = Path(__file__).resolve().parents[1]
# op: the operator on local shards; layer: the attention layer; model: a whole decoder (model_cases.py)
LEVELS = ("op", "layer", "model")
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
    modes: tuple[str, ...] = field(default=("fwd_bwd",), metadata={"check": _one_of(MODES + MODEL_MODES)})
    # op: the attention operator on local shards; layer: the attention layer (projections too);
    # model: a whole decoder trained or prefilled (experiments.harness.model_cases)
    level: str = field(default="op", metadata={"check": _one_of(LEVELS)})
    memory: bool = True    # measure peak memory in a separate untimed step
    comm: bool = True      # count bytes sent (burst_impl.comm.count_bytes)


@dataclass(frozen=True)
class Timeouts:
    # wall clock per case (watchdog in the worker, backstop in the runner)
    case_s: float = field(default=600.0, metadata={"check": _positive_seconds})
    # process-group timeout: a rank stuck in a collective errors out
    pg_s: float = field(default=120.0, metadata={"check": _positive_seconds})


@dataclass(frozen=True)
class Case:
    """One measurement: one method, one shape, one mode. One record in the results."""

    experiment: str
    method: str
    level: str
    mode: str
    shape: AttnShape
    warmup: int
    repeats: int
    seed: int
    measure_memory: bool = True
    measure_comm: bool = True
    case_timeout_s: float = 600.0
    pg_timeout_s: float = 120.0
    kernel: str | None = None        # local kernel (burst_impl.kernels name) passed as backend=; None: automatic
    # level "model" only (model_cases.py): the decoder config, FSDP2 weights, the optimizer
    model: str | None = None
    zero: bool = False
    optimizer: str = "adamw"
    # model level: the training setup (model_cases.ModelVariant); ``variant`` names the row and leads the case id
    variant: str | None = None
    variant_label: str = ""
    loss: str = "unfused"
    checkpoint: str = "none"
    # measure.modes: [perplexity] only (model_perplexity.py)
    train_steps: int = 0
    eval_tokens: int = 0
    lr: float = 1e-3
    corpus: str = "markov"
    max_repeats: int | None = None   # adaptive repeats up to this cap (None: exactly ``repeats``)
    ci_target: float = 0.05          # stop when the median's 95% interval is within +-ci_target
    interleave: bool = True          # time with the other methods of the same shape, in rounds

    @property
    def repeat_cap(self) -> int:
        return max(self.repeats, self.max_repeats or self.repeats)

    @property
    def group_key(self) -> tuple:
        """Cases with equal keys are timed together in interleaved rounds (methods of one case shape).
        Model-level cases run alone: a whole decoder per method at once would not fit where one does."""
        if not self.interleave or self.level == "model":
            return (self.case_id,)
        return (self.experiment, self.level, self.mode, self.shape, self.kernel)

    def __getattr__(self, name: str):
        # case.seqlen, case.world_size, ...: the sweep axes are the shape's fields
        if name in axes.AXES:
            return getattr(self.shape, name)
        raise AttributeError(name)

    @property
    def case_id(self) -> str:
        base = axes.case_id(self.method, self.level, self.mode, self.shape)
        if self.model is not None:
            base += f".{self.model}" + (".zero" if self.zero else "")
            if self.variant is not None:        # the row's name replaces the method's (summary.series)
                base = self.variant + base[len(self.method):]
            else:                               # a spec-wide setup other than the default
                base += (f".{self.loss}" if self.loss != "unfused" else "") + (
                    f".ck_{self.checkpoint}" if self.checkpoint != "none" else "")
        return f"{base}.{self.kernel}" if self.kernel else base

    def to_dict(self) -> dict:
        """Flat: the shape's fields next to the case's own (the records' ``config``)."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "shape"}
        d.update(dataclasses.asdict(self.shape))
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Case":
        shape = axes.shape_from(d)
        return cls(shape=shape, **{f.name: d[f.name] for f in dataclasses.fields(cls) if f.name in d})


def _check_name(name: str) -> str | None:
    if not name.replace("_", "").replace("-", "").isalnum():
        return f"{name!r} must be letters, digits, '_' or '-' (it names results/<name>/)"
    return None


AUTO_KERNEL = "auto"     # in ``kernels:``: the method's automatic choice (Case.kernel None)


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

    @property
    def profile(self) -> Profile:
        return load_profile(self.cluster)

    def cases(self) -> list[Case]:
        return expand(self)

    def resolved(self) -> dict:
        """The spec with every default filled in, for results/<name>/spec.resolved.yaml."""
        d = plain(self)
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
        check_keys(e, set(axes.AXES) | {"method", "mode", "kernel", "zero", "variant"}, err, "exclude.")
    spec = Spec(path=str(path), **kw)
    validate_cases(spec)
    return spec


def load_spec(path: Path | str, *, cluster: str | None = None) -> Spec:
    p = Path(path)
    return parse_spec(read_mapping(p), p, cluster=cluster)


# ---------------------------------------------------------------- cases


def _excluded(spec: Spec, values: dict) -> bool:
    return any(all(values.get(k) == v for k, v in e.items()) for e in spec.exclude)


def _rows(spec: Spec, model: ModelSetup | None) -> list[tuple[str, ModelVariant | None]]:
    """(method, variant) per row: the model's variants, else the methods with the spec-wide setup."""
    if model is not None and model.variants:
        return [(v.method, v) for v in model.variants]
    return [(m, None) for m in spec.methods]


def _model_fields(model: ModelSetup, zero: bool, variant: ModelVariant | None) -> dict:
    setup = variant or model
    return dict(model=model.name, zero=zero, optimizer=model.optimizer, loss=setup.loss,
                checkpoint=setup.checkpoint, variant=variant.name if variant else None,
                variant_label=(variant.label or variant.name) if variant else "", train_steps=model.train_steps,
                eval_tokens=model.eval_tokens, lr=model.lr, corpus=model.corpus)


def expand(spec: Spec) -> list[Case]:
    """All cases, grouped by world size (so one launch can run a whole group)."""
    out = []
    model = spec.model if spec.measure.level == "model" else None
    for shape in axes.shapes(spec.sweep):
        for mode in spec.measure.modes:
            for method, variant in _rows(spec, model):
                for kernel_name in spec.kernels or (None,):
                    kernel = None if kernel_name == AUTO_KERNEL else kernel_name
                    for zero in model.zero if model is not None else (False,):
                        values = dict(dataclasses.asdict(shape), mode=mode, method=method, kernel=kernel_name,
                                      zero=zero, variant=variant.name if variant else None)
                        if _excluded(spec, values):
                            continue
                        extra = _model_fields(model, zero, variant) if model else {}
                        out.append(Case(experiment=spec.name, method=method, level=spec.measure.level, mode=mode,
                                        shape=shape, warmup=spec.warmup, repeats=spec.repeats, seed=spec.seed,
                                        measure_memory=spec.measure.memory, measure_comm=spec.measure.comm,
                                        case_timeout_s=spec.timeouts.case_s, pg_timeout_s=spec.timeouts.pg_s,
                                        kernel=kernel, max_repeats=spec.max_repeats, ci_target=spec.ci_target,
                                        interleave=spec.interleave, **extra))
    return out


def case_problem(case: Case) -> str | None:
    """Why ``case`` cannot run on this machine, else None (``Method.problem``).

    Impossible shapes are load errors (``validate_cases``); what depends on the
    machine makes the case skipped with a recorded reason, re-evaluated by the next run.
    """
    why = METHODS[case.method].problem(case.shape, case.level)
    if why or case.kernel is None:
        return why
    # The device the worker will pick on this machine (device "auto"; cpu clusters reject CUDA kernels at load).
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        check_backend(case.kernel, device, case.shape.torch_dtype, case.head_dim)
    except ValueError as e:
        return f"kernel {case.kernel!r} cannot run here: {e}"
    return None


def validate_cases(spec: Spec) -> None:
    """Impossible combinations are errors naming the file, the key and the rule."""
    err = FileErr(spec.path)
    cases = spec.cases()
    if not cases:
        raise err("exclude", "excludes every case of the sweep")
    prof = load_profile(spec.cluster)
    for ws in spec.sweep["world_size"]:
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
        if case.kernel is not None and method.kernel is not None:
            raise err("kernels", f"method {case.method!r} runs its own kernel ({method.kernel}); it takes no "
                                 f"kernel={case.kernel!r}: drop it with exclude: [{{method: {case.method}, "
                                 f"kernel: {case.kernel}}}] or measure it in a spec without kernels")
        if case.kernel is not None and prof.device == "cpu" and KERNELS[case.kernel].devices not in (None, ("cpu",)):
            raise err("kernels", f"kernel {case.kernel!r} runs on {'/'.join(KERNELS[case.kernel].devices)}, but "
                                 f"cluster {spec.cluster!r} runs on cpu")
        if case.level == "op" and method.level == "layer":
            raise err("measure.level", f"method {case.method!r} is layer-only (tensor parallelism): "
                                       "it needs measure.level: layer")
        if case.level == "model":
            check_model_case(case, err)
        else:
            check_attention_mode(case, err)
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
