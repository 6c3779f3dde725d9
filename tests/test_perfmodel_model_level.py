"""Model level of the performance model (experiments/perfmodel/model_level.py): hand-computed MLP
schedules, TP's MLP collectives carrying exactly the registry's bytes, the step's composition, the
fused LM head's extra GEMM, and the whole model's memory per rank (the step memory model's, OOM over HBM)."""
from __future__ import annotations

import dataclasses

import pytest

from baselines import AttnShape, get
from burst_impl.model.config import get_config, num_params
from burst_impl.model.flops import model_flops
from burst_impl.model.memory import step_memory
from experiments.profiles.hardware import load_hardware, parse_hardware
from experiments.harness.spec import Case
from experiments.perfmodel.costs import CostModel
from experiments.perfmodel.model import predict_case
from baselines.registry import METHODS
from experiments.perfmodel.model_level import mlp_schedule, model_record, predict_model
from experiments.perfmodel.placement import Placement
from experiments.perfmodel.predict import _record

PEAK, GEMM_EFF, HBM_GBS = 100.0, 0.5, 1000.0      # TFLOP/s, fraction, GB/s: round numbers to compute by hand
INTRA_GBS, LAT_US = 8.0, 5.0                      # 8 Gb/s = 1e9 B/s per rank, 5 us


def _hw(nodes: int = 1, per_node: int = 4, hbm_gib: float = 80):
    raw = {"name": "hand", "nodes": nodes, "devices_per_node": per_node,
           "accelerator": {"name": "X", "peak_tflops": {"bfloat16": PEAK}, "hbm_gib": hbm_gib,
                           "hbm_gbytes_s": HBM_GBS, "attn_efficiency": [[1, 0.5]], "gemm_efficiency": GEMM_EFF},
           "intra": {"kind": "nvlink", "gbits_s": INTRA_GBS, "latency_us": LAT_US}}
    if nodes > 1:
        raw["inter"] = {"kind": "infiniband", "gbits_s": 8.0, "latency_us": LAT_US}
    return parse_hardware(raw)


CFG = get_config("tiny")          # 2 layers, H=96, 12 heads x 8, F=192, V=64


def _shape(g: int, n: int = 64) -> AttnShape:
    return AttnShape(batch=1, seqlen=n, heads=12, kv_heads=12, head_dim=8, world_size=g, dtype="bfloat16",
                     causal=True, layout="zigzag")


def _gemm(m, n, k):
    return 2 * m * n * k / (PEAK * 1e12 * GEMM_EFF)


def _mlp_compute(tokens: int, f: int) -> float:
    h, e = CFG.hidden, 2
    hbm = (2 * 2 * tokens * h + 3 * tokens * f + 2 * 3 * tokens * h) * e / (HBM_GBS * 1e9)
    return _gemm(tokens, 2 * f, h) + _gemm(tokens, h, f) + hbm


def test_sequence_parallel_mlp_is_local_gemms_on_n_over_g_tokens():
    hw, s = _hw(), _shape(2)
    cost, place = CostModel(hw, "bfloat16"), Placement.of(hw, 2)
    fwd, sent, reg = mlp_schedule("burst", CFG, s, cost, place, "forward")
    assert fwd.makespan == pytest.approx(_mlp_compute(32, CFG.ffn_hidden), rel=1e-12)
    assert sent == {} and reg == {}                     # full weights on every rank: no MLP communication
    train, _, _ = mlp_schedule("burst", CFG, s, cost, place, "fwd_bwd")
    assert train.makespan == pytest.approx(3 * _mlp_compute(32, CFG.ffn_hidden), rel=1e-12)


def test_tp_v1_mlp_g2_is_compute_then_a_two_step_ring_all_reduce():
    hw, s = _hw(), _shape(2)
    cost, place = CostModel(hw, "bfloat16"), Placement.of(hw, 2)
    sch, sent, reg = mlp_schedule("tp_v1", CFG, s, cost, place, "forward")
    out = get("tp_v1").bytes(s)[("forward", "out")]
    assert out == 1 * 64 * CFG.hidden * 2 * 2 * (2 - 1) // 2     # 2(G-1)/G of the (B, N, H) bf16 output
    # all N tokens on F/G columns; then 2(G-1) = 2 ring steps of half the bytes each
    hand = _mlp_compute(64, CFG.ffn_hidden // 2) + 2 * (LAT_US * 1e-6 + (out / 2) / 1e9)
    assert sch.makespan == pytest.approx(hand, rel=1e-12)
    assert sent == reg == {("forward", "out"): out}


@pytest.mark.parametrize("method", ["tp_v1", "tp_v3"])
@pytest.mark.parametrize("g,nodes", [(3, 1), (4, 2)])
def test_tp_mlp_bytes_equal_the_registry_formula(method, g, nodes):
    hw, s = _hw(nodes, 4 if nodes == 1 else 2), _shape(g, 96)
    sch, sent, reg = mlp_schedule(method, CFG, s, CostModel(hw, "bfloat16"), Placement.of(hw, g), "fwd_bwd")
    formula = {k: v for k, v in get(method).bytes(s).items() if v}
    assert reg == formula and sent == formula
    for r, by_kind in sch.bytes_sent().items():          # every rank sends what the formula says one rank sends
        assert by_kind == formula, r


def test_model_step_is_layers_times_attention_and_mlp_plus_head():
    hw, s = _hw(), _shape(4, 128)
    mp = predict_model("burst", CFG, s, mode="fwd_bwd", hardware=hw)
    cost, place = CostModel(hw, "bfloat16"), Placement.of(hw, 4)
    mlp = mlp_schedule("burst", CFG, s, cost, place, "fwd_bwd")[0].makespan
    head = 3 * _gemm(128 // 4, CFG.vocab_size, CFG.hidden)
    assert mp.parts["attention"] == pytest.approx(CFG.n_layers * mp.attention.time_s, rel=1e-12)
    assert mp.parts["mlp"] == pytest.approx(CFG.n_layers * mlp, rel=1e-12)
    assert mp.parts["head"] == pytest.approx(head, rel=1e-12)
    # the weight gradients' all-reduce: 2(G-1) steps of 1/G of the bf16 gradients each, overlapped with
    # the backward (2/3 of the layers' time): exposed = what outlasts it
    sync = 2 * 3 * (LAT_US * 1e-6 + 2 * num_params(CFG) / 4 / 1e9)
    backward = CFG.n_layers * (mp.attention.time_s + mlp) * 2 / 3
    assert mp.parts["grad_sync_exposed"] == pytest.approx(max(0.0, sync - backward), rel=1e-9, abs=1e-15)
    assert mp.time_s == pytest.approx(sum(mp.parts.values()), rel=1e-12)
    assert mp.flops == model_flops(CFG, 1, 128, mode="train")["total"]
    tp = predict_model("tp_v1", CFG, s, mode="fwd_bwd", hardware=hw)
    assert tp.parts["grad_sync_exposed"] == 0.0          # TP holds 1/G of the weights: nothing to sync


def test_prefill_head_is_the_last_token_and_recompute_adds_a_forward():
    hw, s = _hw(), _shape(2)
    pre = predict_model("burst", CFG, s, mode="forward", hardware=hw)
    assert pre.parts["head"] == pytest.approx(_gemm(1, CFG.vocab_size, CFG.hidden), rel=1e-12)
    assert pre.parts["grad_sync_exposed"] == 0.0 and pre.parts["recompute"] == 0.0
    plain = predict_model("burst", CFG, s, mode="fwd_bwd", hardware=hw)
    full = predict_model("burst", CFG, s, mode="fwd_bwd", hardware=hw, checkpoint="full")
    assert full.time_s - plain.time_s == pytest.approx(pre.time_s - pre.parts["head"], rel=1e-9)
    # seq: the same, but the attention forward at N/2 (the first global half, on the same ranks) instead of N
    seq = predict_model("burst", CFG, s, mode="fwd_bwd", hardware=hw, checkpoint="seq")
    op = {n: predict_case("burst", dataclasses.replace(s, seqlen=n), mode="forward", level="op", hardware=hw).time_s
          for n in (s.seqlen, s.seqlen // 2)}
    assert op[s.seqlen // 2] < op[s.seqlen]
    assert full.time_s - seq.time_s == pytest.approx(CFG.n_layers * (op[s.seqlen] - op[s.seqlen // 2]), rel=1e-9)
    # a method that cannot cache runs seq as full recompute
    assert predict_model("usp", CFG, s, mode="fwd_bwd", hardware=hw, checkpoint="seq").time_s == pytest.approx(
        predict_model("usp", CFG, s, mode="fwd_bwd", hardware=hw, checkpoint="full").time_s, rel=1e-12)


def _case(method: str, s: AttnShape, mode: str) -> Case:
    return Case(experiment="x", method=method, level="layer", mode=mode, shape=s, warmup=0, repeats=0, seed=0)


def test_model_record_and_bad_shape():
    hw, s = _hw(), _shape(2)
    mp = predict_model("tp_v3", CFG, s, mode="fwd_bwd", hardware=hw)
    layer_rec = _record(_case("tp_v3", s, "fwd_bwd"), mp.attention, "x")
    rec = model_record(layer_rec, mp, "x_model_level")
    assert rec["level"] == "model" and ".model." in rec["case_id"] and rec["weights"] == "tensor_parallel"
    # memory as measured model-level records carry it: the state per rank and the step's peak above it
    assert rec["mem_state_bytes_per_rank"] == [mp.memory["resident_bytes"]] * 2
    assert rec["mem_peak_bytes"] + rec["mem_state_bytes_per_rank"][0] == rec["mem_total_bytes"] \
        == mp.memory["total_bytes"]
    assert rec["tflops_per_rank"] == pytest.approx(mp.flops / mp.time_s / 1e12 / 2)
    assert rec["mfu"] == pytest.approx(mp.flops / mp.time_s / (2 * PEAK * 1e12))
    layer_fwd = layer_rec["comm_fwd_formula_bytes"]
    assert rec["comm_fwd_formula_bytes"] == layer_fwd + sum(v for (p, _), v in mp.mlp_registry_bytes.items()
                                                            if p == "forward")
    with pytest.raises(ValueError, match="is not model 'llama2_7b'"):
        predict_model("burst", "llama2_7b", s, mode="forward", hardware=hw)
    with pytest.raises(ValueError, match="mode='backward'"):
        predict_model("burst", CFG, s, mode="backward", hardware=hw)
    with pytest.raises(ValueError, match="loss='cce'"):
        predict_model("burst", CFG, s, mode="fwd_bwd", hardware=hw, loss="cce")
    with pytest.raises(ValueError, match="weights='fsdp2' with method 'tp_v1'"):
        predict_model("tp_v1", CFG, s, mode="fwd_bwd", hardware=hw, weights="fsdp2")
    with pytest.raises(ValueError, match="weights='tp' with method 'burst'"):
        predict_model("burst", CFG, s, mode="fwd_bwd", hardware=hw, weights="tp")


def test_fused_head_costs_the_unfused_head_gemms():
    """burst_impl.loss's training path computes the gradients in the forward: 3 (tokens x vocab x hidden)
    GEMMs, as many as the unfused loss (same time); fused_recompute's backward recomputes every logits
    tile: exactly one GEMM more, sequence parallel (N/G tokens) and tensor parallel (N tokens, V/G)."""
    hw, s = _hw(), _shape(4, 128)
    by_loss = {loss: predict_model("burst", CFG, s, mode="fwd_bwd", hardware=hw, loss=loss)
               for loss in ("unfused", "fused", "fused_recompute")}
    one = _gemm(128 // 4, CFG.vocab_size, CFG.hidden)
    assert by_loss["fused"].parts["head"] == pytest.approx(3 * one, rel=1e-12)
    assert by_loss["fused"].parts["head"] == by_loss["unfused"].parts["head"]
    assert by_loss["fused"].time_s == by_loss["unfused"].time_s
    assert by_loss["fused_recompute"].time_s - by_loss["fused"].time_s == pytest.approx(one, rel=1e-9)
    tp = {loss: predict_model("tp_v1", CFG, s, mode="fwd_bwd", hardware=hw, loss=loss).parts["head"]
          for loss in ("unfused", "fused", "fused_recompute")}
    assert tp["fused"] == tp["unfused"]
    assert tp["fused_recompute"] - tp["unfused"] == pytest.approx(_gemm(128, CFG.vocab_size // 4, CFG.hidden),
                                                                  rel=1e-9)


@pytest.mark.parametrize("method,checkpoint,mode", [("burst", "seq", "seq"), ("usp", "seq", "full"),
                                                    ("ring", "none", "none"), ("ring", "full", "full")])
def test_training_memory_is_the_step_memory_model(method, checkpoint, mode):
    """The whole model's training memory is step_memory's, with the attention layer's transient buffers
    (the schedule's, per phase) placed at the step's moments, so the two cannot drift; recompute is
    sequence-level checkpointing, which methods other than the BurstAttention operator run as full
    recompute. Without the buffers the step's peak is no larger (they only add moments)."""
    from burst_impl.model.memory import AttentionTerms

    hw, s = _hw(), _shape(4, 128)
    mp = predict_model(method, CFG, s, mode="fwd_bwd", hardware=hw, weights="fsdp2", checkpoint=checkpoint,
                       loss="fused")
    phase = mp.attention.memory["transient_by_phase"]
    kw = dict(batch=1, seqlen=128, world_size=4, method=get(method), layout="zigzag", dtype="bfloat16",
              weights="fsdp2", checkpoint=mode, loss="fused", loss_device="cuda")
    sm = step_memory(CFG, attention=AttentionTerms(forward=phase["forward"], backward=phase["backward"]), **kw)
    assert mp.memory["checkpoint"] == mode and mp.memory["step"] == sm.as_dict()
    assert mp.memory["total_bytes"] == sm.total_bytes >= step_memory(CFG, **kw).total_bytes


@pytest.mark.parametrize("mode", ["fwd_bwd", "forward"])
def test_oom_when_the_whole_model_exceeds_hbm(mode):
    """With the HBM between the attention layer's peak and the whole model's, the layer fits but the
    model is OOM, its record says so (no time) and still carries the time it would take."""
    s = _shape(2)
    fits = predict_model("burst", CFG, s, mode=mode, hardware=_hw())
    layer, whole = fits.attention.memory["total_bytes"], fits.memory["total_bytes"]
    assert fits.status == "ok" and layer < whole
    small = predict_model("burst", CFG, s, mode=mode, hardware=_hw(hbm_gib=(layer + whole) / 2 / 2**30))
    assert small.attention.status == "ok" and small.status == "oom"
    assert "whole-model memory" in small.reason and small.memory["total_bytes"] == whole
    rec = model_record(_record(_case("burst", s, mode), small.attention, "x"), small, "x_model_level")
    assert rec["status"] == "oom" and rec["time_median_s"] is None and rec["time_model_s"] == small.time_s


def test_tp_holds_one_gth_of_the_weights():
    hw, s = _hw(), _shape(4, 128)
    P = num_params(CFG)
    for mode in ("fwd_bwd", "forward"):
        for m in [n for n, meth in METHODS.items() if meth.tp_version]:
            tp = predict_model(m, CFG, s, mode=mode, hardware=hw)
            assert tp.memory["weights"] == "tp" and tp.memory["parts"]["weights"] == -(-P // 4) * 2
        sp = predict_model("burst", CFG, s, mode=mode, hardware=hw)
        assert sp.memory["weights"] == "replicated" and sp.memory["parts"]["weights"] == P * 2


def test_ablation_fused_head_saves_memory_and_seq_checkpointing_time():
    """BurstEngine's ablation at its size (14B, 1M tokens, 32 A800, FSDP2), the rows of its spec
    (specs/model_burstengine_ablation_14b_1m.yaml): the fused LM head removes the logits (memory falls);
    sequence-level checkpointing, after full-block checkpointing, caches half the attention outputs (memory
    rises a little) so that the recompute runs attention on the first half only (time falls); the whole
    attention cache rises and falls again; every row fits the A800 with checkpointing."""
    from experiments.harness.spec import EXPERIMENTS_DIR, load_spec
    from experiments.perfmodel.model_figures import BE_HARDWARE, model_spec_records

    spec = load_spec(EXPERIMENTS_DIR / "specs" / "model_burstengine_ablation_14b_1m.yaml")
    recs = model_spec_records(spec, load_hardware(BE_HARDWARE), "x")
    rows = spec.model.variants
    assert [r["ablation_step"] for r in recs] == list(range(len(rows)))
    fused = next(i for i, row in enumerate(rows) if row.loss == "fused")
    seq = next(i for i, row in enumerate(rows) if row.checkpoint == "seq")
    assert rows[seq + 1].checkpoint == "whole" and total_of(recs, seq + 1) > total_of(recs, seq)
    assert recs[seq + 1]["time_model_s"] < recs[seq]["time_model_s"]     # attention never recomputed
    total = [r["mem_total_bytes"] for r in recs]
    assert total[fused] < total[fused - 1], total
    logits = [r["mem_parts_bytes"]["logits"] for r in recs]
    assert logits[fused] < logits[fused - 1] / 10
    assert (recs[seq]["checkpoint"], recs[seq - 1]["checkpoint"]) == ("seq", "full")
    assert total[seq] > total[seq - 1]                                  # the cached (O, lse)
    assert recs[seq]["time_model_s"] < recs[seq - 1]["time_model_s"]    # less recompute
    assert all(r["status"] == "ok" for r in recs), [r["reason"] for r in recs if r["status"] != "ok"]


def total_of(recs: list[dict], i: int) -> int:
    return recs[i]["mem_total_bytes"]
