"""Inference specs (``measure.level: inference``): the ``inference:`` key and the rules of its cases.

    measure: {level: inference, modes: [decode]}      # decode | ttft | kv_capacity
    methods: [burst, tp_v1]     # burst: context parallel (Burst ring prefill, sharded cache); tp_v1: Megatron TP
    inference: {merges: [all_gather, heads], new_tokens: 1, placement: round_robin, model: llama3_8b}

A case measures one attention layer serving inference (``baselines.decode_layer``), over a KV cache of
``seqlen`` tokens per sequence and ``batch`` sequences (the concurrency):

* ``decode`` (time per output token): decode steps of ``new_tokens`` per sequence on a cache filled
  with synthetic K/V (``fill_cache``), back to back for ``min_sample_s`` per sample (at most
  ``MAX_STEPS_PER_SAMPLE``), rewound after every sample so each is timed at the same context;
  ``burst`` runs once per merge (``inference.merges``: the all-gather merge of a replicated model, or the
  heads merge of Helix's layout, whose output projection is then row-parallel), ``tp_v1`` is tensor
  parallel decode with head-sharded caches (the baseline);
* ``ttft`` (time to first token of the layer): the prompt's prefill into the empty cache: the Burst ring
  (pass-KV) for ``burst``, each rank's heads over the whole prompt for ``tp_v1``; prefills back to back
  for ``min_sample_s`` per sample, each into the cache emptied again;
* ``kv_capacity``: not timed: the cache is filled and the K/V bytes each rank holds are recorded next to
  their formula, with how many tokens of context fit (``inference_record.kv_capacity``).

``inference.model`` names the decoder the layer belongs to (``burst_impl.model.CONFIGS``): its heads,
KV heads and head dim fill the sweep (which must not set them), and the performance model adds the whole
model's step as ``<spec>_model_level``. Every rule is a ValueError naming the file, the key and the rule.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from burst_impl.inference import MERGES, PLACEMENTS
from burst_impl.model.config import CONFIGS, get_config

INFERENCE_MODES = ("ttft", "decode", "kv_capacity")
INFERENCE_METHODS = {"burst": "context parallel", "tp_v1": "tensor parallel"}
UNTIMED = ("kv_capacity",)
MODEL_AXES = ("heads", "kv_heads", "head_dim")


def _merges(values: tuple[str, ...]) -> str | None:
    bad = [m for m in values if m not in MERGES]
    if bad:
        return f"{bad[0]!r} is not a merge; choose from {list(MERGES)}"
    return "lists a merge twice" if len(set(values)) != len(values) else None


@dataclass(frozen=True)
class InferenceSetup:
    # the context-parallel rows' merges (decode mode): baselines.decode_layer's cp_all_gather and cp_heads
    merges: tuple[str, ...] = field(default=MERGES, metadata={"check": _merges})
    # tokens per sequence per decode step (q >= 1: speculative / multi-token decode)
    new_tokens: int = field(default=1, metadata={"check": lambda v: None if v >= 1 else f"{v!r} must be >= 1"})
    placement: str = field(default="round_robin", metadata={
        "check": lambda v: None if v in PLACEMENTS else f"{v!r} is unknown; choose from {list(PLACEMENTS)}"})
    # a timed sample runs consecutive steps (decode steps, or prefills each into the emptied cache) until it
    # lasts this long (timing.autorange, at most MAX_STEPS_PER_SAMPLE), as a server decodes token after token;
    # TPOT and TTFT are the sample over its steps. 0: one step per sample, alone after the barrier. The CPU
    # specs on the emulated cluster set 1.0, ten CFS periods (docs/inference.md, "Consecutive steps")
    min_sample_s: float = field(default=0.2, metadata={
        "check": lambda v: None if v >= 0 else f"{v!r} must be >= 0 (seconds)"})
    # the decoder the layer belongs to (its shape, and the whole model's step in the performance model)
    model: str | None = field(default=None, metadata={
        "check": lambda v: None if v in CONFIGS else f"{v!r} is not a model; models: {sorted(CONFIGS)}"})


def row_of(method: str, merge: str | None) -> str:
    """The ``baselines.decode_layer`` row of a case: tensor parallel, or context parallel with its merge."""
    if method == "tp_v1":
        return "tp"
    return "cp_heads" if merge == "heads" else "cp_all_gather"


ROW_LABELS = {"cp_all_gather": "CP decode, all-gather merge", "cp_heads": "CP decode, heads merge (Helix)",
              "tp": "TP decode (Megatron)"}


def inference_sweep(setup: InferenceSetup | None, sweep: dict, raw_sweep: dict, err) -> dict:
    """The parsed sweep of a ``level: inference`` spec: ``inference:`` required; with ``inference.model``
    the model's heads, KV heads and head dim fill the sweep (a ValueError if the spec sets them)."""
    if setup is None:
        raise err("inference", "is required at measure.level: inference (e.g. {merges: [all_gather, heads]})")
    if setup.model is None:
        return sweep
    for axis in MODEL_AXES:
        if axis in raw_sweep:
            raise err(f"sweep.{axis}", f"is set by inference.model {setup.model!r}; remove it")
    cfg = get_config(setup.model)
    return dict(sweep, heads=(cfg.n_heads,), kv_heads=(cfg.n_kv_heads,), head_dim=(cfg.head_dim,))


def expand_rows(spec, mode: str) -> list[tuple[str, str | None]]:
    """(method, merge) per row of ``mode``: the context-parallel method once per merge in decode and kv_capacity
    (the heads row holds W_o and the MLP sharded, so more cache fits), once in ttft (its prefill does not
    depend on the merge)."""
    out = []
    for m in spec.methods:
        merges = spec.inference.merges if m == "burst" and mode != "ttft" else (None,)
        out += [(m, merge) for merge in merges]
    return out


def inference_fields(spec, mode: str, merge: str | None) -> dict:
    """The Case fields of an inference case."""
    setup = spec.inference
    decode = mode == "decode"
    return dict(merge=merge, new_tokens=setup.new_tokens if decode else 1, placement=setup.placement,
                min_sample_s=setup.min_sample_s if mode != "kv_capacity" else 0.0)


def check_inference_case(case, spec, err) -> None:
    """The rules of one case at (or meant for) level inference."""
    if case.level != "inference":
        raise err("measure.modes", f"mode {case.mode!r} is an inference mode: it needs measure.level: inference")
    if case.mode not in INFERENCE_MODES:
        raise err("measure.modes", f"mode {case.mode!r} is not an inference mode; choose from {list(INFERENCE_MODES)}")
    if case.method not in INFERENCE_METHODS:
        raise err("methods", f"method {case.method!r} does not serve inference; at measure.level: inference the "
                             f"methods are {dict(INFERENCE_METHODS)}")
    if spec.kernels:
        raise err("kernels", "inference cases run the decode kernel of burst_impl.inference; remove kernels:")
    if not case.causal or case.mask:
        raise err("sweep.causal", "inference is causal language modelling: causal true and no mask")
    if case.merge == "heads" and case.heads % case.world_size:
        raise err("inference.merges", f"merge 'heads' leaves each rank heads={case.heads} / world_size="
                                      f"{case.world_size}: they must divide evenly (drop it with exclude: "
                                      f"[{{merge: heads, world_size: {case.world_size}}}])")
