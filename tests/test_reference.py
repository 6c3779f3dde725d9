"""Each group's reference on an emulated cluster (experiments/harness/reference.py) and the load the validation
prices a record's kernels and host work at (experiments/perfmodel/emulated/validate.py, ``case_load``)."""
from __future__ import annotations

import json

import pytest
import torch

from baselines import AttnShape
from experiments.harness import reference
from experiments.harness import results as R
from experiments.harness.measure import Current, measure_group
from experiments.harness.spec import Case
from experiments.perfmodel.emulated import validate
from experiments.perfmodel.emulated.measured import HBM, KernelTimes
from tests.emulated_records import emulated_cluster, emulated_record

CAL = {"tokens": 32, "heads": 2, "head_dim": 8, "dtype": "float32", "per_rank_flops_s": 1e9}
FAST = {**CAL, "per_rank_flops_s": 1e6}        # a reference of one block a sample (the group test's cost)
KEY = ("attention", 1, 2, 8, 32, 32, False, "fwd_bwd", "float32")


def test_work_only_on_an_emulated_run_with_a_calibration():
    assert reference.work_of({"emulated": True, "calibration": CAL}) == {k: CAL[k] for k in reference.WORK_KEYS}
    assert reference.work_of({"emulated": True, "calibration": None}) is None       # given link rates
    big = reference.work_of({"emulated": True, "calibration": {**CAL, "tokens": 2048}})
    assert big["tokens"] == reference.MAX_TOKENS                                   # a round's cost bounded
    assert reference.work_of({"emulated": False, "calibration": CAL}) is None       # loopback, a GPU
    assert reference.step_for({}) == (None, None)
    step, work = reference.step_for({"emulated": True, "calibration": CAL})
    # 1e9 FLOP/s against a block of 4*32^2*2*8*3.5 FLOPs: MIN_SAMPLE_S takes ceil(0.5 / 2.29e-4) = 2180 blocks
    assert work["calls"] == 2180
    step(n=1)                                                                      # runs: fwd+bwd of a block
    f = reference.field(work, [0.3, 0.1, 0.2], [[1.0, 3.0, 2.0], [4.0, 4.0, 5.0]])
    assert f["median_s"] == 0.2 and f["cpu_s_per_rank"] == [2.0, 4.0] and f["samples_s"] == [0.3, 0.1, 0.2]
    assert f["calls"] == 2180 and set(f["work"]) == set(reference.WORK_KEYS)
    # a reference shorter than two CFS periods measured the quota's burst, not the rate: not used
    assert reference.long_enough({"median_s": 0.11, "calls": 2}, {})                      # 0.22 s, 100 ms period
    assert not reference.long_enough({"median_s": 0.11}, {})                               # one 0.11 s block
    assert reference.long_enough({"median_s": 0.11}, {"cpu_quota": {"period_us": 50_000}})


def _group(method: str) -> Case:
    shape = AttnShape(seqlen=32, world_size=1, batch=1, heads=2, kv_heads=2, head_dim=8)
    return Case(experiment="t_ref", method=method, level="op", mode="fwd_bwd", shape=shape, warmup=0, repeats=3,
                seed=0, max_repeats=3)


def _measure(cases):
    return measure_group(cases, rank=0, world=1, device=torch.device("cpu"), current=Current(),
                         shape_checked=lambda s: s, inject=lambda c, r: None)


def test_a_group_on_an_emulated_cluster_times_the_reference_in_its_rounds(monkeypatch):
    monkeypatch.setenv(R.CLUSTER_ENV, json.dumps({"emulated": True, "calibration": FAST}))
    recs = _measure([_group("burst"), _group("ring")])
    for rec in recs:
        ref = rec["time_reference"]
        assert ref["work"] == {k: CAL[k] for k in reference.WORK_KEYS}
        assert len(ref["samples_s"]) == rec["rounds"] == len(rec["time_samples_s"])  # one sample a round
        assert ref["median_s"] > 0 and len(ref["cpu_s_per_rank"]) == 1
    assert recs[0]["time_reference"] == recs[1]["time_reference"]                   # the group's, on each
    monkeypatch.setenv(R.CLUSTER_ENV, json.dumps({"emulated": False}))
    assert "time_reference" not in _measure([_group("burst")])[0]                   # nothing to carry


def _times(records, attn: float, ref: float) -> KernelTimes:
    sec = {k: (1e-9 if k == HBM else attn) for k in validate.needed_keys(records)}
    return KernelTimes(procs=2, threads=1, seconds={**sec, KEY: ref})


def test_case_load_prices_a_record_at_its_own_rounds():
    # the run's calibration: the block at 1e9 FLOP/s against the table's 0.1 s for it
    flops = 4 * 32 * 32 * 2 * 8 * 3.5
    cal = {**CAL, "per_rank_flops_s": flops / 0.1}                       # the table's rate: run load 1
    plain = emulated_record(256, "burst", 1.0, emulated_cluster(cal))
    slow = {**plain, "time_reference": {"work": {k: CAL[k] for k in reference.WORK_KEYS}, "median_s": 0.3}}
    short = {**plain, "time_reference": {**slow["time_reference"], "median_s": 0.15}}    # under 2 periods
    times = _times([plain, slow], 0.25, 0.1)
    assert KEY in validate.needed_keys([slow])
    assert validate.load_scale(plain["cluster"], times) == pytest.approx(1.0)
    assert validate.case_load(plain, times) is None                      # no reference: the run's load
    assert validate.case_load(slow, times) == pytest.approx(3.0)         # 0.3 s against the table's 0.1
    assert validate.case_load(short, times) is None                      # the quota's burst: the run's load
    # at the bring-up load on request, every record at the run's load, the reference's reported beside it
    a, b = (validate.compare([r], times, at_reference=False)[0] for r in (plain, slow))
    assert (a["reference_load"], b["reference_load"], b["load_scale"]) == (None, pytest.approx(3.0), 1.0)
    assert b["predicted_s"] == pytest.approx(a["predicted_s"], rel=1e-12)
    # by default each record at its own group's reference, where it has one
    a, b = (validate.compare([r], times)[0] for r in (plain, slow))
    assert (a["load_scale"], b["load_scale"], b["run_load"]) == pytest.approx((1.0, 3.0, 1.0))
    # a forward at 2 ranks whose transfer hides under its kernels: all compute, so 3x
    assert b["predicted_s"] == pytest.approx(3 * a["predicted_s"], rel=1e-6)
    (c,) = validate.compare([short], times)                               # too short to price: the run's load
    assert (c["load_scale"], c["reference_load"]) == (pytest.approx(1.0), None)
    text = validate.compute_load_line(validate.compare([plain, slow], times))
    assert "own reference load for 1 of 2 rows (3.00-3.00" in text and "priced for the other 1" in text
    assert "bring-up load 1.00" in validate.compute_load_line(validate.compare([slow], times, at_reference=False))
    missing = KernelTimes(2, 1, {k: v for k, v in times.seconds.items() if k != KEY})
    assert validate.case_load(slow, missing) is None                      # the table lacks the work


def test_the_repeat_policy_judges_the_cases_not_the_reference():
    from experiments.harness.timing import RepeatPolicy, time_interleaved
    seen = []

    class Spy(RepeatPolicy):
        def stop(self, samples, elapsed_s, round_s):
            seen.append(len(samples))
            return "max_repeats"
    policy = Spy(min_repeats=1, max_repeats=1, target=0.05, budget_s=10.0)
    out = time_interleaved([(lambda: None, None)] * 3, warmup=0, policy=policy, device=torch.device("cpu"), judged=2)
    assert seen == [2] and len(out.samples) == 3          # all three timed, two judged
    time_interleaved([(lambda: None, None)] * 3, warmup=0, policy=policy, device=torch.device("cpu"))
    assert seen == [2, 3]                                 # by default every step
    with pytest.raises(ValueError, match="judged=4"):
        time_interleaved([(lambda: None, None)] * 3, warmup=0, policy=policy, device=torch.device("cpu"), judged=4)


def test_at_a_reference_the_host_term_is_still_derived_at_the_runs_load():
    # the host term comes from probes taken near bring-up: derived at the run's load (1 here), then carried with the
    # kernels to the reference's (3x); derived at 3x instead, the model's own compute in the small call would be
    # 3x and the host term smaller
    flops = 4 * 32 * 32 * 2 * 8 * 3.5
    cal = {**CAL, "per_rank_flops_s": flops / 0.1}
    plain = emulated_record(256, "burst", 1.0, emulated_cluster(cal, cpus=0.5))
    slow = {**plain, "time_reference": {"work": {k: CAL[k] for k in reference.WORK_KEYS}, "median_s": 0.3}}
    call = {"rows": [{"method": "burst", "seqlen": 16, "world_size": 2, "node_size": 1, "heads": 2, "head_dim": 8,
                      "dtype": "float32", "causal": False, "layout": "contiguous", "cpu_s_median": 1.0}],
            "path": "call_cpu.json"}
    keys = validate.needed_keys([slow], call)
    times = KernelTimes(procs=2, threads=1, seconds={**{k: (1e-9 if k == HBM else 0.25) for k in keys}, KEY: 0.1})
    (run,) = validate.compare([slow], times, call=call, at_reference=False)
    (ref,) = validate.compare([slow], times, call=call)
    assert run["host"]["host_s_per_op"] > 0
    assert ref["host"]["host_s_per_op"] == pytest.approx(run["host"]["host_s_per_op"], rel=1e-12)
    assert ref["call_host"] == run["call_host"]
    # kernels and host both at 3x, the transfer hidden under them: the whole prediction 3x
    assert ref["predicted_s"] == pytest.approx(3 * run["predicted_s"], rel=1e-6)
    ld = validate.loads_of(slow, times, at_reference=True)
    assert (ld.run, ld.reference, ld.memory, ld.priced) == (pytest.approx(1.0), pytest.approx(3.0), None,
                                                            pytest.approx(3.0))
    assert validate.loads_of(slow, times, at_reference=False).priced == pytest.approx(1.0)
    assert validate.loads_of(slow, times).priced == pytest.approx(3.0)
    assert validate.loads_of(slow, times, at_reference=True, rescale=False).priced == 1.0
