"""The lockstep probe's pieces that need no cluster (experiments/cluster/emulator/lockstep_probe.py), the factor
the inference validation reads from it (experiments/perfmodel/emulated/lockstep.py) and where it multiplies. A
run on an emulated cluster is ``burst-bench cluster lockstep <profile>`` (root; tests/test_emulator.py runs one;
measured in docs/findings.md)."""
from __future__ import annotations

import json

import pytest
import torch

from baselines import AttnShape
from experiments.cluster.emulator import lockstep_probe as P
from experiments.perfmodel.emulated import lockstep as L
from experiments.perfmodel.emulated import validate_decode
from experiments.perfmodel.emulated.measured import HBM, KernelTimes
from tests.test_inference_model import _decode_record


def test_cases_parse_and_bad_ones_name_the_rule():
    assert P.parse_cases("2000,50000") == [P.Case(2000), P.Case(50000)]
    cases = P.parse_cases("2000,mem5000")
    assert cases == [P.Case(2000), P.Case(5000, "memory")] and [c.name for c in cases] == ["2000", "mem5000"]
    for bad in ("0", "free:2000", "-5", "2.5", "mem0", "memx", "mem"):
        with pytest.raises(ValueError, match="microseconds, a positive integer"):
            P.parse_cases(bad)
    with pytest.raises(ValueError, match="needs 2 ranks, not 1"):
        P.check_shape([P.Case(2000)], 1, 1)
    P.check_shape([P.Case(2000)], 1, 2)


def test_a_memory_unit_streams_the_next_slice_and_a_compute_unit_stays_in_cache():
    x, y = torch.zeros(6), torch.arange(6.0)
    stream = P._stream_unit(x, y, 2)
    stream()
    assert x.tolist() == [0, 1, 0, 0, 0, 0]                         # the first slice only
    for _ in range(3):                                              # the other two, then the first again
        stream()
    assert x.tolist() == [0, 2, 2, 3, 4, 5]
    assert P.STREAM_ELEMENTS % P.STREAM_SLICE == 0                  # the probe's slices tile its arrays
    assert P._unit_of("compute")().shape == (P.UNIT, P.UNIT)


def _ranks(free_wall, lock_wall, sync_wall, cpus):
    """Two ranks' results for one case: every round's walls the same on both, the CPU per rank given."""
    return [{"5000": {"free": {"wall": free_wall, "cpu": [c] * len(free_wall)},
                      "lockstep": {"wall": lock_wall, "cpu": [c + 0.0001] * len(lock_wall)},
                      "sync": {"wall": sync_wall, "cpu": [0.0001] * len(sync_wall)}}} for c in cpus]


def test_the_factor_is_each_rounds_free_share_over_its_lockstep_share_less_the_all_reduce():
    # round 1: free 5 ms CPU in 20 ms (0.25), lockstep 5 ms CPU in 25 ms less 1 ms of all-reduce (5/24):
    # factor 0.25 / (5/24) = 1.2; round 2 the machine ran twice as slowly at both: the same factor
    ranks = _ranks([0.020, 0.040], [0.025, 0.049], [0.001, 0.001], (0.004, 0.005, 0.006))
    (row,) = P.summarize(ranks, [P.Case(5000)])
    assert row["world_size"] == 3 and row["free_cpu_s"] == pytest.approx(0.005)
    assert row["factor_samples"][0] == pytest.approx(1.2) and row["factor_samples"][1] == pytest.approx(1.2)
    assert row["factor"] == pytest.approx(1.2) and row["lockstep_wall_s"] == pytest.approx(0.037)
    assert "1.200" in P.table([row])


def test_rows_of_several_world_sizes_fill_one_file_and_give_one_factor_each(tmp_path):
    out = tmp_path / L.LOCKSTEP_FILE
    prov = {"profile": "a800_ib_emu_2x4", "time": "t"}
    rows8 = [{"case": str(p), "world_size": 8, "factor": f} for p, f in ((2000, 1.2), (5000, 1.0), (50000, 1.1))]
    P.write(out, rows8, prov)
    P.write(out, [{"case": "2000", "world_size": 4, "factor": 0.9}], prov)
    P.write(out, [{"case": "2000", "world_size": 8, "factor": 1.3}], prov)      # replaces G 8's 2000
    P.write(out, [{"case": "mem5000", "piece": "memory", "world_size": 8, "factor": 9.0}], prov)   # not read
    rows = json.loads(out.read_text())["rows"]
    assert sorted((r["world_size"], r["case"]) for r in rows) == [(4, "2000"), (8, "2000"), (8, "5000"), (8, "50000"),
                                                                  (8, "mem5000")]
    lock = L.load_lockstep(tmp_path, "a800_ib_emu_2x4")
    assert lock["factors"] == {4: 0.9, 8: 1.1} and lock["path"] == str(out)
    assert L.factor(lock, 8) == 1.1 and L.factor(lock, 2) == 1.0 and L.factor(None, 8) == 1.0
    assert L.load_lockstep(tmp_path, "another_profile") is None and L.load_lockstep(tmp_path / "x", None) is None
    assert "G 4 x0.900, G 8 x1.100" in L.lockstep_text(lock) and "factor 1" in L.lockstep_text(None)


def test_the_inference_validation_multiplies_the_work_and_not_the_links():
    rec = _decode_record("cp_all_gather", "burst", "all_gather", 0.01)
    keys = validate_decode.needed_keys([rec])
    times = KernelTimes(procs=2, threads=1, seconds={k: (1e-9 if k == HBM else 1e-3) for k in keys})
    (plain,) = validate_decode.compare([rec], times)
    world = AttnShape(**{k: rec[k] for k in validate_decode.SHAPE_KEYS}).world_size
    (slow,) = validate_decode.compare([rec], times, lockstep={"factors": {world: 2.0}, "path": "p"})
    (other,) = validate_decode.compare([rec], times, lockstep={"factors": {world + 1: 2.0}, "path": "p"})
    assert plain["lockstep_factor"] == 1.0 and slow["lockstep_factor"] == 2.0 and other == plain
    comm = plain["critical_comm_s"]
    assert comm > 0 and slow["critical_comm_s"] == pytest.approx(comm)
    assert slow["predicted_s"] == pytest.approx(2 * (plain["predicted_s"] - comm) + comm)


def test_a_training_validation_takes_the_factor_only_when_asked_and_on_the_work_alone():
    """``validate.compare(lockstep=)`` (opt-in, ``history --lockstep``): a compute-bound forward's work and its host
    term go x the factor of its world size, a world size the probe lacks at 1, and without the argument as before."""
    from experiments.perfmodel.emulated import validate
    from tests.test_perfmodel_host import _call, _record, _times
    recs = [_record(256, 0.6)]
    call = _call(cpu_s=1.0)
    times = _times(recs, call)
    (plain,) = validate.compare(recs, times, rescale=False, call=call)
    (slow,) = validate.compare(recs, times, rescale=False, call=call, lockstep={"factors": {2: 1.5}, "path": "p"})
    (other,) = validate.compare(recs, times, rescale=False, call=call, lockstep={"factors": {8: 1.5}, "path": "p"})
    assert plain["lockstep_factor"] == 1.0 and slow["lockstep_factor"] == 1.5
    assert other["predicted_s"] == plain["predicted_s"]
    assert plain["critical_comm_s"] == pytest.approx(0.0, abs=1e-12)     # compute-bound: the whole time is work
    assert slow["predicted_s"] == pytest.approx(1.5 * plain["predicted_s"])
