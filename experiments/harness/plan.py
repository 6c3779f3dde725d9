"""The resolved plan of a spec: its profile, its cases and each case's problem, built once per loaded spec.

``plan_of(spec)`` is the one place a spec's cases are expanded (``expand``) and
validated (``_validate``: impossible combinations are load errors naming the
file, the key and the rule); the operator checks its own arguments again at
call time. ``Spec.plan`` calls it once per loaded spec (``parse_spec`` does, so a
bad spec fails on load), and everything downstream (``Spec.cases``, the driver,
the performance model, the report) reads the result.

What depends on the machine (an adapter's missing package, a kernel this
machine cannot run) is not an error: the case's ``problem`` says why it is
recorded as skipped (``case_problem``, asked once, on first use). A worker re-derives it from its cases
file through ``launch_problem``, the same function, because a SLURM node is
not the machine the plan was built on.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

import torch

from baselines.registry import METHODS
from burst_impl.kernels import BACKENDS as KERNELS
from burst_impl.kernels import check_backend

from ..profiles.cluster import Profile
from . import axes
from .model_cases import ModelSetup, ModelVariant, check_attention_mode, check_model_case
from .inference_cases import INFERENCE_MODES, check_inference_case, expand_rows, inference_fields
from .case import AUTO_KERNEL, Case
from .schema import FileErr

# A spec is an ``experiments.harness.spec.Spec``; spec.py builds its plan here on load, so this module
# names the type without importing it (import-linter: no cycle between sibling modules).
Spec = Any


@dataclass(frozen=True)
class PlannedCase:
    case: Case

    @functools.cached_property
    def problem(self) -> str | None:
        """Why it cannot run on this machine (recorded as skipped), None when it can; resolved on first use,
        once: asking an adapter may import its package (deepspeed takes seconds), which a dry run,
        the model and the report never need."""
        return case_problem(self.case)


@dataclass(frozen=True)
class RunPlan:
    """A spec with its profile and its cases, in run order (grouped by world size)."""

    spec: Spec               # experiments.harness.spec.Spec
    cases: tuple[PlannedCase, ...]

    @property
    def profile(self) -> Profile:
        return self.spec.profile     # read once, by the spec (``Spec.profile``)

    @functools.cached_property
    def _by_id(self) -> dict[str, PlannedCase]:
        return {p.case.case_id: p for p in self.cases}

    def problem(self, case_id: str) -> str | None:
        return self._by_id[case_id].problem


def plan_of(spec: Spec) -> RunPlan:
    """Expand and validate (ValueError naming the file, the key and the rule); problems resolve on first use."""
    cases = expand(spec)
    _validate(spec, cases)
    return RunPlan(spec=spec, cases=tuple(PlannedCase(c) for c in cases))


# ---------------------------------------------------------------- expansion


def _excluded(spec: Spec, values: dict) -> bool:
    return any(all(values.get(k) == v for k, v in e.items()) for e in spec.exclude)


def _rows(spec: Spec, model: ModelSetup | None, mode: str) -> list[tuple[str, ModelVariant | None, dict]]:
    """(method, variant, the row's own Case fields) per row: the model's variants, an inference spec's methods
    (the context-parallel one once per merge in decode), else the methods with the spec-wide setup."""
    if spec.measure.level == "inference":
        return [(m, None, inference_fields(spec, mode, merge)) for m, merge in expand_rows(spec, mode)]
    if model is not None and model.variants:
        return [(v.method, v, {}) for v in model.variants]
    row = {} if model is not None else {"min_sample_s": spec.measure.min_sample_s}     # op and layer levels
    return [(m, None, row) for m in spec.methods]


def _model_fields(model: ModelSetup, zero: bool, variant: ModelVariant | None) -> dict:
    setup = variant or model
    return dict(model=model.name, zero=zero, optimizer=model.optimizer, loss=setup.loss,
                checkpoint=setup.checkpoint, variant=variant.name if variant else None,
                variant_label=(variant.label or variant.name) if variant else "", train_steps=model.train_steps,
                eval_tokens=model.eval_tokens, lr=model.lr, corpus=model.corpus, loss_parity=model.loss_parity)


def expand(spec: Spec) -> list[Case]:
    """All cases, grouped by world size (so one launch can run a whole group)."""
    out = []
    model = spec.model if spec.measure.level == "model" else None
    for shape in axes.shapes(spec.sweep):
        for mode in spec.measure.modes:
            for method, variant, row in _rows(spec, model, mode):
                for kernel_name in spec.kernels or (None,):
                    kernel = None if kernel_name == AUTO_KERNEL else kernel_name
                    for zero in model.zero if model is not None else (False,):
                        values = dict(dataclasses.asdict(shape), mode=mode, method=method, kernel=kernel_name,
                                      zero=zero, variant=variant.name if variant else None, merge=row.get("merge"))
                        if _excluded(spec, values):
                            continue
                        extra = _model_fields(model, zero, variant) if model else {}
                        out.append(Case(experiment=spec.name, method=method, level=spec.measure.level, mode=mode,
                                        shape=shape, warmup=spec.warmup, repeats=spec.repeats, seed=spec.seed,
                                        measure_memory=spec.measure.memory, measure_comm=spec.measure.comm,
                                        case_timeout_s=spec.timeouts.case_s, pg_timeout_s=spec.timeouts.pg_s,
                                        kernel=kernel, max_repeats=spec.max_repeats, ci_target=spec.ci_target,
                                        interleave=spec.interleave, **extra, **row))
    return out


# ---------------------------------------------------------------- validation


def case_problem(case: Case) -> str | None:
    """Why ``case`` cannot run on this machine, else None (``Method.problem``).

    Impossible shapes are load errors (``_validate``); what depends on the
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


def launch_problem(case: Case, world: int) -> str | None:
    """Why a case of a launch's cases file cannot run in that launch: its world size, then ``case_problem``
    on the machine the worker runs on."""
    if case.world_size != world:
        return f"launched with world size {world}, case needs {case.world_size}"
    return case_problem(case)


def _validate(spec: Spec, cases: list[Case]) -> None:
    """Impossible combinations are errors naming the file, the key and the rule."""
    err = FileErr(spec.path)
    if not cases:
        raise err("exclude", "excludes every case of the sweep")
    prof = spec.profile
    for ws in spec.sweep["world_size"]:
        why = prof.world_size_rule(ws)
        if why:
            raise err("sweep.world_size", why)
    if spec.measure.min_sample_s and spec.measure.level not in ("op", "layer"):
        where = ("use inference.min_sample_s" if spec.measure.level == "inference" else
                 "a training step is one call a sample")
        raise err("measure.min_sample_s", f"{spec.measure.min_sample_s!r} applies at levels op and layer; at level "
                                          f"{spec.measure.level!r} {where}")
    for case in cases:
        _validate_case(spec, prof, case, err)


def _validate_case(spec: Spec, prof: Profile, case: Case, err: FileErr) -> None:
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
    elif case.level == "inference" or case.mode in INFERENCE_MODES:
        check_inference_case(case, spec, err)
    else:
        check_attention_mode(case, err)
    try:
        method.validate(case.shape)
    except ValueError as e:
        raise err("sweep", f"combination ({where}, heads={case.heads}, kv_heads={case.kv_heads}) is "
                           f"impossible for method {case.method!r}: {e}; drop it with 'exclude'") from None
