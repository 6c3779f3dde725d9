"""The memory rate timed at bring-up beside the calibration's block (experiments/cluster/emulator/emulation.py)
and the load the validation carries memory-bound work at (experiments/perfmodel/emulated: ``validate.memory_load``,
``EmulatedCosts.memory_bound``, a decode step's attention and GEMV in ``decode_costs.DecodeEmulatedCosts``)."""
from __future__ import annotations

import pytest

from experiments.cluster.emulator import emulation
from experiments.harness import reference
from experiments.perfmodel.emulated import validate
from experiments.perfmodel.emulated.costs import EmulatedCosts
from experiments.perfmodel.emulated.decode_costs import DecodeEmulatedCosts, decode_key
from experiments.perfmodel.emulated.measured import HBM, KernelTimes, _runner
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
    # no memory rate for the run (before 2026-12-06): everything at the compute load, as before
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
    assert validate.memory_line(rows) == ("memory traffic and a decode step's attention at the run's memory load "
                                          "1.23 (its bring-up memory rate over the table's; compute load 1.05)")
    assert "no memory rate" in validate.memory_line([{"memory_load": None, "run_load": 1.0}])
