"""The host's work per op on the emulated cluster (experiments/perfmodel/emulated/host_cost.py) and the kernel table
timed under the ranks' CPU cap (measured.measure(cpus=), validate.validate_experiment).

Synthetic records and hand-set kernel times, as tests/test_perfmodel_validate.py: the host term is checked
against its definition (the measured call's CPU at the rank's cap, less the model's own compute there, per
op), against where it is charged (every op, no transfer's excess) and against when it is left out.
"""
from __future__ import annotations

import json

import pytest

from baselines import AttnShape
from experiments.harness.call_cpu import merge
from experiments.perfmodel.emulated import host_cost, measured, validate
from experiments.perfmodel.emulated.costs import EmulatedCosts
from experiments.perfmodel.emulated.hardware import emulated_hardware
from experiments.perfmodel.emulated.measured import HBM, KernelTimes
from experiments.perfmodel.model import predict_case
from tests._helpers import write_rows
from tests.emulated_records import emulated_cluster, emulated_record

CPUS = 0.5            # each rank's cap in the synthetic run
ATTN = 0.25           # s per kernel call (hand-set)


def _cluster(cpus=CPUS) -> dict:
    if cpus is None:        # the run asked for a cap, and could not apply it
        return {**emulated_cluster(), "cpu_quota": {"applied": False, "cpus_per_rank": CPUS}}
    return emulated_cluster(cpus=cpus)


def _record(seqlen: int, measured: float, cluster: dict | None = None) -> dict:
    return emulated_record(seqlen, "burst", measured, cluster or _cluster())


def _call(cpu_s: float, world_size: int = 2, node_size: int = 1) -> dict:
    # a measured fwd+bwd call at 16 tokens (benchmarks.cpu_per_call's record)
    return {"rows": [{"method": "burst", "seqlen": 16, "world_size": world_size, "node_size": node_size,
                      "heads": 2, "head_dim": 8, "dtype": "float32", "causal": False, "layout": "contiguous",
                      "cpu_s_median": cpu_s}], "path": "call_cpu.json"}


def _times(records, call) -> KernelTimes:
    keys = validate.needed_keys(records, call)
    return KernelTimes(procs=2, threads=1, seconds={k: (1e-9 if k == HBM else ATTN) for k in keys})


def test_the_host_term_makes_the_measured_call_cost_its_cpu_and_lengthens_every_op():
    recs = [_record(256, 0.6), _record(4096, 1.0)]
    call = _call(cpu_s=1.0)                                 # 1 s CPU at 0.5 CPU = 2 s per rank per call
    times = _times(recs, call)
    without = {r["seqlen"]: r for r in validate.compare(recs, times, rescale=False)}
    rows = {r["seqlen"]: r for r in validate.compare(recs, times, rescale=False, call=call)}
    host = rows[256]["host"]
    assert without[256]["host"] is None and host["measured_s"] == pytest.approx(1.0 / CPUS)
    # by its definition: the small call, modelled with the host term, costs each rank its measured CPU
    shape = AttnShape(1, 16, 2, 2, 8, 2, dtype="float32", causal=False, layout="contiguous")
    hw = emulated_hardware(recs[0]["cluster"], "float32")
    p = predict_case("burst", shape, mode="fwd_bwd", level="op", hardware=hw, keep_schedule=True,
                     costs=lambda h, dt: EmulatedCosts(h, dt, times=times, host_s=host["host_s_per_op"]))
    busy, ops = host_cost.compute_per_rank(p.schedule)
    assert ops == host["ops"] and busy == pytest.approx(host["measured_s"], rel=1e-9)
    # a compute-bound forward (N=256) pays it on each of its ops: two attention steps and the merge
    assert rows[256]["predicted_s"] - without[256]["predicted_s"] == pytest.approx(3 * host["host_s_per_op"])
    text = validate.host_text(list(rows.values()), call)
    assert "burst" in text and f"{host['host_s_per_op'] * 1e3:.2f} ms x {host['ops']} ops" in text


def _tile_call(zigzag_cpu: float, balanced_cpu: float) -> dict:
    # burst's two causal calls at 16 tokens, zigzag (1 tile a ring step) and balanced (several): cpu_per_call
    # --layouts zigzag,balanced
    row = {"method": "burst", "seqlen": 16, "world_size": 2, "node_size": 1, "heads": 2, "head_dim": 8,
           "dtype": "float32", "causal": True}
    return {"rows": [{**row, "layout": "zigzag", "cpu_s_median": zigzag_cpu},
                     {**row, "layout": "balanced", "cpu_s_median": balanced_cpu}], "path": "call_cpu.json"}


def _small_busy(times, hw, layout: str, **costs) -> float:
    shape = AttnShape(1, 16, 2, 2, 8, 2, dtype="float32", causal=True, layout=layout)
    p = predict_case("burst", shape, mode="fwd_bwd", level="op", hardware=hw, keep_schedule=True,
                     costs=lambda h, dt: EmulatedCosts(h, dt, times=times, **costs))
    return host_cost.compute_per_rank(p.schedule)[0]


def test_the_host_per_kernel_call_makes_the_two_layouts_differ_by_their_measured_cpu():
    """Two calls at the same N and ops, one with more kernel calls (balanced): the term per kernel call makes the
    model's difference between them the measured one at the cap, and the op's term is what is left of zigzag's."""
    recs = [_record(256, 0.6)]
    call = _tile_call(zigzag_cpu=1.0, balanced_cpu=1.3)
    # 10 ms a kernel: the 6 more calls cost the model 60 ms, under the measured 0.3 s / 0.5 CPU
    times = KernelTimes(procs=2, threads=1, seconds={k: (1e-9 if k == HBM else 0.01)
                                                     for k in validate.needed_keys(recs, call)})
    hw = emulated_hardware(recs[0]["cluster"], "float32")
    (row,) = validate.compare(recs, times, rescale=False, call=call)
    tile, host = row["call_host"], row["host"]
    assert tile["calls"] == (4, 10)               # per rank, forward and backward: 2 and 5 tiles (burst_impl.plan)
    h = tile["call_host_s"]
    assert h > 0
    zz, bal = (_small_busy(times, hw, x, call_host_s=h) for x in ("zigzag", "balanced"))
    assert bal - zz == pytest.approx((1.3 - 1.0) / CPUS, rel=1e-9)
    assert _small_busy(times, hw, "zigzag", call_host_s=h, host_s=host["host_s_per_op"]) == \
        pytest.approx(1.0 / CPUS, rel=1e-9)
    assert "host work per kernel call (burst's calls at N=16 on zigzag and balanced" in \
        validate.host_text([row], call)
    # without the balanced call, or with a balanced call no dearer than the model's own kernels: no such term
    zig_only = {**call, "rows": call["rows"][:1]}
    (row,) = validate.compare(recs, _times(recs, zig_only), rescale=False, call=zig_only)
    assert row["call_host"] is None and "per kernel call" not in validate.host_text([row], zig_only)
    cheap = _tile_call(zigzag_cpu=1.0, balanced_cpu=1.0)
    assert validate.compare(recs, times, rescale=False, call=cheap)[0]["call_host"]["call_host_s"] == 0.0


def test_no_host_term_below_the_models_own_compute_without_a_cap_or_a_matching_call():
    recs = [_record(256, 0.6)]
    call = _call(cpu_s=1e-6)                                # less than the model's own kernels there
    (row,) = validate.compare(recs, _times(recs, call), rescale=False, call=call)
    assert row["host"]["host_s_per_op"] == 0.0
    for rec, c in ((_record(256, 0.6, _cluster(cpus=None)), _call(1.0)),      # the run was not capped
                   (recs[0], _call(1.0, world_size=4, node_size=2))):         # another world size
        (row,) = validate.compare([rec], _times([rec], c), rescale=False, call=c)
        assert row["host"] is None
        assert "costs nothing" in validate.host_text([row], c)
    assert "no call_cpu.json" in validate.host_text([row], None)


def test_a_transfers_excess_pays_no_host_term():
    recs = [_record(256, 0.6)]
    call = _call(cpu_s=1.0)
    times = _times(recs, call)
    hw = emulated_hardware(recs[0]["cluster"], "float32")
    shape = AttnShape(1, 256, 2, 2, 8, 2, dtype="float32", causal=False, layout="contiguous")
    p = predict_case("burst", shape, mode="forward", level="op", hardware=hw, keep_schedule=True,
                     costs=lambda h, dt: EmulatedCosts(h, dt, times=times, host_s=0.1, excess={"inter": (0.004, 0.0)}))
    ex = [t for t in p.schedule.tasks if t.name.endswith(".excess")]
    ops = [t for t in p.schedule.tasks if t.kind == "compute" and not t.name.endswith(".excess")]
    assert ex and all(t.duration == pytest.approx(0.004) for t in ex)
    assert ops and all(t.duration >= 0.1 for t in ops)


def test_the_kernel_table_is_timed_under_the_runs_cap(tmp_path, monkeypatch):
    """validate_experiment times the table with the run's cap, and times it afresh when the file's was
    timed under another (an uncapped table holds other rates); measure records what it applied."""
    recs = [_record(256, 0.6)]
    d = tmp_path / "t_emu"
    d.mkdir()
    write_rows(d / "results.jsonl", [{**r, "experiment": "t_emu"} for r in recs])
    keys = validate.needed_keys(recs)
    KernelTimes(procs=2, threads=1, seconds={k: 1.0 for k in keys}, cpus=None).save(d / validate.KERNEL_TIMES_FILE)
    asked = []

    def fake_measure(keys, *, procs, threads, seconds, rounds, cpus, clock):
        asked.append((len(keys), cpus, clock))
        return KernelTimes(procs=procs, threads=threads, seconds={k: ATTN for k in keys}, cpus=cpus, clock=clock)
    monkeypatch.setattr(validate, "measure", fake_measure)
    rep = validate.validate_experiment(tmp_path, "t_emu")
    assert asked == [(len(keys), CPUS, "cpu")] and "capped at 0.5 CPU, as the run's ranks (process CPU" in rep["text"]
    assert KernelTimes.load(d / validate.KERNEL_TIMES_FILE).cpus == CPUS
    validate.validate_experiment(tmp_path, "t_emu")            # now the table is the run's: nothing to time
    assert len(asked) == 1
    # where no cgroup can be made, the processes run uncapped and the table says so
    monkeypatch.setattr(measured.cpuquota, "create", lambda run_id, names, cpus: (None, "no cgroups here"))
    t = measured.measure([HBM], procs=1, threads=1, seconds=0.01, rounds=1, cpus=0.5)
    assert t.cpus is None and t.clock == "wall" and t.seconds[HBM] > 0


def test_cpu_per_call_out_replaces_rows_of_the_same_call(tmp_path):
    path = tmp_path / "call_cpu.json"
    row = {"method": "burst", "seqlen": 64, "world_size": 8, "node_size": 4, "cpu_s_median": 1.0}
    merge(path, [row, {**row, "method": "usp"}])
    merge(path, [{**row, "cpu_s_median": 2.0}])
    rows = json.loads(path.read_text())["rows"]
    assert sorted((r["method"], r["cpu_s_median"]) for r in rows) == [("burst", 2.0), ("usp", 1.0)]
    assert host_cost.load_call_cpu(tmp_path)["rows"] == rows and host_cost.load_call_cpu(tmp_path / "x") is None
    merge(path, [{**row, "layout": "balanced", "cpu_s_median": 3.0}])     # another layout: a row of its own
    assert len(json.loads(path.read_text())["rows"]) == 3


def test_cpu_per_call_keeps_a_decode_rows_batches_apart_and_refuses_unknown_rows(tmp_path, capsys):
    from benchmarks.cpu_per_call import _args

    path = tmp_path / "call_cpu.json"
    row = {"method": "decode:tp", "seqlen": 64, "world_size": 8, "node_size": 4, "batch": 1, "cpu_s_median": 1.0}
    merge(path, [row, {**row, "batch": 4}])
    merge(path, [{**row, "cpu_s_median": 2.0}])
    rows = json.loads(path.read_text())["rows"]
    assert sorted((r["batch"], r["cpu_s_median"]) for r in rows) == [(1, 2.0), (4, 1.0)]
    assert _args(["--methods", "decode:cp_heads,burst", "--batch", "1,4"]).batch == "1,4"
    assert _args(["--layouts", "zigzag,balanced"]).layouts == "zigzag,balanced"
    for argv, words in ((["--methods", "decode:ring"], "decode:<row>"), (["--batch", "0"], "--batch"),
                        (["--layouts", "zigzag,diagonal"], "--layouts")):
        with pytest.raises(SystemExit):
            _args(argv)
        assert words in capsys.readouterr().err


def _probe_agreements() -> int:
    """The benchmark's CPU per call around burst's forward + backward: the agreement all-gathers it ran."""
    import torch

    from baselines import get
    from burst_impl import comm
    from experiments.harness.call_cpu import time_calls

    q, k, v = (torch.randn(1, 8, 2, 8, requires_grad=True) for _ in range(3))
    before = comm.agreement_count()
    time_calls(lambda: None, lambda: get("burst").call(q, k, v, causal=True).sum().backward(), calls=3)
    return comm.agreement_count() - before


def test_cpu_per_call_agrees_once_as_the_harness_times(pools):
    """The host term's probe times calls as the harness times a step: the warm-up agrees on the inputs and the
    timed calls reuse it (before, each of them paid the agreement's all-gather: ~3 ms of CPU a decode call)."""
    assert pools.run(2, _probe_agreements, timeout=120) == [1, 1]


def _step_call(causal_cpu: float, masked_cpu: float) -> dict:
    # burst's causal call at 16 tokens and the same call with host_cost.STEP_MASK (every ring step but a rank's own
    # skipped): burst-bench cluster calls --cases burst:16:zigzag,burst:16:zigzag:window:0:0
    row = {"method": "burst", "seqlen": 16, "world_size": 2, "node_size": 1, "heads": 2, "head_dim": 8,
           "dtype": "float32", "causal": True, "layout": "zigzag"}
    return {"rows": [{**row, "cpu_s_median": causal_cpu},
                     {**row, "mask": host_cost.STEP_MASK, "cpu_s_median": masked_cpu}], "path": "call_cpu.json"}


def test_the_masked_call_splits_the_host_into_per_ring_step_and_per_op():
    """Calls built from a known host per step and per op give those two back, and with them the model costs each of
    the two calls its measured CPU at the cap; a step the mask skips still holds its rank for the host per step."""
    recs = [_record(256, 0.6)]
    probe = _step_call(1.0, 1.0)
    times = KernelTimes(procs=2, threads=1, seconds={k: (1e-9 if k == HBM else 0.01)
                                                     for k in validate.needed_keys(recs, probe)})
    hw = emulated_hardware(recs[0]["cluster"], "float32")
    cases = [host_cost.small_case(probe, "burst", world_size=2, node_size=1, dtype="float32", layout="zigzag",
                                  mask=m) for m in (None, host_cost.STEP_MASK)]
    costs = validate.small_call_costs(times, 1.0, None, None, CPUS)
    (m0, ops0), (m1, ops1) = (host_cost._compute(c, hw, costs) for c in cases)
    steps = host_cost.ring_steps(host_cost._schedule(cases[0], hw, costs, step_host_s=1.0))
    assert ops1 < ops0 and steps == 4                   # two ring steps a pass, forward and backward, on G = 2
    per_op, per_step = 0.05, 0.02
    cpu = [CPUS * (m + steps * per_step + ops * per_op) for m, ops in ((m0, ops0), (m1, ops1))]
    call = _step_call(*cpu)
    (row,) = validate.compare(recs, times, rescale=False, call=call)
    host = row["host"]
    assert host["host_s_per_op"] == pytest.approx(per_op) and host["host_s_per_step"] == pytest.approx(per_step)
    assert host["steps"] == steps and host["mask"] == host_cost.STEP_MASK
    for case, measured_cpu in zip(cases, cpu):
        p = predict_case("burst", case.shape, mode="fwd_bwd", level="op", hardware=hw, keep_schedule=True,
                         costs=lambda h, dt: EmulatedCosts(h, dt, times=times, host_s=per_op, step_host_s=per_step))
        assert host_cost.compute_per_rank(p.schedule)[0] == pytest.approx(measured_cpu / CPUS, rel=1e-9)
        held = [t for t in p.schedule.tasks if t.name.endswith(".host") and t.rank == 0]
        assert len(held) == steps and all(t.duration == per_step for t in held)
    assert "ms x 4 ring steps (with window:0:0" in validate.host_text([row], call)
    # a caller that charges no ring step (the decode validation's stand-in) keeps the host all per op
    alone = host_cost.host_per_op(call, "burst", world_size=2, node_size=1, dtype="float32", hardware=hw,
                                  costs=costs, cpus=CPUS)
    assert "host_s_per_step" not in alone and alone["host_s_per_op"] == pytest.approx((cpu[0] / CPUS - m0) / ops0)
    # without the masked call the host is all per op, as before the split; so too where the two calls split it
    # only with a term below 0 (a masked call cheaper than its ops' share of the causal one): the causal call keeps
    # its measured CPU either way
    for rows in (call["rows"][:1], _step_call(cpu[0], CPUS * (m1 - 0.5))["rows"]):
        (row,) = validate.compare(recs, times, rescale=False, call={**call, "rows": rows})
        assert "host_s_per_step" not in row["host"]
        assert row["host"]["host_s_per_op"] == pytest.approx((cpu[0] / CPUS - m0) / ops0)
