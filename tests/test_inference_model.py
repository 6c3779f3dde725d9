"""The inference model (experiments/perfmodel/inference.py, schedules/decode.py): bytes placed equal the formulas
the measurement counts, the whole decoder's parts and memory, KV capacity from the cache formula, and the
emulated validation predicting from a kernel table (every kind of work it asks for, nothing fitted)."""
from __future__ import annotations

import math

import pytest

from baselines.decode_layer import ROWS, decode_layer_bytes, prefill_layer_bytes
from burst_impl.model.config import get_config
from burst_impl.shape import AttnShape
from experiments.perfmodel.emulated import validate_decode
from experiments.perfmodel.emulated.measured import HBM, KernelTimes
from experiments.perfmodel.inference import (kv_capacity_tokens, kv_per_token, predict_inference,
                                             predict_inference_model, weights_bytes)
from experiments.harness.inference_steps import kv_cache_bytes
from tests.emulated_records import emulated_cluster

H100 = "h100_sxm_ib_4x8"


def _shape(n=65536, g=8, b=2, z=32, zkv=8, d=128, dtype="bfloat16"):
    return AttnShape(b, n, z, zkv, d, g, dtype=dtype, layout="zigzag")


@pytest.mark.parametrize("row", ROWS)
def test_decode_bytes_are_the_formula_on_every_rank(row):
    s = _shape()
    p = predict_inference(row, s, mode="decode", hardware=H100, new_tokens=2)
    want = decode_layer_bytes(row, s, 2)
    assert p.registry_bytes == want
    assert all(p.bytes_per_rank.get(r, {}) == want for r in range(s.world_size))
    assert p.kv_bytes_per_rank == [kv_cache_bytes(row, s, s.seqlen + 2, r) for r in range(s.world_size)]


@pytest.mark.parametrize("row", ROWS)
def test_ttft_is_the_layer_forward_and_its_bytes(row):
    s = _shape(n=8192)
    p = predict_inference(row, s, mode="ttft", hardware=H100)
    assert sum(p.registry_bytes.values()) == sum(prefill_layer_bytes(row, s, 0).values())
    assert p.time_s == pytest.approx(p.parts["forward"] + p.parts["cache_write"])


def test_gqa_past_its_kv_heads_crosses_over_and_mha_does_not():
    """Llama-3 8B (Zkv = 8) on 32 H100: TP replicates each KV head 4 times, so at long context the sharded
    cache wins. On 8 H100 (G <= Zkv for Llama-3 8B and LLaMA-2 7B) TP shards the cache as finely and holds
    1/G of the weights: context parallelism never wins (modelled, not tuned: a regression check)."""
    def tpot(model, row, n, g, zkv, z=32):
        s = _shape(n=n, g=g, b=1, z=z, zkv=zkv)
        return predict_inference_model(row, model, s, mode="decode", hardware=H100).time_s
    assert tpot("llama3_8b", "cp_all_gather", 1 << 20, 32, 8) < tpot("llama3_8b", "tp", 1 << 20, 32, 8)
    for model, zkv in (("llama3_8b", 8), ("llama2_7b", 32)):
        for n in (4096, 1 << 20):
            cp = min(tpot(model, r, n, 8, zkv) for r in ("cp_all_gather", "cp_heads"))
            assert cp > tpot(model, "tp", n, 8, zkv)


def test_whole_model_memory_and_capacity():
    cfg = get_config("llama3_8b")
    s = _shape(n=1 << 20, g=8, b=16)
    p = predict_inference_model("cp_all_gather", cfg, s, mode="decode", hardware=H100)
    assert p.status == "oom"        # 16 x 1M tokens: 128 GiB of K/V per rank beside 15 GiB of weights
    assert p.memory["kv_bytes"] == cfg.n_layers * max(kv_cache_bytes("cp_all_gather", s, s.seqlen + 1, r)
                                                      for r in range(8))
    cap = {r: kv_capacity_tokens(r, cfg, s, p.hardware) for r in ROWS}
    assert cap["cp_all_gather"] == p.memory["kv_capacity_tokens"]
    # G = Zkv: TP shards the cache as finely as CP and holds 1/G of the weights, so more context fits
    assert cap["tp"] > cap["cp_heads"] > cap["cp_all_gather"] > 0
    free = p.hardware.accelerator.hbm_gib * 2**30 - weights_bytes("tp", cfg, 8, 2)
    assert cap["tp"] * kv_per_token("tp", cfg, s) <= free < (cap["tp"] + 1) * kv_per_token("tp", cfg, s)


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="row='ring' is unknown"):
        predict_inference("ring", _shape(), mode="decode", hardware=H100)
    with pytest.raises(ValueError, match="mode='train' is unknown"):
        predict_inference("tp", _shape(), mode="train", hardware=H100)
    with pytest.raises(ValueError, match="is not model 'llama2_7b'"):
        predict_inference_model("tp", "llama2_7b", _shape(), mode="decode", hardware=H100)


def _decode_record(row: str, method: str, merge, measured: float) -> dict:
    s = AttnShape(1, 64, 4, 1, 8, 2, dtype="float32", layout="contiguous")
    return {"status": "ok", "level": "inference", "mode": "decode", "method": method, "variant": row,
            "merge": merge, "new_tokens": 1, "case_id": row, "time_median_s": measured,
            "cluster": emulated_cluster(), **{k: getattr(s, k) for k in validate_decode.SHAPE_KEYS}}


def test_emulated_validation_predicts_from_the_kernel_table():
    recs = [_decode_record("cp_all_gather", "burst", "all_gather", 0.01), _decode_record("tp", "tp_v1", None, 0.01)]
    keys = validate_decode.needed_keys(recs)
    assert ("decode", 1, 33, 4, 1, 8, "float32") in keys      # rank 0's shard (32) + the new token it owns
    assert ("decode", 1, 65, 2, 1, 8, "float32") in keys      # TP: every token, its 2 query heads
    assert HBM in keys and any(k[0] == "gemm" for k in keys)
    times = KernelTimes(procs=2, threads=1, seconds={k: (1e-9 if k == HBM else 1e-3) for k in keys})
    rows = validate_decode.compare(recs, times)
    assert [r["row"] for r in rows] == ["cp_all_gather", "tp"]
    for r in rows:
        assert math.isfinite(r["predicted_s"]) and r["error"] == pytest.approx(r["predicted_s"] / 0.01 - 1)
    assert "NOT met" in validate_decode.error_table(rows)["text"] or validate_decode.error_table(rows)["met"]
    assert all(r["error_mean"] is None for r in rows) and "mean step" not in validate_decode.error_table(rows)["text"]
    # with the mean step recorded, its error is beside the median's; the verdict stays the median's
    (row,) = validate_decode.compare([{**recs[0], "time_mean_s": 0.02}], times)
    assert row["error_mean"] == pytest.approx(row["predicted_s"] / 0.02 - 1)
    table = validate_decode.error_table([{**row, "error": 0.5, "error_mean": 0.1}])
    assert not table["met"] and "against the mean step: 1 of 1 rows within 20% (worst 10.0%)" in table["text"]
    # each rank's CPU per step: the busiest rank's, and the share of a core it ran at over the median step
    (row,) = validate_decode.compare([{**recs[0], "time_cpu_s_per_rank": [0.002, 0.005]}], times)
    assert row["cpu_s"] == 0.005
    text = validate_decode.error_table([row])["text"]
    assert "CPU ms" in text and f"{5.0:7.2f} {0.5:5.2f}" in text
    assert "CPU ms" not in validate_decode.error_table(rows)["text"]


def test_a_decode_steps_own_call_gives_its_host_term():
    """call_cpu.json's decode:<row> row (benchmarks.cpu_per_call) is the host term of that row's decode records at
    its world, node size and batch: the small step, modelled with it, costs each rank its measured CPU at the cap;
    another batch, and TTFT, fall back to burst's training call (none here: no host term)."""
    from experiments.perfmodel.emulated.costs import EmulatedCosts
    from experiments.perfmodel.emulated.hardware import emulated_hardware
    from experiments.perfmodel.emulated.host_cost import compute_per_rank

    cpus = 0.5
    rec = {**_decode_record("cp_heads", "burst", "heads", 0.05), "cluster": emulated_cluster(cpus=cpus)}
    row = {"method": "decode:cp_heads", "mode": "decode", "seqlen": 16, "batch": 1, "world_size": 2, "node_size": 1,
           "heads": 4, "kv_heads": 1, "head_dim": 8, "dtype": "float32", "causal": True, "layout": "contiguous",
           "cpu_s_median": 0.004}
    call = {"rows": [row], "path": "call_cpu.json"}
    keys = validate_decode.needed_keys([rec, {**rec, "batch": 2}], call)
    assert ("decode", 1, 9, 4, 1, 8, "float32") in keys       # the small step: rank 0's 8 tokens + the new one
    times = KernelTimes(procs=1, threads=1, seconds={k: (1e-9 if k == HBM else 1e-4) for k in keys})
    (with_host,) = validate_decode.compare([rec], times, call=call)
    (without,) = validate_decode.compare([rec], times)
    host = with_host["host"]
    assert host["source"] == "decode:cp_heads" and host["measured_s"] == pytest.approx(0.004 / cpus)
    assert without["host"] is None and with_host["predicted_s"] > without["predicted_s"]
    # by its definition: the small step with the host term on every op costs the measured CPU at the cap
    small = validate_decode.decode_small_case(call, "cp_heads", world_size=2, node_size=1, dtype="float32", batch=1)
    hw = emulated_hardware(rec["cluster"], "float32")
    sch = validate_decode.SmallDecode(small).schedule(
        hw, lambda h, dt: EmulatedCosts(h, dt, times=times, scale=1.0, host_s=host["host_s_per_op"]))
    busy, ops = compute_per_rank(sch)
    assert ops == host["ops"] and busy == pytest.approx(host["measured_s"], rel=1e-6)
    (other_batch,) = validate_decode.compare([{**rec, "batch": 2}], times, call=call)
    assert other_batch["host"] is None
