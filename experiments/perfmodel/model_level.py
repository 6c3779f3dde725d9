"""Model level: a whole LLaMA-style model's step from the per-layer schedules (phase B).

    t_step = L x (attention layer + MLP block) + LM head + exposed weight sync (all-reduce or ZeRO-3's)

* attention layer: the method's layer-level schedule (``model.predict_case(level="layer")``: QKV
  projection, attention, output projection, the method's communication);
* MLP block (``mlp_schedule``): the SwiGLU GEMMs (gate and up: H -> 2F, down: F -> H; backward
  twice the forward) and the elementwise work around them (two RMSNorms, SwiGLU, two residual
  adds; HBM-bound). Sequence-parallel methods run it on their N/G tokens with full weights and no
  communication; tensor parallelism runs it on all N tokens with F/G columns and pays the MLP's
  own collectives (V1: all-reduce of the (B, N, H) output forward and of dX backward; V3:
  all-gather before, reduce-scatter after; V3's norms and residual adds on its N/G tokens), whose
  bytes are the registry's formulas for the attention layer's collectives (the same (B, N, H)
  tensor): they are ``take``n from ``Method.bytes`` like every other transfer, so they equal it
  by construction;
* LM head: training, GEMMs of (tokens x H) @ (H x V) per rank (sequence parallel: N/G tokens; TP:
  vocab-parallel, N tokens x V/G): ``loss="unfused"`` 3 (forward, d hidden, d W_head);
  ``loss="fused"`` 3 as well, from ``burst_impl.loss``'s training path: each chunk of tokens'
  (rows x vocab) logits tile is computed once and turned into d hidden and d W_head in the forward,
  the backward only scales them; ``loss="fused_recompute"`` 4 (its lse-only forward and its
  backward's recomputation of every tile before the d hidden and d W_head GEMMs). The tiles'
  elementwise work (exp, max, sums) is not timed, in any mode. Prefill: the last token only, or with
  ``head="local"`` every token the rank holds (the BurstAttention authors' timing; TP-V1: all N);
* training, sequence-parallel methods with replicated weights: a ring all-reduce of the bf16 weight
  gradients over the G ranks, overlapped with the backward pass (bucketed, as DDP and FSDP do), so only
  what outlasts the backward is exposed (all of it on a cost model without side streams, a CPU rank:
  ``parallel.sync_grads`` runs after the backward); under ``weights="fsdp2"`` (ZeRO-3 over the G ranks)
  FSDP2's per-block all-gathers (before the forward, again before the backward) and reduce-scatters (after
  the backward) on one rank's timeline with the step's compute, prefetched and overlapped as FSDP2's and
  BMTrain's streams allow, sharing the links with the attention's own transfers (``schedules/zero3.py``,
  bytes from ``burst_impl.model.fsdp``'s one formula): ``parts["zero3_exposed"]``, what they add to the
  step. TP holds 1/G of the weights: none.
* a USP's cache (``burst_usp`` under "seq"/"whole", ``schedules.ulysses.usp_cache_bytes``): the
  all-to-alls its backward from (O, lse) sends again (q, k, v, O and lse to head shards) and the lse's
  own, blocking, in the Ulysses groups, with the registry's bytes (``parts["cache_a2a"]``).
* ``checkpoint`` (``burst_impl/model/checkpoint.py``'s modes; methods other than the BurstAttention
  operator run "seq" as "full", ``checkpoint.method_mode``): "none" recomputes nothing; "full" every
  layer's forward once more during the backward (attention layer + MLP block); "seq" the same
  except attention: the cached (O, lse) of the second half of each rank's tokens leaves, with a
  zigzag layout, the first global half attending to itself, i.e. the method's attention forward at
  N/2 on the same G ranks (1/4 of the causal FLOPs, half the ring's bytes), timed as that; "whole"
  caches every O and lse: the recompute is the layer's forward without the attention core.

Memory per rank (``ModelPrediction.memory``), against the accelerator's HBM:

* training: ``burst_impl.model.memory.step_memory`` (weights, AdamW state and gradients by
  ``weights``: "replicated", "fsdp2" (ZeRO-3) or "tp" (1/G of everything); activations by checkpoint
  mode; logits by ``loss``; the attention method's saved tensors) with the case's shape and the
  registry base method; the effective checkpoint mode; the fused loss's CUDA tiles (``loss_device="cuda"``),
  with the attention layer's transient buffers (the schedule's, per phase) placed at the step's
  attention moments (its forward, its recompute, its backward: ``step_memory``'s moments);
* training, a row a paper spec ran with a peer implementation (``peer_memory.RUNS``: BurstEngine's
  main table and ablation, Fig. 3's headline rows): that implementation's attention terms, its
  framework's state (optimizer offload, fp32 gradients, ZeRO-3 neighbours, ...), its loss's buffers
  and the phases its harness measures (``peer_memory.peer_step``; docs/memory.md);
* prefill: the weights (by ``weights``; FSDP2 adds one gathered block), the attention layer's
  modelled peak (``memory.peak_memory``: its input, its layer weights again, kept and transient
  buffers) and one layer's MLP activations on the local tokens (3H + 4F per token: the norm's
  tensors and the SwiGLU's; TP: all N tokens, F/G). The KV cache of the other layers (kept by a
  server that goes on to decode) is not counted.

A case is "oom" when the layer alone does not fit (``model.predict_case``) or when the whole
model's total per rank exceeds the device's usable memory (``usable_memory.capacity``: the total the
CUDA runtime reports less the CUDA context and the implementation's NCCL buffers, each sourced; a
device without a sourced total keeps ``hardware.accelerator.hbm_gib``); the reason names the total
and the largest part. Allocator fragmentation is not counted (modelled: allocated, never reserved).

Not modelled: the embedding lookup, the optimizer step, pipeline or data parallelism beyond the
G ranks. FLOPs, TFLOP/s and MFU use the model's FLOP convention (``burst_impl.model.flops``:
6 x params x tokens + attention, causal halved, recompute not counted).
"""
from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field

from baselines import AttnShape, get
from burst_impl.model.checkpoint import check_mode, method_mode
from burst_impl.model.config import ModelConfig, get_config, layer_params, num_params
from burst_impl.model.flops import model_flops
from burst_impl.model.memory import WEIGHTS, AttentionTerms, step_memory

from ..harness.record import Memory, Record
from .costs import CostModel
from .memory import GIB
from .peer_memory import FRAMEWORKS, peer_step
from .usable_memory import capacity as usable
from .model import _cost_model, predict_case
from .placement import Placement
from .schedules import builder, zero3
from .schedules.common import Ctx, ring_collective
from .schedules.ulysses import usp_cache_all_to_alls, usp_cache_bytes
from .simulator import Schedule

# (tokens x vocab x hidden) GEMMs of the LM head in a training step, by loss mode (module docstring)
HEAD_GEMMS = {"unfused": 3, "fused": 3, "fused_recompute": 4}
# ... of which in the forward: unfused the logits; fused all three (the gradients are computed in the forward);
# fused_recompute its lse-only pass (FSDP2's timeline, ``zero3_exposed``, places the rest in the backward)
HEAD_FORWARD_GEMMS = {"unfused": 1, "fused": 3, "fused_recompute": 1}
# Prefill's LM head: on the last token ("last", a server's first token) or on every token a rank holds at the
# end ("local": the BurstAttention authors' timed forward, docs/hardware_burstattention.md "What the authors'
# runs used": their head is one replicated (V, H) weight, so TP-V1, whose ranks all hold every token, runs all N)
PREFILL_HEADS = ("last", "local")


def prefill_head_rows(method: str, shape: AttnShape, head: str) -> int:
    """Token rows of the prefill LM head's (rows x V) @ (V x H) GEMM on one rank (``PREFILL_HEADS``)."""
    if head not in PREFILL_HEADS:
        raise ValueError(f"head={head!r}: the prefill LM head runs on {PREFILL_HEADS}")
    if head == "last":
        return shape.batch
    return shape.batch * (shape.seqlen if method == "tp_v1" else shape.seqlen // shape.world_size)
# Paper spec -> the model it is a layer of (docs/papers.md §3); the shapes are checked against it.
SPEC_MODELS = {
    "table2_prefill_7b_8gpu": "llama2_7b", "table3_prefill_13b_8gpu": "llama2_13b",
    "fig2_train_7b_8gpu": "llama2_7b", "fig3_train_7b_32gpu": "llama2_7b",
    "fig4a_scaling_13b_64k": "llama2_13b", "fig4b_batch_7b_4k": "llama2_7b",
    "burstengine_double_ring_32gpu": "llama2_7b",
}
# Paper spec -> its prefill LM head as the paper timed it (PREFILL_HEADS; absent: "last"): BurstAttention's
# Tables 2-3 time the whole forward with the head on every local token (docs/hardware_burstattention.md).
SPEC_PREFILL_HEAD = {"table2_prefill_7b_8gpu": "local", "table3_prefill_13b_8gpu": "local"}
ASSUMPTIONS = (
    "model step = layers x (attention layer schedule + MLP block schedule) + LM head + exposed gradient sync",
    "MLP: SwiGLU GEMMs at the profile's GEMM efficiency, norms/SwiGLU/residuals HBM-bound; TP's MLP collectives "
    "carry the registry's bytes for the attention layer's (same (B, N, H) tensor)",
    "sequence-parallel methods, replicated weights: their bf16 weight gradients are ring-all-reduced over the G "
    "ranks, overlapped with the backward (only the excess is exposed); FSDP2 (ZeRO-3): each block's all-gather "
    "before its forward (one block ahead) and its backward (prefetched one block ahead), its reduce-scatter after "
    "its backward, the root's at the ends, one after another on the links they share with the attention's "
    "transfers (schedules/zero3.py); TP needs no weight sync",
    "checkpoint full: every layer's forward once more in the backward; seq: the same with the attention "
    "forward at N/2 instead of N (the cached second halves leave the first global half attending to itself)",
    "LM head: 3 (tokens x vocab x hidden) GEMMs per training step with the unfused loss and with the fused one "
    "(gradients computed in the forward), 4 with fused_recompute (its backward recomputes every logits tile); "
    "the tiles' elementwise work not timed; prefill: the last token, or every token a rank holds where the paper "
    "timed it so (SPEC_PREFILL_HEAD: BurstAttention Tables 2-3; TP-V1 all N, its head weight replicated)",
    "memory per rank: training = burst_impl.model.memory.step_memory (weights/optimizer/gradients by sharding, "
    "activations by checkpoint mode, logits by loss mode, the attention layer's transient buffers at the step's "
    "moments; a peer implementation's own terms, state and measured phases where the spec's row ran one: "
    "peer_memory.RUNS); prefill = weights + the attention layer's modelled peak + one layer's MLP activations; "
    "OOM when over the device's usable memory (usable_memory)",
    "burst_usp under checkpoint seq/whole: the cache's all-to-alls (q, k, v, O, lse to head shards again in the "
    "backward, the lse's own in the forward) as blocking all-to-alls with the registry's bytes",
    "not modelled: embedding, optimizer step, KV cache in prefill, allocator fragmentation (memory is allocated, "
    "not reserved)",
)


@dataclass
class ModelPrediction:
    method: str
    config: ModelConfig
    shape: AttnShape
    mode: str                      # "forward" (prefill) or "fwd_bwd" (training)
    time_s: float
    parts: dict                    # seconds: attention, mlp, head, grad_sync_exposed, recompute (whole model)
    flops: float                   # model FLOPs of the step (burst_impl.model.flops)
    critical_comm_s: float         # communication on the critical path, whole model
    mlp_bytes: dict                # {(phase, kind): bytes} one rank sends in ONE layer's MLP block
    mlp_registry_bytes: dict       # the registry formula those bytes come from
    status: str                    # "oom" when the layer or the whole model does not fit (module docstring)
    reason: str
    attention: object              # the layer-level Prediction
    memory: dict = field(default_factory=dict)   # bytes per rank: model_memory()
    cache_bytes: dict = field(default_factory=dict)   # {(phase, kind): bytes} ONE layer's cache all-to-alls send


def check_shape(cfg: ModelConfig, shape: AttnShape) -> None:
    if (shape.heads, shape.kv_heads, shape.head_dim) != (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim):
        raise ValueError(f"shape heads={shape.heads}, kv_heads={shape.kv_heads}, head_dim={shape.head_dim} is not "
                         f"model {cfg.name!r}'s ({cfg.n_heads}, {cfg.n_kv_heads}, {cfg.head_dim})")
    if cfg.mask and cfg.mask != shape.mask:
        raise ValueError(f"shape mask={shape.mask!r} is not model {cfg.name!r}'s mask={cfg.mask!r}")


def shape_config(cfg: ModelConfig | str, shape: AttnShape) -> ModelConfig:
    """The model (a config or its name) of a step on ``shape``, checked against it (``check_shape``), with the
    shape's mask (a spec's mask axis): the attention schedule times each rank's live tiles of it on the shape's
    layout, and the FLOPs count its area (``model_flops``)."""
    cfg = get_config(cfg) if isinstance(cfg, str) else cfg
    check_shape(cfg, shape)
    return dataclasses.replace(cfg, mask=shape.mask)


def mlp_schedule(method: str, cfg: ModelConfig, shape: AttnShape, cost: CostModel, place: Placement,
                 mode: str) -> tuple[Schedule, dict, dict]:
    """One layer's MLP block (with its norms and residuals) on every rank: (schedule, sent, registry)."""
    G, b, h, e = shape.world_size, shape.batch, cfg.hidden, shape.elem_size
    tp = get(method).level == "layer"
    tokens = b * shape.seqlen if tp else b * shape.seqlen // G
    f = cfg.ffn_hidden // G if tp else cfg.ffn_hidden
    table = {k: v for k, v in get(method).bytes(shape).items() if tp and v}
    registry = dict(table)
    ctx = Ctx(sch=Schedule(), cost=cost, place=place, shape=shape, mode=mode, level="layer", table=dict(table))
    t_gate_up, f_gate_up = cost.gemm(tokens, 2 * f, h)
    t_down, f_down = cost.gemm(tokens, h, f)
    # two RMSNorms (read + write (T, H)), SwiGLU (read 2 (T, F), write 1), two residual adds (read 2, write 1);
    # TP-V3 runs its norms and residuals on its N/G tokens (sequence parallel), only the SwiGLU on all N
    seq = tokens // G if method == "tp_v3" else tokens
    elementwise = cost.hbm((2 * 2 * seq * h + 3 * tokens * f + 2 * 3 * seq * h) * e)
    group = list(range(G))
    ready: dict = {g: None for g in group}

    def coll(phase, kind, algo):
        nonlocal ready
        if not tp:
            return
        steps = 2 * (G - 1) if algo == "all_reduce" else G - 1
        ready = ring_collective(ctx, group, phase=phase, name=f"mlp_{algo}_{kind}", nbytes=ctx.take(phase, (kind,)),
                                steps=steps, ready=ready)

    v3 = method == "tp_v3"
    for phase in ctx.phases:
        mult = 1 if phase == "forward" else 2
        if phase == "forward" and v3:
            coll(phase, "x", "all_gather")
        if phase == "backward" and v3:
            coll(phase, "dout", "all_gather")
        for g in group:
            ready[g] = ctx.compute(g, f"mlp.{phase}[r{g}]", mult * (t_gate_up + t_down + elementwise), deps=[ready[g]],
                                   phase=phase, flops=mult * (f_gate_up + f_down))
        if phase == "forward":
            coll(phase, "out", "reduce_scatter" if v3 else "all_reduce")
        else:
            coll(phase, "dx", "reduce_scatter" if v3 else "all_reduce")
    ctx.check_consumed(method)
    sent = ctx.sch.bytes_sent().get(0, {})
    return ctx.sch, sent, {k: v for k, v in registry.items() if k[0] in ctx.phases}


def cache_schedule(method: str, shape: AttnShape, checkpoint: str, cost: CostModel, place: Placement,
                   options: dict | None) -> Schedule:
    """One layer's all-to-alls of a USP's cache under ``checkpoint`` (``usp_cache_bytes``; an empty schedule
    for every other method and mode), their bytes taken from the formula like every transfer."""
    table = usp_cache_bytes(method, shape, checkpoint, options)
    ctx = Ctx(sch=Schedule(), cost=cost, place=place, shape=shape, mode="fwd_bwd", level="layer", table=dict(table),
              options=dict(options or {}))
    if table:
        usp_cache_all_to_alls(ctx, method, checkpoint)
        ctx.check_consumed(method)
    return ctx.sch


def recompute_time(method: str, base: str, cfg: ModelConfig, shape: AttnShape, checkpoint: str, *,
                   cost: CostModel, place: Placement, options: dict | None, costs) -> float:
    """Seconds the backward spends re-running forwards under the effective ``checkpoint`` (module docstring):
    "full" every layer's forward once more (attention layer + MLP block), "seq" the same with the attention
    forward at N/2 in place of the one at N, "whole" without the attention forward; "none" nothing."""
    if checkpoint == "none":
        return 0.0

    def forward(s: AttnShape, level: str) -> float:
        return predict_case(method, s, mode="forward", level=level, hardware=cost.hw, options=options,
                            costs=costs).time_s

    fwd = forward(shape, "layer")
    if checkpoint in ("seq", "whole"):
        fwd -= forward(shape, "op")
        if checkpoint == "seq":
            fwd += forward(dataclasses.replace(shape, seqlen=shape.seqlen // 2), "op")
    return cfg.n_layers * (fwd + mlp_schedule(base, cfg, shape, cost, place, "forward")[0].makespan)


_SYNC: dict = {}


def grad_sync_time(cost: CostModel, place: Placement, shape: AttnShape, params: int) -> float:
    """Ring all-reduce of ``params`` gradients (input dtype) over the G ranks, as the simulator runs it
    (memoised for a profile's own cost model: it depends on the profile, G and the size only, not on the
    sequence; another cost model, ``emulated.costs.EmulatedCosts``, is asked afresh)."""
    G = shape.world_size
    key = (repr(cost.hw), G, params, shape.elem_size)
    if type(cost) is not CostModel:
        _SYNC.pop(key, None)
    if key not in _SYNC:
        grads = {("backward", "grads"): 2 * (G - 1) * params * shape.elem_size // G}
        ctx = Ctx(sch=Schedule(), cost=cost, place=place, shape=shape, mode="backward", level="layer", table=grads)
        ring_collective(ctx, list(range(G)), phase="backward", name="grad_allreduce",
                        nbytes=ctx.take("backward", ("grads",)), steps=2 * (G - 1), ready={g: None for g in range(G)})
        _SYNC[key] = ctx.sch.makespan
    return _SYNC[key]


def weight_sync(method: str, cfg: ModelConfig, shape: AttnShape, attn, parts: dict, *, weights: str, loss: str,
                checkpoint: str, cost: CostModel, place: Placement, options: dict | None, costs) -> dict:
    """The exposed seconds of a sequence-parallel step's weight synchronisation (module docstring):
    replicated weights, ``{"grad_sync_exposed": ...}``, the gradient all-reduce less the backward it hides
    under (all of it without side streams: ``parallel.sync_grads`` runs after the backward, blocking on a CPU
    rank); FSDP2, ``{"zero3_exposed": ...}``, ``zero3_exposed``."""
    if weights == "fsdp2":
        return {"zero3_exposed": zero3_exposed(method, cfg, shape, attn, parts, loss=loss, checkpoint=checkpoint,
                                               cost=cost, place=place, options=options, costs=costs)}
    # the backward is ~2 of the 3 forward-equivalents of the layers' time
    backward = (parts["attention"] + parts["mlp"]) * 2 / 3 if cost.side_streams else 0.0
    return {"grad_sync_exposed": max(0.0, grad_sync_time(cost, place, shape, num_params(cfg)) - backward)}


def zero3_exposed(method: str, cfg: ModelConfig, shape: AttnShape, attn, parts: dict, *, loss: str, checkpoint: str,
                  cost: CostModel, place: Placement, options: dict | None, costs) -> float:
    """Seconds FSDP2's (ZeRO-3's) all-gathers and reduce-scatters add to the step (``schedules.zero3``), from
    the step's compute per block: forward = the attention layer's forward + the MLP block's; backward = the
    rest of the layer's share of ``parts`` (its backward, its recompute, the cache's all-to-alls); the LM head
    split by its GEMMs (``HEAD_FORWARD_GEMMS``). The attention's own transfers hold the collectives' channel
    for their busy seconds (its forward, its backward, and the recompute's attention forward)."""
    L = cfg.n_layers
    coll = zero3.collectives(cfg, shape, cost, place)

    def busy(s: AttnShape, mode: str, level: str) -> tuple[float, float]:
        p = predict_case(method, s, mode=mode, level=level, hardware=cost.hw, options=options, costs=costs)
        return (p.time_s if mode == "forward" else 0.0), p.breakdown["busy_max_s"].get(coll.channel, 0.0)

    fwd_s, fwd_busy = busy(shape, "forward", "layer")
    recompute_busy = {"full": fwd_busy, "seq": busy(dataclasses.replace(shape, seqlen=shape.seqlen // 2),
                                                     "forward", "op")[1] if checkpoint == "seq" else 0.0}
    forward = zero3.Window(fwd_s + mlp_schedule(attn.base_method, cfg, shape, cost, place, "forward")[0].makespan,
                           fwd_busy)
    layer = (parts["attention"] + parts["mlp"] + parts["recompute"] + parts["cache_a2a"]) / L
    backward = zero3.Window(layer - forward.seconds, attn.breakdown["busy_max_s"].get(coll.channel, 0.0) - fwd_busy
                            + recompute_busy.get(checkpoint, 0.0))
    head_fwd = parts["head"] * HEAD_FORWARD_GEMMS[loss] / HEAD_GEMMS[loss]
    step = zero3.step_seconds(forward, backward, zero3.Window(head_fwd), zero3.Window(parts["head"] - head_fwd), L,
                              coll, cost.side_streams)
    return max(0.0, step - (L * layer + parts["head"]))


def model_memory(base: str, cfg: ModelConfig, shape: AttnShape, attn, *, mode: str, weights: str,
                 checkpoint: str, loss: str, implementation=None) -> dict:
    """Bytes per rank of the whole model's step or prefill (module docstring, "Memory per rank").

    ``parts``: the components (they overlap in time, so the total is not their sum in training:
    ``step_memory`` takes the largest of its moments); ``step``: ``step_memory``'s fields (training).
    ``implementation``: a ``peer_memory.Implementation`` the row ran (its terms, state, loss and
    measured phases: ``peer_memory.peer_step``), else the suite's own (the registry method's kept bytes
    and its schedule's transient buffers, placed at the step's moments)."""
    G, b, e = shape.world_size, shape.batch, shape.elem_size
    layer = attn.memory
    common = dict(batch=b, seqlen=shape.seqlen, world_size=G, method=get(base), layout=shape.layout, dtype=shape.dtype,
                  weights=weights)
    accelerator, peer = attn.hardware.accelerator, {}
    if mode == "fwd_bwd":
        if implementation is None:
            phase = layer.get("transient_by_phase", {})
            terms = AttentionTerms(forward=phase.get("forward", 0), backward=phase.get("backward", 0))
            sm = step_memory(cfg, checkpoint=checkpoint, loss=loss, loss_device="cuda", attention=terms, **common)
        else:
            sm, state = peer_step(implementation, cfg, shape, base=get(base), weights=weights, checkpoint=checkpoint,
                                  loss=loss)
            peer_terms = implementation.attention(shape)
            terms = peer_terms.attention() if peer_terms is not None else AttentionTerms()
            peer = {"implementation": implementation.name, "offload": state.offload, "host_bytes": state.host_bytes,
                    "pcie_bytes_per_step": state.pcie_bytes_per_step,
                    "measured": FRAMEWORKS[implementation.framework].measured,
                    "attention_terms": peer_terms.as_dict() if peer_terms is not None else None}
        # the parts overlap in time: the total is step_memory's largest moment (``step``: its moments)
        parts = {"weights": sm.weights, "optimizer": sm.optimizer, "grads": sm.grads, "activations": sm.activations,
                 "recompute": sm.recompute, "logits": sm.logits, "gathered": sm.gathered,
                 "attention_transient": max(terms.forward, terms.backward)}
        resident, total, step = sm.resident_bytes, sm.total_bytes, sm.as_dict()
    else:
        checkpoint = loss = None
        sm = step_memory(cfg, checkpoint="none", loss="unfused", optimizer=False, **common)
        tp = weights == "tp"
        tokens = b * shape.seqlen if tp else b * shape.seqlen // G       # TP: the MLP runs on all N tokens
        ffn = cfg.ffn_hidden // G if tp else cfg.ffn_hidden
        parts = {"weights": sm.weights, "gathered": layer_params(cfg) * e if weights == "fsdp2" and G > 1 else 0,
                 "attention_layer": layer["total_bytes"],
                 "mlp_activations": tokens * (3 * cfg.hidden + 4 * ffn) * e}
        resident, total, step = sm.weights, sum(parts.values()), None
    cap = usable(accelerator, implementation.comms if implementation is not None else None, attn.hardware.intra.kind)
    return {"total_bytes": total, "resident_bytes": resident, "capacity_bytes": cap["capacity_bytes"],
            "capacity_parts": cap["parts"], "capacity_basis": cap["basis"], "oom": total > cap["capacity_bytes"],
            "layer_oom": bool(layer["oom"]), "parts": parts, "largest": max(parts, key=parts.get),
            "weights": weights, "checkpoint": checkpoint, "loss": loss, "step": step, **peer}


def predict_model(method: str, cfg: ModelConfig | str, shape: AttnShape, *, mode: str, hardware,
                  checkpoint: str = "none", options: dict | None = None, weights: str | None = None,
                  loss: str = "unfused", costs=None, head: str = "last", implementation=None) -> ModelPrediction:
    """One training step (``mode="fwd_bwd"``) or prefill (``"forward"``) of the whole model.

    ``weights``: "replicated" (the BurstAttention paper's runs), "fsdp2" (ZeRO-3 over the G ranks,
    BurstEngine's runs) or "tp" (tensor parallelism: 1/G of the weights); None is "tp" for TP
    methods, else "replicated". ``loss``: the LM head's loss, "unfused", "fused" (training: the same
    head GEMMs, no stored logits) or "fused_recompute" (one more head GEMM). ``checkpoint``: "none",
    "full", "seq" or "whole" (training; a method that cannot cache runs "seq"/"whole" as "full").
    ``costs(hw, dtype) -> CostModel`` replaces the profile's cost model everywhere in the step
    (``emulated.costs.EmulatedCosts``: the emulated cluster's validation, ``emulated/validate.py``).
    ``head``: prefill's LM head on the "last" token or on every "local" one (``PREFILL_HEADS``).
    ``implementation``: the peer implementation the row ran (``peer_memory.implementation_of``): its memory
    (``model_memory``); the time is the suite's schedule either way."""
    if mode not in ("forward", "fwd_bwd"):
        raise ValueError(f"mode={mode!r}: a model step is 'forward' (prefill) or 'fwd_bwd' (training)")
    if loss not in HEAD_GEMMS:
        raise ValueError(f"loss={loss!r}: the LM head's time is modelled for {tuple(HEAD_GEMMS)}")
    if head not in PREFILL_HEADS:
        raise ValueError(f"head={head!r}: the prefill LM head runs on {PREFILL_HEADS}")
    tp = get(builder(method)[0]).tp_version is not None
    weights = ("tp" if tp else "replicated") if weights is None else weights
    if weights not in WEIGHTS or (weights == "tp") != tp:
        raise ValueError(f"weights={weights!r} with method {method!r}: tensor-parallel methods (tp_version set) hold "
                         "weights='tp', the others 'replicated' or 'fsdp2'")
    cfg = shape_config(cfg, shape)
    attn = predict_case(method, shape, mode=mode, level="layer", hardware=hardware, options=options, costs=costs)
    hw = attn.hardware
    # the profile's one cost model, as the layer's prediction used (or the caller's)
    cost = costs(hw, shape.dtype) if costs is not None else _cost_model(hw, shape.dtype)
    place = Placement.of(hw, shape.world_size)
    base = attn.base_method
    mlp, mlp_sent, mlp_registry = mlp_schedule(base, cfg, shape, cost, place, mode)
    G, b, L = shape.world_size, shape.batch, cfg.n_layers
    train = mode == "fwd_bwd"
    if train:
        rows, cols = (b * shape.seqlen, cfg.vocab_size // G) if tp else (b * shape.seqlen // G, cfg.vocab_size)
        head = HEAD_GEMMS[loss] * cost.op_seconds(cost.gemm(rows, cols, cfg.hidden)[0])
    else:
        head = cost.op_seconds(cost.gemm(prefill_head_rows(builder(method)[0], shape, head), cfg.vocab_size,
                                         cfg.hidden)[0])
    checkpoint = method_mode(get(base), check_mode(checkpoint)) if train else "none"
    recomp = recompute_time(method, base, cfg, shape, checkpoint, cost=cost, place=place, options=options,
                            costs=costs)
    cache = cache_schedule(base, shape, checkpoint, cost, place, options)
    parts = {"attention": L * attn.time_s, "mlp": L * mlp.makespan, "head": head, "grad_sync_exposed": 0.0,
             "recompute": recomp, "cache_a2a": L * cache.makespan, "zero3_exposed": 0.0}
    if train and not tp and G > 1:
        parts.update(weight_sync(method, cfg, shape, attn, parts, weights=weights, loss=loss, checkpoint=checkpoint,
                                 cost=cost, place=place, options=options, costs=costs))
    sync = parts["grad_sync_exposed"] + parts["zero3_exposed"]
    total = sum(parts.values())
    crit = L * (attn.breakdown["critical_comm_s"] + mlp.breakdown()["critical_comm_s"]
                + cache.breakdown()["critical_comm_s"]) + sync
    flops = model_flops(cfg, b, shape.seqlen, mode="train" if train else "prefill", causal=shape.causal)["total"]
    mem = model_memory(base, cfg, shape, attn, mode=mode, weights=weights, checkpoint=checkpoint, loss=loss,
                       implementation=implementation if train else None)
    status, reason = attn.status, attn.reason
    if mem["oom"]:
        what = (f"modelled whole-model memory {mem['total_bytes'] / GIB:.1f} GiB per rank exceeds the "
                f"{mem['capacity_bytes'] / GIB:.3g} GiB of {hw.accelerator.name} (largest part: {mem['largest']} "
                f"{mem['parts'][mem['largest']] / GIB:.1f} GiB; weights {weights}"
                + (f", checkpoint {mem['checkpoint']}, loss {loss})" if train else ", prefill)"))
        status, reason = "oom", (f"{reason}; {what}" if reason else what)
    return ModelPrediction(method=method, config=cfg, shape=shape, mode=mode, time_s=total, parts=parts, flops=flops,
                           critical_comm_s=crit, mlp_bytes=mlp_sent, mlp_registry_bytes=mlp_registry,
                           status=status, reason=reason, attention=attn, memory=mem,
                           cache_bytes=cache.bytes_sent().get(0, {}))


def model_record(layer_record: Record, mp: ModelPrediction, experiment: str) -> Record:
    """A model-level record made from the layer-level one (same schema, ``level: "model"``): its memory is
    the whole step's, not the layer's."""
    rec = dataclasses.replace(copy.deepcopy(layer_record), memory=Memory())
    s, m = mp.shape, mp.memory
    t = mp.time_s if mp.status == "ok" else None
    peak = mp.attention.hardware.accelerator.peak_tflops[s.dtype] * 1e12
    rec.update({
        "status": mp.status, "reason": mp.reason,
        # as measured model-level records (experiments/harness/model_record.py): the state per rank and the
        # step's peak above it, so experiments/plots_model.py draws their sum (and marks OOM) the same way
        "mem_peak_bytes": m["total_bytes"] - m["resident_bytes"],
        "mem_state_bytes_per_rank": [m["resident_bytes"]] * s.world_size,
        "mem_total_bytes": m["total_bytes"],
        "mem_parts_bytes": m["parts"],
        "mem_method": "modelled: " + ("burst_impl.model.memory.step_memory + the attention layer's transient buffers"
                                      if mp.mode == "fwd_bwd" else "weights + attention layer peak + one MLP's "
                                      "activations"),
        "mem_measured_over": "modelled " + ("training step" if mp.mode == "fwd_bwd" else "prefill"),
        "weights": {"tp": "tensor_parallel"}.get(m["weights"], m["weights"]), "zero": m["weights"] == "fsdp2",
        "checkpoint": m["checkpoint"], "loss": m["loss"],
        "experiment": experiment, "level": "model", "model_config": mp.config.name,
        "case_id": rec["case_id"].replace(".layer.", ".model.").replace(".op.", ".model."),
        "config": {**rec["config"], "experiment": experiment, "level": "model", "model": mp.config.name},
        "time_model_s": mp.time_s, "time_median_s": t, "flops": mp.flops,
        "flops_convention": "burst_impl.model.flops: 6 x matmul params x tokens + attention (causal halved), "
                            "recompute not counted",
        "tflops_total": mp.flops / t / 1e12 if t else None,
        "tflops_per_rank": mp.flops / t / 1e12 / s.world_size if t else None,
        "mfu": mp.flops / t / (s.world_size * peak) if t else None,
        "tokens_per_s": s.batch * s.seqlen / t if t else None,
    })
    for phase, key in (("forward", "comm_fwd"), ("backward", "comm_bwd")):
        cache = sum(v for (p, _), v in mp.cache_bytes.items() if p == phase)    # placed = formula by construction
        add = sum(v for (p, _), v in mp.mlp_bytes.items() if p == phase) + cache
        add_f = sum(v for (p, _), v in mp.mlp_registry_bytes.items() if p == phase) + cache
        if rec.get(f"{key}_bytes") is not None:
            rec[f"{key}_bytes"] += add
        rec[f"{key}_formula_bytes"] = (rec.get(f"{key}_formula_bytes") or 0) + add_f
    rec["comm_measured_over"] = ("modelled schedule, one layer (attention layer + MLP block"
                                 + (" + the cache's all-to-alls)" if mp.cache_bytes else ")"))
    rec["prediction"] = {**rec["prediction"], "level": "model", "parts_s": mp.parts, "memory": m,
                         "layer_memory": rec["prediction"]["memory"], "assumptions":
                         list(rec["prediction"]["assumptions"]) + list(ASSUMPTIONS),
                         "breakdown": {"makespan_s": mp.time_s, "critical_comm_s": mp.critical_comm_s}}
    return rec


def with_layer_level(case):
    """An op-level case of a spec, lifted to the attention layer (projections included)."""
    return dataclasses.replace(case, level="layer") if case.level == "op" else case
