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

``sweep.mask`` (a ``burst_impl.masks`` spec; BurstEngine's sparse training: ``"window:4096:0"``) is
the model's attention mask (``ModelConfig.mask``, intersected with causal) and ``sweep.layout`` may
be ``balanced`` (the mask's balanced chunks); a method without masks, or ``checkpoint: seq`` with a
mask it cannot recompute at N/2, is a load error.

The attention shape comes from the model: ``sweep`` must not set ``heads``,
``kv_heads`` or ``head_dim`` (they are filled in from the config, so case
names and the emulator's calibration see them). Every rule is a ValueError
naming the file, the key and the rule, raised when the spec loads.

The training setup (``burst_impl.model.config``'s ``loss`` and ``checkpoint``) is the spec's
``model.loss`` / ``model.checkpoint`` for every method, or per row with ``model.variants``: a
table's rows (BurstEngine's main table lists ``usp`` twice, as Burst-USP and LoongTrain-USP) are
named variants of a registry method, each with its own loss and checkpoint mode; the variant's name
leads its case ids and is the ``baseline`` to name. ``model.cumulative: true`` (an ablation) makes
the loader check that every variant is the one before it plus exactly one change
(``cumulative_problem``). Every record says the ZeRO stage (``zero``: 3 = FSDP2 over the sequence
group, else 0) and the activation offload (none: the suite implements no offload).

    model: {name: burstengine_14b, zero: [true], cumulative: true,
            variants: [{name: ring_baseline, method: ring, loss: unfused, checkpoint: full}, ...]}

``measure.modes: [perplexity]`` (``model_perplexity.py``) trains every method's model for
``model.train_steps`` AdamW steps at ``model.lr`` on the seeded corpus ``model.corpus`` and
evaluates the held-out perplexity over ``model.eval_tokens`` tokens, next to the single-process
model trained the same way (Table 4's exactness check); nothing is timed. ``model.loss_parity: true``
makes a timed training run's record compare each step's loss with the single-process model's, trained
the same steps on rank 0 after the timing (``model_parity.py``: the difference, the tolerance and why).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from burst_impl.loss_modes import LOSS_MODES
from burst_impl.model.checkpoint import method_mode, seq_mask_problem
from burst_impl.model.config import CHECKPOINT_MODES, CONFIGS, get_config
from burst_impl.model.data import CORPORA
from burst_impl.model.flops import MODES as STEP_MODES
from baselines.registry import METHODS, get
from baselines.tensor_parallel import check_tp

OPTIMIZERS = ("adamw", "sgd")
PERPLEXITY = "perplexity"          # train a few steps, then the held-out perplexity (model_perplexity.py)
MODEL_MODES = STEP_MODES + (PERPLEXITY,)
# the fields of a variant that make a row of a table; a cumulative list changes one per row
VARIANT_KNOBS = ("method", "loss", "checkpoint")
MODEL_AXES = ("heads", "kv_heads", "head_dim")     # sweep axes the model fixes


def _known_model(name: str) -> str | None:
    return None if name in CONFIGS else f"{name!r} is not a model; models: {sorted(CONFIGS)}"


def _optimizer(name: str) -> str | None:
    return None if name in OPTIMIZERS else f"{name!r} is unknown; choose one of {list(OPTIMIZERS)}"


def _zero_values(values: tuple[bool, ...]) -> str | None:
    return "lists a value twice" if len(set(values)) != len(values) else None


def _one_of(choices, what: str):
    return lambda v: None if v in choices else f"{v!r} is not a {what}; choose one of {list(choices)}"


def _variant_name(name: str) -> str | None:
    if not name.replace("_", "").replace("-", "").isalnum():
        return f"{name!r} must be letters, digits, '_' or '-' (it leads case ids)"
    return None


def _positive(v) -> str | None:
    return None if v > 0 else f"{v!r} must be > 0"


def _non_negative(v) -> str | None:
    return None if v >= 0 else f"{v!r} must be >= 0"


@dataclass(frozen=True)
class ModelVariant:
    """One row of a model-level table: a registry method with its training setup."""

    name: str = field(metadata={"check": _variant_name})     # leads the case id; what ``baseline`` names
    method: str = field(metadata={"check": _one_of(METHODS, "registered method")})
    label: str = ""                                            # the paper's row name (tables, legends)
    loss: str = field(default="unfused", metadata={"check": _one_of(LOSS_MODES, "loss mode")})
    checkpoint: str = field(default="none", metadata={"check": _one_of(CHECKPOINT_MODES, "checkpoint mode")})


def _variant_names(variants: tuple[ModelVariant, ...]) -> str | None:
    names = [v.name for v in variants]
    dup = next((n for n in names if names.count(n) > 1), None)
    return f"names variant {dup!r} twice" if dup else None


@dataclass(frozen=True)
class ModelSetup:
    name: str = field(metadata={"check": _known_model})
    # False: weights replicated, gradients all-reduced; True: FSDP2 (ZeRO-3) over the sequence group
    zero: tuple[bool, ...] = field(default=(False,), metadata={"check": _zero_values})
    optimizer: str = field(default="adamw", metadata={"check": _optimizer})
    # every method's training setup unless ``variants`` gives it per row
    loss: str = field(default="unfused", metadata={"check": _one_of(LOSS_MODES, "loss mode")})
    checkpoint: str = field(default="none", metadata={"check": _one_of(CHECKPOINT_MODES, "checkpoint mode")})
    variants: tuple[ModelVariant, ...] = field(default=(), metadata={"check": _variant_names})
    cumulative: bool = False          # variants form an ablation: each is the previous plus one change
    # measure.modes: [perplexity] (model_perplexity.py); 0 = not set (the mode then refuses the spec)
    train_steps: int = field(default=0, metadata={"check": _non_negative})
    eval_tokens: int = field(default=0, metadata={"check": _non_negative})
    lr: float = field(default=1e-3, metadata={"check": _positive})
    corpus: str = field(default="markov", metadata={"check": _one_of(CORPORA, "corpus")})
    # train: the record compares each step's loss with the unsharded model's (model_parity.py)
    loss_parity: bool = False


def cumulative_problem(variants: tuple[ModelVariant, ...]) -> str | None:
    """Why ``variants`` is not cumulative (each row = the previous one plus exactly one change of
    ``VARIANT_KNOBS``), else None."""
    for prev, cur in zip(variants, variants[1:]):
        changed = [k for k in VARIANT_KNOBS if getattr(prev, k) != getattr(cur, k)]
        if len(changed) != 1:
            return (f"variant {cur.name!r} changes {changed or 'nothing'} from {prev.name!r}; a cumulative "
                    f"list changes exactly one of {list(VARIANT_KNOBS)} per row")
    return None


def check_setup(setup: ModelSetup, methods: tuple[str, ...] | None, modes: tuple[str, ...], err) -> tuple[str, ...]:
    """The spec's methods given its model setup (variants fill them in when ``methods`` is omitted)."""
    if setup.cumulative:
        why = "needs at least two variants" if len(setup.variants) < 2 else cumulative_problem(setup.variants)
        if why:
            raise err("model.variants", why)
    if PERPLEXITY in modes:
        for key in ("train_steps", "eval_tokens"):
            if getattr(setup, key) <= 0:
                raise err(f"model.{key}", f"{getattr(setup, key)} must be > 0 with measure.modes: [{PERPLEXITY}]")
    if not setup.variants:
        if methods is None:
            raise err("methods", "is required (or model.variants)")
        return methods
    used = tuple(dict.fromkeys(v.method for v in setup.variants))
    if methods is not None and set(methods) != set(used):
        raise err("methods", f"{list(methods)} must be the methods of model.variants {list(used)} (or be omitted)")
    return used


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
    if case.mode == PERPLEXITY and case.eval_tokens < case.seqlen:
        raise err("model.eval_tokens", f"{case.eval_tokens} must be at least seqlen={case.seqlen} (whole windows "
                                       "of N held-out tokens are evaluated)")
    if not case.causal:
        raise err("sweep.causal", "must be true at measure.level: model (the models are causal language models)")
    if case.mode == "train" and method_mode(get(case.method), case.checkpoint) == "seq":
        why = seq_mask_problem(case.shape.mask, case.seqlen)
        if why:
            raise err("model.checkpoint", f"{why} (method {case.method!r}, sweep.mask {case.shape.mask!r})")
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
