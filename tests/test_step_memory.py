"""The whole-step memory model (burst_impl/model/memory.py) against the measured CPU peak.

One process, one thread, fp32: a 2-layer model of hidden 256 and FFN 688 on
S = 1024 tokens, with a 1024-word vocabulary so that the activations and the
loss, not the embedding tables, decide the peak. The measured peak is the
harness's (``experiments/harness/memory.py``: the profiler's allocator events,
peak above the live bytes at the start) of one forward + backward with the
gradients released beforehand, which is what ``step_peak_bytes`` models. The
model is a count of saved tensors, not a fit; 15% is the issue's bound.
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from baselines.registry import get
from burst_impl.model import build_model, get_config, loss_and_grads
from burst_impl.model.config import CHECKPOINT_MODES as MODES
from burst_impl.model.data import batch_at, load_corpus
from burst_impl.model.memory import step_memory
from experiments.harness.memory import measure_peak
from tests.model_refs import one_thread

SEQLEN = 1024
REL = 0.15


def small_cfg(**kw):
    return replace(get_config("cpu_small"), n_layers=2, vocab_size=1024, **kw)


def measured_peak(cfg) -> int:
    tokens, labels = batch_at(load_corpus("markov", cfg.vocab_size, n_tokens=4 * SEQLEN), 0, 1, SEQLEN)
    with one_thread():
        model = build_model(cfg)
        loss_and_grads(model, tokens, labels)          # warm-up (lazy imports, kernel choice)
        for p in model.parameters():
            p.grad = None
        return measure_peak(lambda: loss_and_grads(model, tokens, labels), torch.device("cpu")).peak_bytes


@pytest.mark.slow
@pytest.mark.parametrize("loss,mode", [("fused", m) for m in MODES] + [("unfused", "none")])
def test_model_within_15_percent(loss, mode):
    cfg = small_cfg(loss=loss, checkpoint=mode)
    got = measured_peak(cfg)
    want = step_memory(cfg, batch=1, seqlen=SEQLEN).step_peak_bytes
    assert abs(want - got) <= REL * got, f"{loss}/{mode}: model {want / 2**20:.1f} MiB, measured {got / 2**20:.1f} MiB"


def test_model_orders_modes_and_marks_oom():
    """At the paper's ablation size (14B, 1M tokens, 32 ranks, FSDP2): no checkpointing and the
    unfused logits do not fit 80 GB; seq lies between full and whole; the loss modes order."""
    cfg = get_config("burstengine_14b")
    kw = dict(batch=1, seqlen=1 << 20, world_size=32, method=get("burst"), dtype="bfloat16", weights="fsdp2")
    by_mode = {m: step_memory(cfg, checkpoint=m, loss="fused", **kw).total_bytes for m in MODES}
    assert by_mode["full"] < by_mode["seq"] < by_mode["whole"] < by_mode["none"]
    assert by_mode["none"] > 80e9
    unfused = step_memory(cfg, checkpoint="seq", loss="unfused", **kw)
    assert unfused.logits > 8e9 > step_memory(cfg, checkpoint="seq", loss="fused", **kw).logits
    with pytest.raises(ValueError, match="checkpoint='x' is unknown"):
        step_memory(cfg, checkpoint="x", **kw)
    with pytest.raises(ValueError, match="seqlen=10 must be divisible"):
        step_memory(cfg, **{**kw, "seqlen": 10})


def test_tensor_parallel_holds_one_gth_of_the_weights():
    """weights="tp" (tp_v1, tp_v3): weights, gradients and AdamW state are 1/G of all parameters with
    nothing gathered; the attention part is the TP method's registry memory; V3 keeps the norms' tensors
    of N/G tokens only (less than V1); TP attention caches nothing, so "seq" is "full"."""
    from burst_impl.model.config import num_params
    from burst_impl.model.sequence_parallel import attn_shape

    cfg, G, N = get_config("llama2_7b"), 8, 1 << 14
    kw = dict(batch=1, seqlen=N, world_size=G, dtype="bfloat16", loss="unfused")
    assert step_memory(cfg, method=get("burst"), weights="replicated", **kw).weights == num_params(cfg) * 2
    acts = {}
    for m in ("tp_v1", "tp_v3"):
        tp = step_memory(cfg, method=get(m), weights="tp", checkpoint="none", **kw)
        assert tp.weights == tp.grads == -(-num_params(cfg) // G) * 2
        assert tp.optimizer == 2 * tp.weights and tp.gathered == 0
        assert tp.attention == get(m).memory(attn_shape(cfg, 1, N, G, "zigzag", dtype="bfloat16"))
        assert step_memory(cfg, method=get(m), weights="tp", checkpoint="seq", **kw) == \
            step_memory(cfg, method=get(m), weights="tp", checkpoint="full", **kw)
        acts[m] = tp.activations
    assert acts["tp_v3"] < acts["tp_v1"]
    with pytest.raises(ValueError, match="weights='tp' needs a tensor-parallel attention method"):
        step_memory(cfg, method=get("burst"), weights="tp", **kw)


# ---------------------------------------------------------------- sequence parallel, G > 1
#
# The same measurement on every rank of a gloo group (tests/distpool.py), for the burst operator
# and Ulysses, zigzag, fused loss. SP_CFG has 12 heads, so Ulysses splits them over 2 and 3 ranks;
# SP_SEQLEN splits into 2G zigzag chunks for G = 2, 3 with an even local length (``seq``). At these
# sizes both G > 1 moments decide a peak: the start of the backward (none, and every mode at G = 2)
# and the gradient all-reduce (3 P e, the checkpoint modes at G = 3, measured to the byte; without
# the all-reduce's copy the model says 12.0 MiB there against 14.6 MiB measured, and this fails).
# Tolerance: the 15%. Seen at these shapes: the model 9% above the measured SwiGLU moment of
# block 0 at G = 2; Ulysses' all-to-all buffers freed on gloo's threads read up to 5% high where
# their addresses are not reused before the peak (experiments/harness/memory.py).
SP_CFG = dict(hidden=192, n_heads=12, n_kv_heads=12, ffn_hidden=512)
SP_SEQLEN = 1152
SP_CASES = [("burst", MODES), ("ulysses", ("none", "seq"))]   # Ulysses runs seq as full (no cache)


def sp_cfg(**kw):
    return small_cfg(loss="fused", **SP_CFG, **kw)


def _rank_peaks(method: str, modes: tuple[str, ...]) -> dict[str, int]:
    """On every rank: the measured step peak (as ``measured_peak``) of each checkpoint mode."""
    from burst_impl.model import sequence_parallel

    tokens, labels = batch_at(load_corpus("markov", sp_cfg().vocab_size, n_tokens=4 * SP_SEQLEN), 0, 1, SP_SEQLEN)
    out = {}
    for mode in modes:
        model = sequence_parallel(build_model(sp_cfg(checkpoint=mode)), get(method), layout="zigzag")
        loss_and_grads(model, tokens, labels)          # warm-up
        for p in model.parameters():
            p.grad = None
        out[mode] = measure_peak(lambda: loss_and_grads(model, tokens, labels), torch.device("cpu")).peak_bytes
    return out


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("method,modes", SP_CASES)
def test_model_within_15_percent_sequence_parallel(pools, method, modes, world_size):
    per_rank = pools.run(world_size, _rank_peaks, method, modes)
    bad = []
    for mode in modes:
        want = step_memory(sp_cfg(checkpoint=mode), batch=1, seqlen=SP_SEQLEN, world_size=world_size,
                           method=get(method), layout="zigzag").step_peak_bytes
        for rank, got in enumerate(p[mode] for p in per_rank):
            if abs(want - got) > REL * got:
                bad.append(f"{method} G={world_size} {mode} rank {rank}: model {want / 2**20:.2f} MiB, "
                           f"measured {got / 2**20:.2f} MiB")
    assert not bad, "\n".join(bad)


def test_param_numels_and_buckets():
    """The parameter list the model uses for the gradient buckets is the model's own, in order; buckets
    close before they would pass BUCKET_BYTES, and a larger gradient is a bucket of its own."""
    from burst_impl.model.config import param_numels
    from burst_impl.model.parallel import BUCKET_BYTES, bucket_sizes

    cfg = small_cfg(**SP_CFG)
    assert param_numels(cfg) == [p.numel() for p in build_model(cfg).parameters()]
    MiB = 1 << 20
    assert BUCKET_BYTES == 64 * MiB
    assert bucket_sizes([40 * MiB, 24 * MiB, 1, 100 * MiB, 2]) == [64 * MiB, 1, 100 * MiB, 2]
    assert bucket_sizes([]) == []


def test_model_follows_the_effective_mode():
    """seq/whole cache (O, lse) only through the burst operator's backward: for Ulysses the model counts
    them as full (checkpoint.effective_mode); for burst seq keeps more than full (the cached halves)."""
    kw = dict(batch=1, seqlen=SP_SEQLEN, world_size=3, layout="zigzag")
    peaks = {(m, mode): step_memory(sp_cfg(checkpoint=mode), method=get(m), **kw) for m in ("burst", "ulysses")
             for mode in ("full", "seq", "whole")}
    assert peaks["ulysses", "seq"] == peaks["ulysses", "full"] == peaks["ulysses", "whole"]
    assert peaks["burst", "seq"].cache > 0 == peaks["burst", "full"].cache


# ---------------------------------------------------------------- the attention's transient buffers (issue 34)
#
# With a narrow MLP (F = H/3) and a small vocabulary the ring's backward buffers decide the step's peak:
# the profiler puts the measured peak inside the attention's kernel backward while gloo sends (checked with
# the allocator events' times, docs/memory.md). The model places the schedule's declared buffers
# (experiments/perfmodel/schedules/ring_family.py, the same numbers the performance model records) at the
# attention's backward moment; without them every moment it has lies below the measurement. Seen at
# G = 2, full checkpointing, fp32: measured 8.83 MiB; with the buffers 9.74 (+10%), without 7.53 (-15%).
ATTN_CFG = dict(hidden=192, n_heads=12, n_kv_heads=12, ffn_hidden=64)


def attn_cfg(**kw):
    return replace(small_cfg(loss="fused", **ATTN_CFG, **kw), vocab_size=256)


def _attention_peak(mode: str) -> int:
    tokens, labels = batch_at(load_corpus("markov", attn_cfg().vocab_size, n_tokens=4 * SP_SEQLEN), 0, 1, SP_SEQLEN)
    from burst_impl.model import sequence_parallel

    model = sequence_parallel(build_model(attn_cfg(checkpoint=mode)), get("burst"), layout="zigzag")
    loss_and_grads(model, tokens, labels)          # warm-up
    for p in model.parameters():
        p.grad = None
    return measure_peak(lambda: loss_and_grads(model, tokens, labels), torch.device("cpu")).peak_bytes


def test_attention_transients_decide_the_peak_where_measured(pools):
    from burst_impl.model.memory import AttentionTerms
    from burst_impl.model.sequence_parallel import attn_shape
    from experiments.perfmodel.model import predict_case

    G, mode = 2, "full"
    got = pools.run(G, _attention_peak, mode)
    cfg = attn_cfg(checkpoint=mode)
    phase = predict_case("burst", attn_shape(cfg, 1, SP_SEQLEN, G, "zigzag", dtype="float32"), mode="fwd_bwd",
                         level="op", hardware="a800_ib_4x8").memory["transient_by_phase"]
    kw = dict(batch=1, seqlen=SP_SEQLEN, world_size=G, method=get("burst"), layout="zigzag")
    plain = step_memory(cfg, **kw)
    buffers = AttentionTerms(forward=phase["forward"], backward=phase["backward"])
    with_buffers = step_memory(cfg, attention=buffers, **kw)
    assert with_buffers.peak_moment == "attention_backward"
    for rank, peak in enumerate(got):
        assert abs(with_buffers.step_peak_bytes - peak) <= REL * peak, (rank, with_buffers.step_peak_bytes, peak)
        assert plain.step_peak_bytes < peak, "without the attention's buffers no moment reaches the measured peak"
        assert abs(with_buffers.step_peak_bytes - peak) < abs(plain.step_peak_bytes - peak)


def test_phases_choose_the_moments_a_harness_measures():
    """``phases`` keeps the moments of the phases a harness measures (BurstEngine's: forward and backward,
    not the loss's forward): the unfused loss's forward buffers then drop out of the peak."""
    cfg = get_config("burstengine_14b")
    kw = dict(batch=1, seqlen=1 << 20, world_size=32, method=get("burst"), dtype="bfloat16", weights="fsdp2",
              checkpoint="full", loss="unfused", loss_bytes=(9 << 30, 1 << 30))
    every = step_memory(cfg, **kw)
    theirs = step_memory(cfg, phases=("forward", "backward"), **kw)
    assert every.peak_moment == "loss_forward" and "loss_forward" not in theirs.moments
    assert theirs.step_peak_bytes < every.step_peak_bytes
    with pytest.raises(ValueError, match="phases=.*subset"):
        step_memory(cfg, phases=("optimizer",), **kw)
