"""Memory per rank of the implementations the papers ran, term by term (docs/memory.md, issue 34 item 2).

The suite's own operators keep what their registry models say (``Method.memory``, reconciled with the
measured bytes on CPU, tests/test_memory_reconcile.py). The papers' tables were measured with other
code: BurstEngine's ``burst_attn`` on BMTrain, LoongTrain's InternEvo, DeepSpeed's
``DistributedAttention`` in Megatron-DeepSpeed, and TransformerEngine's P2P context parallelism in
Megatron-LM. This module models what THOSE hold, for the rows a spec declares them for (``RUNS``): one
formula per (row, implementation), so the suite's formula and a peer's never describe the same record.
Why here and not in ``baselines/methods/``: the terms describe the peers' code, not the suite's methods,
and a method (``ring``) stands for different peers in different tables (Megatron CP in the main table,
BurstEngine's own ring in its ablation).

Symbols per rank (docs/memory.md): T = B N / G rows, Z heads of d, Zkv key/value heads, e bytes per
element; Qb = T Z d e (q, O, dO), KVb = 2 T Zkv d e (K and V), Lb = 4 T Z (an fp32 lse or delta),
O32 = 4 T Z d (an fp32 running output), FA = 4 T Z (d + 1) (FlashAttention's backward ``dq_accum`` and
``softmax_d`` in fp32, ``csrc/flash_attn/flash_api.cpp`` ``mha_bwd``, per call on the rank's rows).
Head-sharded layouts (Ulysses, USP) hold the same element counts per rank. Each term below cites the
file and function it is read from (commits in docs/memory.md, "Sources read"); a term's bytes are the
same on every rank except TransformerEngine's partial outputs, counted for the last rank (the one that
keeps every step's full rows; an OOM needs one rank only).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from baselines import AttnShape
from burst_impl.model.config import ModelConfig, layer_params, num_params
from burst_impl.model.memory import PHASES, AttentionTerms, Resident, StepMemory, step_memory

from .usable_memory import Comms, value

FP32 = 4


@dataclass(frozen=True)
class Sizes:
    """The per-rank tensor sizes of the module docstring (bytes)."""

    Qb: int
    KVb: int
    Lb: int
    O32: int
    FA: int
    G: int

    @classmethod
    def of(cls, s: AttnShape, kv_heads: int | None = None) -> Sizes:
        rows = s.batch * s.seqlen // s.world_size
        zkv = s.kv_heads if kv_heads is None else kv_heads
        return cls(Qb=rows * s.heads * s.head_dim * s.elem_size, KVb=2 * rows * zkv * s.head_dim * s.elem_size,
                   Lb=FP32 * rows * s.heads, O32=FP32 * rows * s.heads * s.head_dim,
                   FA=FP32 * rows * s.heads * (s.head_dim + 1), G=s.world_size)


@dataclass(frozen=True)
class Terms:
    """One attention layer per rank, by named term (bytes): kept for the backward, and the transient
    sets at the forward's and the backward's peaks."""

    kept: dict
    forward: dict
    backward: dict

    def attention(self) -> AttentionTerms:
        return AttentionTerms(kept=sum(self.kept.values()), forward=sum(self.forward.values()),
                              backward=sum(self.backward.values()))

    def as_dict(self) -> dict:
        return {"kept": dict(self.kept), "forward": dict(self.forward), "backward": dict(self.backward)}


def _larger(a: dict, b: dict) -> dict:
    """The larger of two transient sets that are live at different times (e.g. an all-to-all's copies and
    the ring's buffers): a phase's peak is the larger one, not their sum."""
    return dict(a) if sum(a.values()) >= sum(b.values()) else dict(b)


# ---------------------------------------------------------------- BurstEngine (burst_attn on BMTrain)
#
# MayDomine/Burst-Attention b088c55, burst_attn/burst_attn_interface.py OpBurstAttn; the caller repeats K/V
# heads to Z (thunlp/BurstEngine cpm/layers/attention.py lines 307-308), so Zkv = Z.

def burst_ring(s: AttnShape, *, double: bool = False, optimize_bwd: bool = True) -> Terms:
    """``OpBurstAttn`` on the flat ring, or on the double ring (``double``); ``optimize_bwd=False`` is the
    authors' ablation baseline (``optimize_bwd_comm`` off: O circulates in the backward instead of delta)."""
    z = Sizes.of(s, kv_heads=s.heads)
    kept = {"q, copies of k and v, lse, a copy of O (OpBurstAttn.forward save_for_backward, replicate)":
            2 * z.Qb + z.KVb + z.Lb,
            "the returned O, kept by the output projection (OpBurstAttn.forward returns acc_o)": z.Qb}
    fwd = {"K/V receive buffers (OpBurstAttn.forward comm_bufs)": z.KVb,
           "fp32 running output and lse (burst_utils.inter_flash_cuda_fwd)": z.O32 + z.Lb,
           "one step's kernel output and lse (burst_utils.inter_flash_cuda_fwd)": z.Qb + z.Lb}
    delta = z.Lb if optimize_bwd else z.Qb            # optimize_bwd_comm off: delta = o_i, O itself circulates
    read = delta + 2 * z.Qb + z.Lb                    # delta, dO, q, lse
    bwd = {"dq, dk, dv accumulators in the input dtype (OpBurstAttn.backward zeros_like)": z.Qb + z.KVb,
           "delta = rowsum(O dO), fp32 (OpBurstAttn.backward)": z.Lb if optimize_bwd else 0,
           "one step's kernel gradients (OpBurstAttn.backward dqkv_buf)": z.Qb + z.KVb,
           "causal halves of k, v and of the dq buffer (OpBurstAttn.backward split2_gethalf)": z.KVb // 2 + z.Qb // 2,
           "read side in flight: delta, dO, q, lse (OpBurstAttn.backward read_comm_buf)": read,
           "dq on the write ring (OpBurstAttn.backward write_comm_buf)": z.Qb,
           "FlashAttention backward: dq_accum, softmax_d (flash_api.cpp mha_bwd)": z.FA}
    if double:
        fwd["double ring: inter-node receive buffer and send copy (comm.Ring.double_ring_send_recv)"] = 2 * z.KVb
        bwd["double ring: read side buffer_list and send_buffer (comm.Ring.double_ring_send_recv)"] = 2 * read
        bwd["double ring: dq buffer_list, send_buffer, add_list (comm.Ring.double_ring_send_recv_q)"] = 3 * z.Qb
    return Terms(kept, fwd, bwd)


def _a2a(tensor: int, at_once: int, source: str) -> dict:
    """An all-to-all's copies in transit: up to 3 of the tensor (a contiguous or split input copy, the
    collective's output, the reshaped or concatenated result), ``at_once`` tensors pipelined."""
    return {f"all-to-all copies in transit ({source})": 3 * at_once * tensor}


def burst_usp(s: AttnShape) -> Terms:
    """Burst-USP: Ulysses over the node's ranks (thunlp/BurstEngine cpm/layers/attention.py ``_SeqAllToAll``,
    ``single_all_to_all`` lines 35-61) around ``OpBurstAttn`` on a flat ring across nodes (lines 325-392:
    ``inter_comm`` and ``[None, None]``). The output all-to-all's result is what the output projection keeps,
    not the ring's returned O."""
    ring, z = burst_ring(s), Sizes.of(s, kv_heads=s.heads)
    kept = {"ring: q, copies of k and v, lse, a copy of O (OpBurstAttn.forward)": 2 * z.Qb + z.KVb + z.Lb,
            "the output all-to-all's result, kept by the output projection (_SeqAllToAll)": z.Qb}
    a2a = _a2a(z.Qb, 1, "cpm/layers/attention.py single_all_to_all .contiguous(), all_to_all, .contiguous()")
    return Terms(kept, _larger(ring.forward, a2a), _larger(ring.backward, a2a))


# ---------------------------------------------------------------- LoongTrain (InternEvo)
#
# thunlp/BurstEngine evaluation/baselines/InternEvo/internlm/model/ops/ring_flash_attn/
# zigzag_ring_flash_attn_with_sliding_window.py (ZigZagRingFlashAttnFunc) and ring_flash_attn/utils.py.

def loongtrain_ring(s: AttnShape, *, windows: bool = True) -> Terms:
    """LoongTrain's ring; ``windows``: several windows (the double ring: an inter-window K/V block and
    fp32 dK, dV on the inter-window ring), else one window (LoongTrain-USP's context ring, flat)."""
    z, r = Sizes.of(s), FP32 / s.elem_size
    kept = {"q, k, v, out, lse (ZigZagRingFlashAttnFunc.forward save_for_backward)": 2 * z.Qb + z.KVb + z.Lb}
    fwd = {"fp32 running output and lse (utils.update_out_and_lse)": z.O32 + z.Lb,
           "one step's kernel output and lse (_flash_attn_forward's block_out, block_lse)": z.Qb + z.Lb,
           "next K/V block of the window (zigzag_double_ring_flash_attn_forward, RingComm.send_recv)": z.KVb}
    bwd = {"one step's kernel gradients, bf16 (zigzag_double_ring_flash_attn_backward create_buffer)":
           z.Qb + z.KVb,
           "fp32 dq, dk, dv (zigzag_double_ring_flash_attn_backward)": int(r * (z.Qb + z.KVb)),
           "fp32 dk, dv travelling on the window's ring (receive buffers)": int(r * z.KVb),
           "next K/V block of the window in flight": z.KVb,
           "FlashAttention backward: dq_accum, softmax_d (flash_api.cpp mha_bwd)": z.FA}
    if windows:
        fwd["next inter-window K/V block (zigzag_double_ring_flash_attn_forward)"] = z.KVb
        bwd["next inter-window K/V block in flight"] = z.KVb
        bwd["fp32 dk, dv on the inter-window ring (zigzag_double_ring_flash_attn_backward)"] = int(r * z.KVb)
    return Terms(kept, fwd, bwd)


def loongtrain_usp(s: AttnShape) -> Terms:
    """LoongTrain-USP: InternEvo's head all-to-all (internlm/core/parallel/comm/isp.py ``_SeqAllToAll.forward``:
    split copies, the output list, ``torch.cat``; q, k, v pipelined, two at once) around one window of
    LoongTrain's ring (configs/7B_llama2.py line 202: ``window_size = cp_size`` with a head degree > 1)."""
    ring, z = loongtrain_ring(s, windows=False), Sizes.of(s)
    kept = {**ring.kept, "the output all-to-all's result, kept by the output projection (_SeqAllToAll)": z.Qb}
    a2a = _a2a(max(z.Qb, z.KVb // 2), 2, "internlm/core/parallel/comm/isp.py _SeqAllToAll.forward")
    return Terms(kept, _larger(ring.forward, a2a), _larger(ring.backward, a2a))


# ---------------------------------------------------------------- DeepSpeed-Ulysses, TransformerEngine P2P

def deepspeed_ulysses(s: AttnShape) -> Terms:
    """microsoft/DeepSpeed deepspeed/sequence/layer.py ``DistributedAttention`` around FlashAttention."""
    z = Sizes.of(s)
    kept = {"head-sharded q, k, v, out, lse kept by FlashAttention (DistributedAttention.forward)":
            2 * z.Qb + z.KVb + z.Lb,
            "the output all-to-all's result, kept by the output projection (DistributedAttention.forward)": z.Qb}
    a2a = _a2a(max(z.Qb, z.KVb // 2), 1, "single_all_to_all: permute, empty_like output, post-permute")
    grads = {"dq, dk, dv of the local attention, before their all-to-alls": z.Qb + z.KVb}
    fa = {"FlashAttention backward: dq_accum, softmax_d (flash_api.cpp mha_bwd)": z.FA}
    return Terms(kept, a2a, {**grads, **_larger(fa, a2a)})


def te_p2p(s: AttnShape) -> Terms:
    """TransformerEngine's P2P context parallelism (``AttnFuncWithCPAndKVP2P``; v1.8 ``AttnFuncWithCP``;
    the authors' copied transformer_engine/pytorch/attention.py, evaluation/kernel_bench/attn.py). The
    forward keeps every received K/V block in ``p2p_comm_buffers`` and every step's partial output and
    lse until its correction loop after the last step (attn.py lines 2044-2066, 2618-2690): the
    end-of-forward moment. ``p2p_comm_buffers[0]`` is a ``torch.cat`` copy of k, v; the last block is the
    one saved."""
    z = Sizes.of(s)
    kept = {"q, the last received K/V block, out, lse fp32 (ctx.save_for_backward)": 2 * z.Qb + z.KVb + z.Lb}
    fwd = {"every other received K/V block, and the cat copy of k, v (p2p_comm_buffers)": (z.G - 1) * z.KVb,
           "every step's partial output and lse (out_per_step, softmax_lse_per_step; the last rank's, all "
           "full rows)": z.G * (z.Qb + z.Lb),
           "the running lse in fp64 (softmax_lse .to(torch.double))": 2 * z.Lb}
    bwd = {"K/V and dK/dV double buffers, (2, *kv.shape) each (backward p2p_comm_buffers)": 4 * z.KVb,
           "dq in the input dtype (backward torch.empty_like(q))": z.Qb,
           "one step's dq_, dkv_ (backward torch.empty_like)": z.Qb + z.KVb,
           "FlashAttention backward: dq_accum, softmax_d (flash_api.cpp mha_bwd)": z.FA}
    return Terms(kept, fwd, bwd)


# ---------------------------------------------------------------- implementations and the runs


@dataclass(frozen=True)
class Implementation:
    """A peer implementation of one method: its attention terms, the framework that holds its model state
    (``framework_memory.FRAMEWORKS``) and its NCCL communicators."""

    name: str
    framework: str
    attention: Callable[[AttnShape], Terms]
    comms: Comms
    description: str = ""
    options: dict = field(default_factory=dict)


def _bmt_comms(p2p_intra: int, p2p_inter: int) -> Comms:
    return Comms(collective=6, p2p_intra=p2p_intra, p2p_inter=p2p_inter,
                 source="BurstEngine's six communicators: global, tp_comm, local_comm, local_idx_comm, "
                        "tp_local_idx_comm, zero_comm (cpm/layers/attention.py lines 316-323; "
                        "pretrain_llama_hug_tokenizer.py line 186), and the ring's peers")


IMPLEMENTATIONS = {i.name: i for i in (
    Implementation("burstengine_ring", "bmtrain", burst_ring, _bmt_comms(2, 0),
                   "BurstEngine's OpBurstAttn on the flat ring, optimised backward"),
    Implementation("burstengine_ring_baseline", "bmtrain", lambda s: burst_ring(s, optimize_bwd=False),
                   _bmt_comms(2, 0), "BurstEngine's OpBurstAttn, optimize_bwd_comm off (their ablation baseline)"),
    Implementation("burstengine_double_ring", "bmtrain", lambda s: burst_ring(s, double=True), _bmt_comms(2, 2),
                   "BurstEngine's OpBurstAttn on the double ring"),
    Implementation("burstengine_usp", "bmtrain", burst_usp, _bmt_comms(0, 2),
                   "BurstEngine's Ulysses over the node around OpBurstAttn on a flat ring across nodes"),
    Implementation("bmtrain_tp", "bmtrain", lambda s: None, Comms(collective=6, source="BurstEngine's communicators"),
                   "BMTrain tensor parallelism (TP-V3: OpParallelLinear, burst_impl/model/memory.py _tensor_parallel)"),
    Implementation("internevo_double_ring", "internevo", loongtrain_ring,
                   Comms(collective=4, p2p_intra=2, p2p_inter=2, source="InternEvo's weight, head, context and "
                         "world groups (configs/7B_llama2.py parallel), the double ring's peers"),
                   "LoongTrain's double ring (InternEvo)"),
    Implementation("internevo_usp", "internevo", loongtrain_usp,
                   Comms(collective=4, p2p_intra=2, source="InternEvo's weight, head, context and world groups, "
                         "the context ring's peers"), "LoongTrain's USP (InternEvo 2D attention)"),
    Implementation("deepspeed_ulysses", "deepspeed", deepspeed_ulysses,
                   Comms(collective=3, source="DeepSpeed's ZeRO, sequence-parallel and hpZ groups"),
                   "DeepSpeed-Ulysses (DistributedAttention) in Megatron-DeepSpeed"),
    Implementation("te_p2p", "megatron", te_p2p,
                   Comms(collective=3, p2p_intra=2, source="Megatron's world, data-parallel-with-CP and CP groups, "
                         "the CP ring's peers"),
                   "Megatron CP: TransformerEngine's P2P context parallelism"),
)}

# Which implementation each paper spec's rows ran (row: a model-level variant's name, else the method).
# Sources: the authors' scripts (docs/memory.md): BurstEngine/apps/llama (Burst rows, their ablation,
# BurstAttention Fig. 3's 32-GPU runs), evaluation/baselines/{InternEvo,Megatron-DeepSpeed,Megatron-LM},
# evaluation/kernel_bench (the attention-only benchmark: benchmark_burst_signle_entry.py,
# benchmark_doublering.py, benchmark_dpa.py).
_MAIN = {"burst_ring": "burstengine_double_ring", "burst_usp": "burstengine_usp",
         "loongtrain_usp": "internevo_usp", "loongtrain_double_ring": "internevo_double_ring",
         "deepspeed_ulysses": "deepspeed_ulysses", "megatron_cp": "te_p2p"}
RUNS = {
    "model_burstengine_main_7b": _MAIN,
    "model_burstengine_main_14b": _MAIN,
    "model_burstengine_ablation_14b_1m": {
        "ring_baseline": "burstengine_ring_baseline", "qring_backward": "burstengine_ring",
        "double_ring": "burstengine_double_ring", "fused_head": "burstengine_double_ring",
        "seq_checkpoint": "burstengine_double_ring", "whole_cache": "burstengine_double_ring"},
    "burstengine_attn_tflops_32gpu": {
        "burst": "burstengine_ring", "burst_qring": "burstengine_ring", "burst_double_ring": "burstengine_double_ring",
        "ring": "te_p2p", "burst_usp": "burstengine_usp", "loongtrain_usp": "internevo_usp",
        "loongtrain_double_ring": "internevo_double_ring"},
    "fig3_train_7b_32gpu": {"burst": "burstengine_ring", "tp_v3": "bmtrain_tp"},
}


def implementation_of(experiment: str, row: str) -> Implementation | None:
    """The implementation ``row`` of spec ``experiment`` ran (``RUNS``); None: the suite's own."""
    name = RUNS.get(experiment, {}).get(row)
    return None if name is None else IMPLEMENTATIONS[name]


# ---------------------------------------------------------------- the frameworks' model state and loss
#
# Per rank, P parameters (one block: P_layer), G ranks, e bytes per element; constants from
# experiments/hardware/memory/memory_terms.yaml (``implementations``), each with its source.

@dataclass(frozen=True)
class State:
    """A framework's model state per rank: on the device (``Resident``), on the host, and the bytes its
    optimizer offload moves over PCIe per step (each direction summed)."""

    resident: Resident
    host_bytes: int
    pcie_bytes_per_step: int
    offload: str                 # the record's ``offload`` text


def _bmtrain_state(cfg: ModelConfig, G: int, e: int, weights: str) -> State:
    """BMTrain (thunlp/BurstEngine BMTrain/bmtrain): ZeRO-3 over the sequence group with ``--spzero``
    (``weights="fsdp2"``), TP-sharded (``"tp"``), else replicated; ``--offload`` (apps/llama/multi.sh line 53,
    exp.py) selects ``AdamOffloadOptimizer`` (cpm/arguments.py line 121; pretrain_llama_hug_tokenizer.py
    lines 121-124): the fp32 master copy and both moments on the host (bmtrain/optim/adam_offload.py lines
    71-87), the bf16 gradient partition to the host and the parameter partition back each step (lines 97-99,
    135). ZeRO-3 gathers a block's parameters and gradients (zero_context.py ``ZeroContext.enter``, lines
    41-46) and keeps the neighbour's gathered parameters for reuse (``exit``, ``ctx_dict``, lines 163-164)."""
    shard = 1 if weights == "replicated" else G
    P, PL = num_params(cfg), layer_params(cfg)
    part = -(-P // shard) * e
    gathered = 3 * PL * e if weights == "fsdp2" and G > 1 else 0
    return State(Resident(weights=part, grads=part, optimizer=0, gathered=gathered),
                 host_bytes=int(value("implementations", "adam_state_bytes_per_param") * P / shard) + 2 * part,
                 pcie_bytes_per_step=2 * part,
                 offload="modelled: optimizer state on the host (BMTrain AdamOffloadOptimizer, the authors' "
                         "--offload); no activation offload")


def _internevo_state(cfg: ModelConfig, G: int, e: int, weights: str) -> State:
    """InternEvo as LoongTrain ran it (evaluation/baselines/InternEvo/configs/7B_llama2.py lines 205-208:
    ISP with weight parallelism over all G ranks; lines 104-108: ``hybrid_zero_optimizer.cpu_offload=True``,
    the fp32 master copy on the host, internlm/solver/optimizer/hybrid_zero_optim.py lines 221-223, whose
    Adam moments are created with it): bf16 weight and gradient shards on the device; one block's gathered
    weights and gradients, and the next block's weights prefetched (``weight.overlap=True``, line 207)."""
    P, PL = num_params(cfg), layer_params(cfg)
    part = -(-P // G) * e
    return State(Resident(weights=part, grads=part, optimizer=0, gathered=3 * PL * e if G > 1 else 0),
                 host_bytes=int(value("implementations", "adam_state_bytes_per_param") * P / G),
                 pcie_bytes_per_step=2 * part,
                 offload="modelled: fp32 master copy and optimizer on the host (InternEvo cpu_offload=True)")


def _deepspeed_state(cfg: ModelConfig, G: int, e: int, weights: str) -> State:
    """Megatron-DeepSpeed as the authors ran DeepSpeed-Ulysses (script/ulysses.sh line 204: ZeRO stage 3;
    script/ds.json: fp16, ``offload_optimizer`` ratio 0.8, ``zero_hpz_partition_size`` 32): fp16 parameter
    and gradient partitions, ZeRO++'s secondary parameter partition, 20% of the fp32 optimizer state on the
    device; one block's gathered parameters and gradients."""
    P, PL = num_params(cfg), layer_params(cfg)
    ratio = value("implementations", "deepspeed_offload_ratio")
    opt = value("implementations", "adam_state_bytes_per_param") * P / G
    part = -(-P // G) * e
    hpz = -(-P // int(value("implementations", "deepspeed_hpz_partition_size"))) * e
    return State(Resident(weights=part + hpz, grads=part, optimizer=int((1 - ratio) * opt),
                          gathered=2 * PL * e if G > 1 else 0),
                 host_bytes=int(ratio * opt), pcie_bytes_per_step=int(ratio * 2 * part),
                 offload=f"modelled: {ratio:.0%} of the optimizer state on the host (DeepSpeed offload_optimizer)")


def _megatron_state(cfg: ModelConfig, G: int, e: int, weights: str) -> State:
    """Megatron-LM as the authors ran Megatron CP (evaluation/baselines/Megatron-LM/multi.sh: bf16, distributed
    optimizer, context parallelism over the G ranks, data parallelism 1): bf16 parameters and fp32 gradients,
    not sharded; the fp32 master copy and moments sharded over data parallel x context parallel
    (megatron/core/optimizer/__init__.py line 334). No offload."""
    P = num_params(cfg)
    model = value("implementations", "megatron_model_bytes_per_param") * P
    return State(Resident(weights=P * e, grads=int(model) - P * e,
                          optimizer=int(value("implementations", "megatron_distopt_bytes_per_param") * P / G),
                          gathered=0),
                 host_bytes=0, pcie_bytes_per_step=0, offload="none (Megatron-LM keeps its optimizer on the device)")


def _loss(framework: str, cfg: ModelConfig, T: int, e: int, loss: str, vocab_shard: int = 1) -> tuple[int, int]:
    """(bytes at the end of the loss's forward, at the start of its backward) beyond the kept activations;
    the backward includes the LM head's full weight gradient where the state keeps gradient partitions."""
    V, H = -(-cfg.vocab_size // vocab_shard), cfg.hidden
    head_grad = V * H * e + T * H * e                    # d W_head before its reduce-scatter, and d hidden
    if framework == "bmtrain":
        if loss == "fused":   # their Cut Cross-Entropy fork: lse over tiles, logit tiles again in the backward
            return FP32 * T, head_grad                   # (docs/papers.md §4 "Fused LM head + loss")
        # bmtrain/loss/cross_entropy.py OpFusedCrossEntropy: logits and softmax (T, V) in the input dtype; the
        # harness drops the logits after the loss (pretrain_llama_hug_tokenizer.py line 311), the backward
        # turns the saved softmax into the gradient in place
        return 2 * T * V * e, T * V * e + head_grad
    if framework == "internevo":
        # fp32 logits (modeling_llama.py line 454: the final norm on .float(); ops/cross_entropy.py
        # use_fp32_logits default) and flash-attn's CrossEntropyLoss, inplace_backward (losses/ce_loss.py line 34)
        return FP32 * T * V, FP32 * T * V + head_grad
    if framework in ("deepspeed", "megatron"):
        # vocab_parallel_cross_entropy on a float copy of the e-byte logits (Megatron-DeepSpeed
        # megatron/model/gpt_model.py line 305; Megatron-LM core/tensor_parallel/cross_entropy.py line 27),
        # exp_logits saved (line 92 / 180) and turned into the gradient in place, cast back to e bytes
        grad = head_grad if framework == "deepspeed" else T * H * e      # Megatron's gradients are resident
        return T * V * (e + FP32), T * V * (FP32 + e) + grad
    raise ValueError(f"framework={framework!r} is unknown; choose one of {sorted(FRAMEWORKS)}")


@dataclass(frozen=True)
class Framework:
    name: str
    state: Callable[[ModelConfig, int, int, str], State]
    phases: tuple[str, ...]       # the step phases its harness's memory figure covers (memory.PHASES)
    measured: str                 # what that figure is


FRAMEWORKS = {f.name: f for f in (
    Framework("bmtrain", _bmtrain_state, ("forward", "backward"),
              "max_memory_allocated, max over the forward and backward phases (BurstEngine's harness, "
              "pretrain_llama_hug_tokenizer.py lines 412-413; the tables' choice between allocated and reserved "
              "is not recoverable: modelled allocated)"),
    Framework("internevo", _internevo_state, PHASES,
              "max_memory_allocated over whole steps (InternEvo empty_cache_and_diag, internlm/utils/gputest.py "
              "lines 146-153); modelled allocated"),
    Framework("deepspeed", _deepspeed_state, PHASES,
              "Max Mem: max_memory_allocated since the process started (Megatron-DeepSpeed megatron/training.py "
              "line 1179, decimal GB); modelled allocated"),
    Framework("megatron", _megatron_state, PHASES,
              "max allocated after the first iteration (Megatron-LM megatron/training/utils.py report_memory, "
              "lines 118-132); modelled allocated"),
)}


def peer_step(impl: Implementation, cfg: ModelConfig, shape: AttnShape, *, base, weights: str, checkpoint: str,
              loss: str) -> tuple[StepMemory, State]:
    """One training step of ``cfg`` per rank as ``impl`` holds it: ``step_memory`` with the implementation's
    attention terms, its framework's state and loss buffers, over the phases its harness measures.
    ``base``: the registry method of the row (its checkpoint mode: ``checkpoint.method_mode``)."""
    fw = FRAMEWORKS[impl.framework]
    G, e = shape.world_size, shape.elem_size
    state = fw.state(cfg, G, e, weights)
    terms = impl.attention(shape)
    tp = weights == "tp"
    tokens = shape.batch * shape.seqlen // (1 if tp else G)        # TP: the head runs on all N tokens, V/G
    loss_bytes = _loss(impl.framework, cfg, tokens, e, loss, vocab_shard=G if tp else 1)
    sm = step_memory(cfg, batch=shape.batch, seqlen=shape.seqlen, world_size=G, method=base, layout=shape.layout,
                     dtype=shape.dtype, weights=weights, checkpoint=checkpoint, loss=loss, loss_device="cuda",
                     attention=None if terms is None else terms.attention(), resident=state.resident,
                     loss_bytes=loss_bytes, phases=fw.phases)
    return sm, state
