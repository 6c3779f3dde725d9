"""Model level of the performance model (experiments/perfmodel/model_level.py): hand-computed MLP
schedules, TP's MLP collectives carrying exactly the registry's bytes, and the step's composition."""
from __future__ import annotations

import pytest

from baselines import AttnShape, get
from burst_impl.model.config import get_config, num_params
from burst_impl.model.flops import model_flops
from experiments.cluster.hardware import parse_hardware
from experiments.perfmodel.costs import CostModel
from experiments.perfmodel.model_level import mlp_schedule, model_record, predict_model
from experiments.perfmodel.placement import Placement

PEAK, GEMM_EFF, HBM_GBS = 100.0, 0.5, 1000.0      # TFLOP/s, fraction, GB/s: round numbers to compute by hand
INTRA_GBS, LAT_US = 8.0, 5.0                      # 8 Gb/s = 1e9 B/s per rank, 5 us


def _hw(nodes: int = 1, per_node: int = 4):
    raw = {"name": "hand", "nodes": nodes, "devices_per_node": per_node,
           "accelerator": {"name": "X", "peak_tflops": {"bfloat16": PEAK}, "hbm_gib": 80,
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
    rc = predict_model("burst", CFG, s, mode="fwd_bwd", hardware=hw, recompute=True)
    assert rc.time_s - plain.time_s == pytest.approx(pre.time_s - pre.parts["head"], rel=1e-9)


def test_model_record_and_bad_shape():
    from experiments.harness.spec import Case
    from experiments.perfmodel.predict import _record

    hw, s = _hw(), _shape(2)
    mp = predict_model("tp_v3", CFG, s, mode="fwd_bwd", hardware=hw)
    case = Case(experiment="x", method="tp_v3", level="layer", mode="fwd_bwd", shape=s, warmup=0, repeats=0, seed=0)
    rec = model_record(_record(case, mp.attention, "x"), mp, "x_model_level")
    assert rec["level"] == "model" and ".model." in rec["case_id"] and "mem_peak_bytes" not in rec
    assert rec["tflops_per_rank"] == pytest.approx(mp.flops / mp.time_s / 1e12 / 2)
    assert rec["mfu"] == pytest.approx(mp.flops / mp.time_s / (2 * PEAK * 1e12))
    layer_fwd = _record(case, mp.attention, "x")["comm_fwd_formula_bytes"]
    assert rec["comm_fwd_formula_bytes"] == layer_fwd + sum(v for (p, _), v in mp.mlp_registry_bytes.items()
                                                            if p == "forward")
    with pytest.raises(ValueError, match="is not model 'llama2_7b'"):
        predict_model("burst", "llama2_7b", s, mode="forward", hardware=hw)
    with pytest.raises(ValueError, match="mode='backward'"):
        predict_model("burst", CFG, s, mode="backward", hardware=hw)
