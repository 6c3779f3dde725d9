"""Inference cases through the model: time to first token, time per output token, KV capacity (docs/inference.md).

    p = predict_inference("cp_all_gather", shape, mode="decode", hardware="h100_sxm_ib_4x8")
    p.time_s, p.bytes_per_rank, p.kv_bytes_per_rank
    m = predict_inference_model("tp", "llama3_8b", shape, mode="decode", hardware=...)   # the whole decoder

One attention layer (what the benchmark measures, ``baselines/decode_layer.py``):

* ``decode``: the step's schedule (``schedules/decode.py``), bytes taken from ``decode_layer_bytes``;
* ``ttft``: the prompt's prefill is the layer's forward as the model already has it (``model.predict_case``
  at level layer: ``burst``'s ring forward, pass-KV, for context parallelism; ``tp_v1``'s layer for TP) plus
  each rank's write of its K/V into the cache (HBM);
* ``kv_capacity``: nothing timed; the K/V bytes per rank (``inference_steps.kv_cache_bytes``).

The whole decoder (``predict_inference_model``, a spec with ``inference.model``): decode = L x (the layer's
step + the MLP block, ``schedules.decode.mlp_block``) + the LM head (replicated, or vocab-parallel V/G
for the rows that shard the FFN); TTFT = ``model_level.predict_model``'s prefill (the prompt's forward
and the first token's head) + the K/V writes of every layer. Memory per rank = weights (``weights_bytes``)
+ L layers' caches; over the accelerator's memory is "oom"; the context that fits is
``kv_capacity_tokens``. ``costs(hw, dtype)`` replaces the decode cost model (the emulated validation).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from baselines.decode_layer import ROWS, check_row, decode_layer_bytes, prefill_layer_bytes
from burst_impl.model.config import ModelConfig, get_config, layer_params, num_params
from burst_impl.shape import AttnShape

from ..harness.inference_steps import kv_cache_bytes
from ..profiles.hardware import Hardware, load_hardware
from .decode_costs import DecodeCosts
from .memory import GIB
from .model import predict_case
from .model_level import predict_model
from .placement import Placement
from .schedules.common import Ctx
from .schedules.decode import decode_layer, mlp_block
from .simulator import Schedule

MODES = ("ttft", "decode", "kv_capacity")
METHOD_OF = {"cp_all_gather": "burst", "cp_heads": "burst", "tp": "tp_v1"}    # the prefill's registry method
ASSUMPTIONS = (
    "decode: one step of one attention layer per rank in program order (QKV projection of the new tokens, per "
    "sequence the cache append and the new queries over the rank's keys, the merge's two collectives and the "
    "log-sum-exp merge, the output projection, its all-reduce where W_o is row-parallel); collectives as NCCL's "
    "ring algorithm (all-gather, all-reduce) or concurrent pieces (all-to-all)",
    "decode kernels memory-bound: new queries over the cache at max(FLOPs at the flash efficiency, K/V bytes at "
    "the HBM rate); GEMMs against a weight at max(GEMM rate, the weight's bytes at the HBM rate)",
    "TTFT: the layer's forward as modelled for training specs (Burst ring pass-KV; TP V1) plus each rank's K/V "
    "write into the cache",
    "whole model: L x (attention layer + MLP) + LM head; the all-gather row replicates every weight, the heads "
    "(Helix) and TP rows shard W_o, the MLP and the LM head 1/G (Helix keeps QKV replicated), all-reducing the "
    "outputs; no pipeline or data parallelism; memory = weights + every layer's cache, OOM over the HBM "
    "(CUDA context, NCCL buffers and activations not subtracted)",
)


@dataclass
class InferencePrediction:
    row: str
    mode: str
    shape: AttnShape
    hardware: Hardware
    time_s: float | None                 # the step (one layer, or the whole model); None for kv_capacity
    critical_comm_s: float = 0.0
    critical_compute_s: float = 0.0
    bytes_per_rank: dict = field(default_factory=dict)    # {rank: {(phase, kind): bytes}} simulated
    registry_bytes: dict = field(default_factory=dict)    # the formula they were taken from
    kv_bytes_per_rank: list = field(default_factory=list)
    parts: dict = field(default_factory=dict)
    memory: dict = field(default_factory=dict)
    notes: list = field(default_factory=list)

    @property
    def status(self) -> str:
        return "oom" if self.memory.get("oom") else "ok"


def _costs(hw: Hardware, dtype: str, costs) -> DecodeCosts:
    return costs(hw, dtype) if costs is not None else DecodeCosts(hw, dtype)


def _check(row: str, mode: str, shape: AttnShape, new_tokens: int) -> None:
    check_row(row)
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} is unknown; choose one of {MODES}")
    if new_tokens < 1:
        raise ValueError(f"new_tokens={new_tokens} must be >= 1")
    shape.validate()


def decode_schedule(row: str, shape: AttnShape, hw: Hardware, cost, new_tokens: int,
                    ffn_hidden: int | None = None) -> tuple[Ctx, dict]:
    """The decode step's schedule (+ the MLP block when ``ffn_hidden`` is given): (ctx, registry table)."""
    table = decode_layer_bytes(row, shape, new_tokens)
    ctx = Ctx(sch=Schedule(), cost=cost, place=Placement.of(hw, shape.world_size), shape=shape, mode="forward",
              level="layer", table=dict(table))
    ready = decode_layer(ctx, row, new_tokens)
    if ffn_hidden is not None:
        mlp_block(ctx, row, ffn_hidden, new_tokens, ready)
    ctx.check_consumed(row)
    return ctx, table


def predict_inference(row: str, shape: AttnShape, *, mode: str, hardware: Hardware | str, new_tokens: int = 1,
                      costs=None) -> InferencePrediction:
    """One attention layer's ``mode`` for ``row`` (module docstring); ValueError naming the rule for bad input."""
    _check(row, mode, shape, new_tokens)
    hw = load_hardware(hardware) if isinstance(hardware, str) else hardware
    cost = _costs(hw, shape.dtype, costs)
    g = shape.world_size
    context = shape.seqlen + (new_tokens if mode == "decode" else 0)
    kv = [kv_cache_bytes(row, shape, context, r) for r in range(g)]
    if mode == "kv_capacity":
        return InferencePrediction(row, mode, shape, hw, None, kv_bytes_per_rank=kv)
    if mode == "decode":
        ctx, table = decode_schedule(row, shape, hw, cost, new_tokens)
        b = ctx.sch.breakdown()
        return InferencePrediction(row, mode, shape, hw, ctx.sch.makespan, b["critical_comm_s"],
                                   b["critical_compute_s"], ctx.sch.bytes_sent(), table, kv, notes=ctx.notes)
    p = predict_case(METHOD_OF[row], shape, mode="forward", level="layer", hardware=hw,
                     costs=(lambda h, dt: cost) if costs is not None else None)
    write = cost.op_seconds(cost.hbm(max(kv)))      # the slowest rank writes its shard of K and V
    return InferencePrediction(row, mode, shape, hw, p.time_s + write, p.breakdown["critical_comm_s"],
                               p.breakdown["critical_compute_s"] + write, p.bytes_per_rank,
                               {k: v for r in range(g) for k, v in prefill_layer_bytes(row, shape, r).items()},
                               kv, parts={"forward": p.time_s, "cache_write": write}, notes=list(p.notes))


def weights_bytes(row: str, cfg: ModelConfig, world_size: int, elem: int) -> int:
    """Weights one rank holds (module docstring): all (all-gather row); 1/G of every matrix (TP); Helix:
    QKV, embedding and norms replicated, W_o, the MLP and the LM head 1/G."""
    g, h, d = world_size, cfg.hidden, cfg.head_dim
    if row == "cp_all_gather":
        return num_params(cfg) * elem
    if row == "tp":
        return math.ceil(num_params(cfg) / g) * elem
    qkv = h * (cfg.n_heads + 2 * cfg.n_kv_heads) * d
    sharded = cfg.n_layers * (layer_params(cfg) - qkv - 2 * h) + cfg.vocab_size * h
    kept = cfg.n_layers * (qkv + 2 * h) + cfg.vocab_size * h + h
    return (kept + math.ceil(sharded / g)) * elem


def kv_per_token(row: str, cfg: ModelConfig, shape: AttnShape) -> float:
    """K/V bytes one rank holds per token of context of one sequence, over the model's L layers."""
    probe = shape.world_size * (1 << 20)
    return cfg.n_layers * kv_cache_bytes(row, shape.replace(batch=1), probe, 0) / probe


def kv_capacity_tokens(row: str, cfg: ModelConfig, shape: AttnShape, hw: Hardware) -> int:
    """Tokens of context (over all sequences) whose cache fits beside the weights in one rank's memory."""
    free = hw.accelerator.hbm_gib * GIB - weights_bytes(row, cfg, shape.world_size, shape.elem_size)
    return max(0, int(free // kv_per_token(row, cfg, shape)))


def predict_inference_model(row: str, cfg: ModelConfig | str, shape: AttnShape, *, mode: str,
                            hardware: Hardware | str, new_tokens: int = 1, costs=None) -> InferencePrediction:
    """The whole decoder's ``mode`` (module docstring): TPOT, TTFT, or its KV capacity, with its memory."""
    _check(row, mode, shape, new_tokens)
    cfg = get_config(cfg) if isinstance(cfg, str) else cfg
    if (shape.heads, shape.kv_heads, shape.head_dim) != (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim):
        raise ValueError(f"shape heads={shape.heads}, kv_heads={shape.kv_heads}, head_dim={shape.head_dim} is not "
                         f"model {cfg.name!r}'s")
    hw = load_hardware(hardware) if isinstance(hardware, str) else hardware
    cost = _costs(hw, shape.dtype, costs)
    L, g, e = cfg.n_layers, shape.world_size, shape.elem_size
    layer = predict_inference(row, shape, mode=mode, hardware=hw, new_tokens=new_tokens, costs=costs)
    kv = [L * b for b in layer.kv_bytes_per_rank]
    weights = weights_bytes(row, cfg, g, e)
    capacity = int(hw.accelerator.hbm_gib * GIB)
    memory = {"weights_bytes": weights, "kv_bytes": max(kv), "total_bytes": weights + max(kv),
              "capacity_bytes": capacity, "oom": weights + max(kv) > capacity,
              "kv_capacity_tokens": kv_capacity_tokens(row, cfg, shape, hw)}
    out = InferencePrediction(row, mode, shape, hw, None, kv_bytes_per_rank=kv, memory=memory, notes=layer.notes)
    if mode == "decode":
        ctx, table = decode_schedule(row, shape, hw, cost, new_tokens, ffn_hidden=cfg.ffn_hidden)
        vocab = cfg.vocab_size if row == "cp_all_gather" else math.ceil(cfg.vocab_size / g)
        head = cost.op_seconds(cost.weight_gemm(shape.batch * new_tokens, vocab, cfg.hidden)[0])
        out.parts = {"layers": L * ctx.sch.makespan, "head": head}
        out.critical_comm_s = L * ctx.sch.breakdown()["critical_comm_s"]
        out.bytes_per_rank, out.registry_bytes = ctx.sch.bytes_sent(), table
    elif mode == "ttft":
        mp = predict_model(METHOD_OF[row], cfg, shape, mode="forward", hardware=hw)
        write = L * layer.parts["cache_write"]
        out.parts = {"prefill": mp.time_s, "cache_write": write}
        out.critical_comm_s = mp.critical_comm_s
        out.bytes_per_rank, out.registry_bytes = layer.bytes_per_rank, layer.registry_bytes
    out.time_s = sum(out.parts.values()) if out.parts else None
    return out


__all__ = ["ROWS", "InferencePrediction", "kv_capacity_tokens", "predict_inference", "predict_inference_model",
           "weights_bytes"]
