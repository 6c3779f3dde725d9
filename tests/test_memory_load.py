"""The memory rate timed at bring-up beside the calibration's block (experiments/cluster/emulator/emulation.py)
and the load the validation carries memory-bound work at (experiments/perfmodel/emulated: ``validate.memory_load``,
``EmulatedCosts.memory_bound``, a decode step's attention and GEMV in ``decode_costs.DecodeEmulatedCosts``)."""
from __future__ import annotations

import pytest
import torch

from experiments.cluster.emulator import emulation
from experiments.harness import reference
from experiments.perfmodel.emulated import validate
from experiments.perfmodel.emulated.costs import EmulatedCosts
from experiments.perfmodel.emulated.decode_costs import DecodeEmulatedCosts, decode_key
from experiments.perfmodel.emulated.measured import HBM, KernelTimes, _runner, chunks, footprint
from experiments.profiles.hardware import load_hardware

HW = load_hardware("a100_pcie_roce_4x8")
GEMM = ("gemm", 1, 256, 256, "float32")


def _times(extra: dict | None = None) -> KernelTimes:
    return KernelTimes(procs=1, threads=1, seconds={HBM: 1e-10, **(extra or {})})


def test_memory_load_is_the_bring_up_rate_over_the_tables():
    cal = {"per_rank_flops_s": 1e9, "per_rank_memory_s_per_byte": 2.5e-10}
    assert validate.memory_load({"calibration": cal}, _times()) == pytest.approx(2.5)
    # a calibration before 2026-12-06 (no memory rate), or a table without the key: None, the compute load's
    assert validate.memory_load({"calibration": {"per_rank_flops_s": 1e9}}, _times()) is None
    assert validate.memory_load({"calibration": {**cal, "per_rank_memory_s_per_byte": None}}, _times()) is None
    assert validate.memory_load({"calibration": cal}, KernelTimes(1, 1, {})) is None
    assert validate.memory_load({}, _times()) is None


def test_memory_traffic_and_a_decode_steps_attention_go_at_the_memory_load():
    dkey = decode_key(1, 4096, 8, 2, 64, "float32")
    times = _times({dkey: 2e-3, GEMM: 1e-4})
    c = DecodeEmulatedCosts(HW, "float32", times=times, scale=1.2, mem_scale=3.0)
    assert c.hbm(1e9) == pytest.approx(1e9 * 1e-10 * 3.0)
    t, flops = c.decode_attention(1, 4096, 8, 2, 64)
    assert t == pytest.approx(2e-3 * 3.0) and flops == 4.0 * 4096 * 8 * 64
    assert c.decode_attention(0, 4096, 8, 2, 64) == (0.0, 0.0)
    # the GEMV's weights stay in cache here: the compute load
    t, flops = c.weight_gemm(1, 256, 256)
    assert t == pytest.approx(1e-4 * 1.2) and flops == 2.0 * 256 * 256
    # no stream load given (the memory rule "compute", or a run before 2026-12-06): everything at the compute load
    old = DecodeEmulatedCosts(HW, "float32", times=times, scale=1.2)
    assert old.decode_attention(1, 4096, 8, 2, 64)[0] == pytest.approx(2e-3 * 1.2)
    assert old.hbm(1e9) == pytest.approx(0.12)
    with pytest.raises(KeyError, match="no measured time"):
        c.decode_attention(1, 99, 8, 2, 64)
    assert isinstance(c, EmulatedCosts)


def test_the_tables_memory_work_is_the_calibrations():
    # the table's ("hbm",) key and the calibration time the same arrays: their ratio is a rate's change, not a size's
    assert _runner(HBM)().numel() == reference.stream_step()().numel() == reference.STREAM_ELEMENTS


def test_the_calibration_times_the_memory_rate_and_records_it():
    cal = emulation.calibrate(procs=1, threads=1, tokens=32, heads=2, head_dim=8, dtype="float32", seconds=0.05,
                              memory_seconds=0.05)
    assert len(cal.flops_per_s) == 1 and len(cal.memory_s_per_byte) == 1
    # some GB/s on any machine: between 1e-12 and 1e-7 s a byte
    assert 1e-12 < cal.memory_per_rank < 1e-7
    d = emulation.scale(HW, cal).to_dict()["calibration"]
    assert d["per_rank_memory_s_per_byte"] == pytest.approx(cal.memory_per_rank)
    old = emulation.Calibration(1024, 8, 32, "float32", 1, 1, (1e9,))       # before 2026-12-06
    assert old.memory_per_rank is None
    assert emulation.scale(HW, old).to_dict()["calibration"]["per_rank_memory_s_per_byte"] is None


def test_the_report_says_which_load_memory_traffic_went_at():
    rows = [{"memory_load": 1.2345, "run_load": 1.05}, {"memory_load": 1.2345, "run_load": 1.05}]
    assert validate.memory_line(rows) == ("memory traffic and a decode step's attention at the memory load 1.23 (the "
                                          "run's bring-up memory rate over the table's; bring-up compute load 1.05)")
    assert "no memory rate" in validate.memory_line([{"memory_load": None, "run_load": 1.0}])
    grouped = [{"memory_load": 1.5, "memory_reference_load": 1.5, "memory_run_load": 1.1, "run_load": 1.0},
               {"memory_load": 1.1, "memory_reference_load": None, "memory_run_load": 1.1, "run_load": 1.0}]
    assert validate.memory_line(grouped) == (
        "memory traffic and a decode step's attention at the memory load 1.10-1.50 (the groups' own memory "
        "references for 1 of 2 rows, the bring-up's (1.10) for the rest; bring-up compute load 1.00)")
    beside = [{**r, "memory_load": 1.1} for r in grouped]        # priced at the bring-up's, the group's reported
    assert validate.memory_line(beside) == (
        "memory traffic and a decode step's attention at the memory load 1.10 (the run's bring-up memory rate over "
        "the table's; bring-up compute load 1.00; the groups' memory references, not priced: 1.50-1.50)")
    at_compute = [{**r, "memory_load": None} for r in grouped]     # the default rule since 2026-12-07
    assert validate.memory_line(at_compute) == (
        "memory traffic and a decode step's attention at the compute load (memory rule \"compute\", since "
        "2026-12-07); the stream's loads, not priced: bring-up 1.10; the groups' memory references 1.50-1.50")


CAL = {"tokens": 32, "heads": 2, "head_dim": 8, "dtype": "float32", "per_rank_flops_s": 1e6}


def test_the_memory_reference_runs_only_where_the_calibration_timed_the_memory_rate():
    assert reference.memory_step_for({"emulated": True, "calibration": CAL}) == (None, None)   # before 2026-12-06
    assert reference.memory_step_for({"emulated": False, "calibration": {**CAL, "per_rank_memory_s_per_byte": 1e-10}}
                                     ) == (None, None)                                   # loopback, a GPU
    step, work = reference.memory_step_for({"emulated": True,
                                            "calibration": {**CAL, "per_rank_memory_s_per_byte": 1e-10}})
    # 0.5 s at 1e-10 s a byte over 96 MiB a call: ceil(0.5 / 0.01007) = 50 calls a sample
    assert work == {"bytes": reference.STREAM_BYTES, "calls": 50}
    step(n=1)
    f = reference.memory_field(work, [0.3, 0.1, 0.2], [[1.0, 3.0, 2.0]])
    assert f == {"bytes": reference.STREAM_BYTES, "calls": 50, "samples_s": [0.3, 0.1, 0.2], "median_s": 0.2,
                 "cpu_s_per_rank": [2.0]}


def test_a_group_times_the_memory_reference_after_the_compute_reference(monkeypatch):
    import json

    import torch

    from baselines import AttnShape
    from experiments.harness import results as R
    from experiments.harness.measure import Current, measure_group
    from experiments.harness.spec import Case
    shape = AttnShape(seqlen=32, world_size=1, batch=1, heads=2, kv_heads=2, head_dim=8)
    cases = [Case(experiment="t_mem", method=m, level="op", mode="fwd_bwd", shape=shape, warmup=0, repeats=3, seed=0,
                  max_repeats=3) for m in ("burst", "ring")]

    def measure():
        return measure_group(cases, rank=0, world=1, device=torch.device("cpu"), current=Current(),
                             shape_checked=lambda s: s, inject=lambda c, r: None)
    # 1e-7 s a byte: one stream call a sample (the test's cost)
    monkeypatch.setenv(R.CLUSTER_ENV, json.dumps({"emulated": True,
                                                  "calibration": {**CAL, "per_rank_memory_s_per_byte": 1e-7}}))
    recs = measure()
    for rec in recs:
        mem, ref = rec["time_memory_reference"], rec["time_reference"]
        assert mem["calls"] == 1 and mem["bytes"] == reference.STREAM_BYTES
        assert len(mem["samples_s"]) == len(ref["samples_s"]) == rec["rounds"]
        # the two references are two steps' samples, not one step's twice
        assert mem["samples_s"] != ref["samples_s"] and ref["work"]["tokens"] == 32
    monkeypatch.setenv(R.CLUSTER_ENV, json.dumps({"emulated": True, "calibration": CAL}))
    rec = measure()[0]
    assert "time_reference" in rec and "time_memory_reference" not in rec


def test_a_group_is_priced_at_its_own_memory_rate_where_it_timed_one():
    times = _times()
    cluster = {"emulated": True, "calibration": {**CAL, "per_rank_memory_s_per_byte": 1.5e-10}}
    rec = {"cluster": cluster, "time_memory_reference": {"bytes": 10**9, "calls": 1, "median_s": 0.25}}
    assert validate.memory_key(rec) == HBM and validate.memory_key({"cluster": {}}) is None
    assert validate.case_memory_load(rec, times) == pytest.approx(2.5)         # 2.5e-10 s a byte against 1e-10
    # by default at the compute load (memory None), both streams' loads reported beside it
    ld = validate.loads_of(rec, times)
    assert (ld.memory_run, ld.memory_reference, ld.memory) == pytest.approx((1.5, 2.5, None))
    assert validate.loads_of(rec, times, memory_rule="bring-up").memory == pytest.approx(1.5)
    assert validate.loads_of(rec, times, memory_rule="group").memory == pytest.approx(2.5)
    # no reference, a table without the key, a sample shorter than two CFS periods (0.2 s here: 100 ms): the bring-up
    assert validate.loads_of({"cluster": cluster}, times, memory_rule="group").memory == pytest.approx(1.5)
    with pytest.raises(ValueError, match="memory_rule='hbm' must be one of compute, bring-up, group"):
        validate.loads_of(rec, times, memory_rule="hbm")
    assert validate.case_memory_load(rec, KernelTimes(1, 1, {})) is None
    short = {**rec, "time_memory_reference": {"bytes": 1000, "calls": 1, "median_s": 0.15}}
    assert validate.case_memory_load(short, times) is None
    two = {**rec, "time_memory_reference": {"bytes": 10**8, "calls": 2, "median_s": 0.12}}     # 0.24 s a sample
    assert validate.case_memory_load(two, times) == pytest.approx(12.0)


def test_a_batch_decode_key_is_timed_over_the_steps_caches_in_turn():
    assert decode_key(1, 4096, 8, 2, 64, "float32") == ("decode", 1, 4096, 8, 2, 64, "float32")   # B 1: as before
    key = decode_key(1, 64, 8, 2, 16, "float32", batch=3)
    assert key == ("decode", 1, 64, 8, 2, 16, "float32", 3)
    run = _runner(key)
    outs = [run()[0] for _ in range(4)]
    # three caches in turn: calls 1 and 4 read the same one, 1 and 2 do not
    assert torch.equal(outs[0], outs[3]) and not torch.equal(outs[0], outs[1])
    assert footprint(key) == 3 * 2 * 64 * 2 * 16 * 4 and footprint(GEMM) == 0


def test_keys_are_timed_in_chunks_that_fit_the_memory():
    big = [decode_key(1, n, 8, 1, 64, "float32", batch=4) for n in (1 << 18, 1 << 18, 1 << 16)]   # 512, 512, 128 MiB
    assert chunks(big + [GEMM]) == [[big[0], big[1]], [big[2], GEMM]]          # 1 GiB a chunk at most
    assert chunks([GEMM, HBM]) == [[GEMM, HBM]]


def test_the_decode_schedule_prices_each_sequence_in_a_step_over_the_batch():
    from baselines import AttnShape
    from experiments.perfmodel.emulated.decode_costs import DecodeRecording
    from experiments.perfmodel.inference import predict_inference
    shape = AttnShape(batch=4, seqlen=4096, heads=8, kv_heads=2, head_dim=64, world_size=4, causal=True)
    seen = set()

    predict_inference("cp_all_gather", shape, mode="decode", hardware=HW,
                      costs=lambda hw, dt: DecodeRecording(hw, dt, seen=seen))
    assert {k[-1] for k in seen if k[0] == "decode"} == {4}
    # the accelerator's roofline reads every sequence's cache whatever the batch
    from experiments.perfmodel.decode_costs import DecodeCosts
    gpu = DecodeCosts(HW, "float32")
    assert gpu.decode_attention(1, 4096, 8, 2, 64, 4) == gpu.decode_attention(1, 4096, 8, 2, 64)
