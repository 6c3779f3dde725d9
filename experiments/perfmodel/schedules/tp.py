"""Megatron tensor parallelism as an attention layer: ``tp_v1`` (all-reduce) and ``tp_v3``
(sequence parallel: all-gather before, reduce-scatter after); baselines/tp.py.

Each rank projects all N tokens onto its Z/G query heads (and the kv heads
they use), runs one flash kernel over the whole sequence for those heads,
projects back to a partial (B, N, H) output, and the group reduces it:
V1 all-reduces it (forward) and all-reduces dX (backward); V3 all-gathers X
first and reduce-scatters the output (backward: all-gather of dY,
reduce-scatter of dX). The collectives are on the critical path: nothing
overlaps them (as in the paper's Megatron V1/V3).

V3 against V1 (docs/hardware_burstattention.md, "TP-V3 against TP-V1"): the
same bytes per rank (an all-reduce is a reduce-scatter plus an all-gather), so
at one bus bandwidth the same transfer time; what separates them here is
(1) NCCL's base latency, paid once per collective (four per layer for V3, two
for V1) where the profile gives ``step_latency_us`` (``CostModel.transfer``),
and (2) V3's norms and residual adds on N/G tokens instead of N
(``model_level.mlp_schedule``). The authors' BMTrain V3 (BurstEngine 426eb7a,
``bmtrain/nn/parallel_linear_func.py``, ``async_gather_chunks=1``) gathers
before its GEMM with no overlap, as here, and copies the reduce-scattered
linear's input and output once each (``torch.cat``): under 0.2% of any
Table 2-3 cell, and not how the suite's or Megatron's V3 runs, so not timed.

``flash=False`` is the paper's "TP without FlashAttention" (model-only
variant): the rank's (B, Z/G, N, N) scores are materialised, so their HBM
traffic is paid and, for training, the probabilities are kept.
"""
from __future__ import annotations

from ..costs import FP32
from .common import Ctx, projections, ring_collective
from .tiles import whole_sequence


def _tp(ctx: Ctx, version: str, *, flash: bool) -> dict:
    s = ctx.shape
    G, N, b, d, e = s.world_size, s.seqlen, s.batch, s.head_dim, ctx.elem
    zq = s.heads // G
    kvl = s.kv_heads // G if s.kv_heads % G == 0 else 1      # kv heads a rank holds (replicated when Zkv < G)
    group = list(range(G))
    ready: dict = {g: None for g in group}
    ctx.note(f"TP {version.upper()}: Z/G query heads per rank over all N tokens, one flash kernel; "
             "collectives not overlapped with compute")

    def kernel(mode):
        if flash:
            return whole_sequence(ctx, zq, mode)
        return ctx.cost.materialised_attention(b, zq, d, N, N, mode, elem=e,
                                               score_passes=4 if mode == "forward" else 8)

    def compute(phase):
        order = ("qkv", "attn", "out") if phase == "forward" else ("out", "attn", "qkv")
        for g in group:
            for step in order:
                if step == "attn":
                    t, f = kernel(phase)
                    ready[g] = ctx.compute(g, f"attn_{phase}[r{g}]", t, deps=[ready[g]], phase=phase, flops=f)
                else:
                    ready[g] = projections(ctx, g, tokens=N, q_heads=zq, kv_heads=kvl, out_heads=zq,
                                           phase=phase, which=step, deps=[ready[g]])

    def collective(phase, kind, algo):
        nonlocal ready
        steps = 2 * (G - 1) if algo == "all_reduce" else G - 1
        ready = ring_collective(ctx, group, phase=phase, name=f"{algo}_{kind}", nbytes=ctx.take(phase, (kind,)),
                                steps=steps, ready=ready)

    if "forward" in ctx.phases:
        if version == "v3":
            collective("forward", "x", "all_gather")
        compute("forward")
        collective("forward", "out", "all_reduce" if version == "v1" else "reduce_scatter")
    if "backward" in ctx.phases:
        if version == "v3":
            collective("backward", "dout", "all_gather")
        compute("backward")
        collective("backward", "dx", "all_reduce" if version == "v1" else "reduce_scatter")
    full = b * N * s.heads * d * e
    ctx.buffer("forward", "partial (B, N, H) output before the reduction", full)
    if version == "v3":
        ctx.buffer("forward", "gathered input X (B, N, H)", full)
    ctx.buffer("backward", "(B, N, H) gradients dY, dX", 2 * full)
    ctx.buffer("backward", "fp32 gradients of the rank's q, k, v", b * N * (zq + 2 * kvl) * d * FP32)
    if not flash:
        ctx.buffer("forward", "scores and probabilities (B, Z/G, N, N)", 2 * b * zq * N * N * e)
        ctx.buffer("backward", "kept probabilities, dP, dS (B, Z/G, N, N)", 3 * b * zq * N * N * e)
    return ready


def tp(ctx: Ctx, *, version: str, flash: bool = True) -> dict:
    """Megatron TP (``Schedule("tp", {"version": ...})``); ``flash=False`` is the model-only variant
    that materialises the scores."""
    if not flash:
        ctx.note("TP without FlashAttention (model-only variant): scores materialised in HBM")
    return _tp(ctx, version, flash=flash)
