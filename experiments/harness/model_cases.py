"""Model-level specs (``measure.level: model``): the ``model:`` key and the rules of its cases.

    measure: {level: model, modes: [train, prefill]}
    model: {name: llama2_7b, zero: [false, true], optimizer: adamw}
    methods: [burst, ring, ulysses, tp_v3]      # registry names; tp_v1/tp_v3 -> model-level TP
    kernels: [cpu_flash, math]                  # optional; "math" = the papers' "without LAO / FlashAttention"

A case trains (``train``: forward, backward, gradient synchronisation,
optimizer step) or prefills (``prefill``: forward of the prompt and the first
generated token) the decoder ``model.name`` (``burst_impl.model.CONFIGS``)
over ``world_size`` ranks. Op-level registry methods run as sequence
parallelism through the whole model (``sequence_parallel``); ``tp_v1`` and
``tp_v3`` as Megatron tensor parallelism of attention AND MLP
(``tensor_parallel``). ``zero: true`` shards the sequence-parallel model's
weights, gradients and optimizer state over the same group with FSDP2
(BurstEngine's "Burst+ZeRO"); it is a sweep axis (one case per value).

The attention shape comes from the model: ``sweep`` must not set ``heads``,
``kv_heads`` or ``head_dim`` (they are filled in from the config, so case
names and the emulator's calibration see them). Every rule is a ValueError
naming the file, the key and the rule, raised when the spec loads.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from burst_impl.model.config import CONFIGS, get_config
from burst_impl.model.flops import MODES as MODEL_MODES
from baselines.registry import get
from baselines.tensor_parallel import check_tp

OPTIMIZERS = ("adamw", "sgd")
MODEL_AXES = ("heads", "kv_heads", "head_dim")     # sweep axes the model fixes


def _known_model(name: str) -> str | None:
    return None if name in CONFIGS else f"{name!r} is not a model; models: {sorted(CONFIGS)}"


def _optimizer(name: str) -> str | None:
    return None if name in OPTIMIZERS else f"{name!r} is unknown; choose one of {list(OPTIMIZERS)}"


def _zero_values(values: tuple[bool, ...]) -> str | None:
    return "lists a value twice" if len(set(values)) != len(values) else None


@dataclass(frozen=True)
class ModelSetup:
    name: str = field(metadata={"check": _known_model})
    # False: weights replicated, gradients all-reduced; True: FSDP2 (ZeRO-3) over the sequence group
    zero: tuple[bool, ...] = field(default=(False,), metadata={"check": _zero_values})
    optimizer: str = field(default="adamw", metadata={"check": _optimizer})


def fill_sweep(sweep: dict, raw_sweep: dict, setup: ModelSetup, err) -> dict:
    """The parsed sweep with heads, kv_heads and head_dim taken from the model (error if the spec sets them)."""
    for axis in MODEL_AXES:
        if axis in raw_sweep:
            raise err(f"sweep.{axis}", f"is set by model {setup.name!r} at measure.level: model; remove it")
    cfg = get_config(setup.name)
    return dict(sweep, heads=(cfg.n_heads,), kv_heads=(cfg.n_kv_heads,), head_dim=(cfg.head_dim,))


def check_model_case(case, err) -> None:
    """The model-level rules of one case (after the shape and method checks every level runs)."""
    cfg = get_config(case.model)
    if case.mode not in MODEL_MODES:
        raise err("measure.modes", f"mode {case.mode!r} is not a model-level mode; choose from {list(MODEL_MODES)}")
    if not case.causal:
        raise err("sweep.causal", "must be true at measure.level: model (the models are causal language models)")
    version = get(case.method).tp_version
    if version is not None:
        if case.zero:
            raise err("model.zero", f"method {case.method!r} is tensor parallel; zero shards a sequence-parallel "
                                    f"model's weights (Burst+ZeRO): drop it with exclude: "
                                    f"[{{method: {case.method}, zero: true}}]")
        try:
            check_tp(cfg, version, case.world_size)
        except ValueError as e:
            raise err("sweep.world_size", f"world_size={case.world_size} is impossible for method "
                                          f"{case.method!r}: {e}") from None


def check_attention_mode(case, err) -> None:
    if case.mode in MODEL_MODES:
        raise err("measure.modes", f"mode {case.mode!r} is a model-level mode: it needs measure.level: model")
