"""The opt-in CFS model of the emulated validation (experiments/perfmodel/emulated/cfs.py): a rank's compute under
its cgroup's quota, as a fluid over the machine's cores. Exact arithmetic on small numbers: each expected end is
worked out by hand below."""
import math

import pytest

from experiments.perfmodel.emulated.cfs import CfsShare, SharedCpu, running
from experiments.perfmodel.emulated.costs import EmulatedCosts
from experiments.perfmodel.simulator import Schedule
from experiments.profiles.hardware import load_hardware

SHARE = CfsShare(cores=2, cap=0.25, period_s=0.1)       # the emulated 2 x 4 on this 2-core machine


def test_without_a_profile_compute_runs_at_the_cap():
    # the first pass: CPU = seconds x cap at the cap's rate, so the quota (cap x period) never binds
    cpu = SharedCpu(SHARE, None)
    assert cpu.finish(0, 0.03, 0.5) == pytest.approx(0.53)
    assert cpu.finish(1, 0.0, 0.0) == 0.0


def test_a_rank_alone_runs_a_whole_core_until_its_quota_is_spent():
    # one rank running: min(1, 2 / 1) = a whole core. 0.1 s at the cap is 0.025 s of CPU: the period's whole quota
    cpu = SharedCpu(SHARE, ([0.0], [1]))
    assert cpu.finish(0, 0.0, 0.1) == pytest.approx(0.025)
    # 0.2 s at the cap (0.05 s CPU): 0.025 s in the first period, then the next period's quota from 0.1 on
    cpu = SharedCpu(SHARE, ([0.0], [1]))
    assert cpu.finish(0, 0.0, 0.2) == pytest.approx(0.125)


def test_the_quota_is_per_rank_and_per_period():
    cpu = SharedCpu(SHARE, ([0.0], [1]))
    assert cpu.finish(0, 0.0, 0.06) == pytest.approx(0.015)     # 0.015 s CPU: 0.010 s of quota left
    assert cpu.finish(0, 0.02, 0.06) == pytest.approx(0.1 + 0.005)   # 0.010 s now, the last 0.005 s after 0.1
    assert cpu.finish(1, 0.02, 0.06) == pytest.approx(0.035)    # another rank's quota is its own


def test_every_rank_running_shares_the_cores_at_the_cap():
    # eight ranks running on two cores: a quarter of a core each, the cap's rate, whatever the quota
    cpu = SharedCpu(SHARE, ([0.0], [8]))
    assert cpu.finish(3, 0.01, 0.3) == pytest.approx(0.31)
    # four running: half a core each, so the quota binds after 0.05 s
    cpu = SharedCpu(SHARE, ([0.0], [4]))
    assert cpu.finish(3, 0.0, 0.2) == pytest.approx(0.1 + 0.05)


def test_running_counts_the_segments():
    times, counts = running([(0.0, 0.2, 0), (0.1, 0.3, 1), (0.2, 0.25, 2)])
    assert times == pytest.approx([0.0, 0.1, 0.2, 0.25, 0.3])
    assert counts == [1, 2, 2, 1, 0]


def test_a_schedule_with_a_cpu_prices_only_compute_streams():
    sch = Schedule(cpu=SharedCpu(SHARE, ([0.0], [1])))
    a = sch.add("work", kind="compute", resource="compute/0", duration=0.2)
    b = sch.add("hop", kind="comm", resource="send.inter/0", duration=0.2, deps=[a])
    assert sch.tasks[a].end == pytest.approx(0.125)
    assert sch.tasks[b].end == pytest.approx(0.325)     # a transfer keeps its duration


def test_passes_and_the_default():
    hw = load_hardware("a800_ib_4x8")
    assert [type(s).__name__ for s in EmulatedCosts(hw, "float32").schedules()] == ["Schedule"]
    built = list(CfsShare(cores=2, cap=0.25, period_s=0.1, passes=2).schedules())
    assert len(built) == 3 and all(s.cpu is not None for s in built)
    assert built[0].cpu.profile is None


def test_the_share_of_a_record():
    cluster = {"cpu_quota": {"applied": True, "cpus_per_rank": 0.25, "period_us": 100000}, "ranks_per_core": 4.0}
    assert CfsShare.of(cluster, 8) == CfsShare(cores=2.0, cap=0.25, period_s=0.1)
    assert CfsShare.of({"cpu_quota": {"applied": False}, "ranks_per_core": 4.0}, 8) is None
    with pytest.raises(ValueError, match="cap=0"):
        CfsShare(cores=2, cap=0, period_s=0.1)
    with pytest.raises(ValueError, match="passes=0"):
        CfsShare(cores=2, cap=0.25, period_s=0.1, passes=0)
    # a record without its period (before cpuquota wrote it) ran at CFS's default
    cluster["cpu_quota"].pop("period_us")
    assert CfsShare.of(cluster, 8).period_s == pytest.approx(0.1)


def test_a_prediction_under_cfs_keeps_its_tasks_and_never_runs_faster_than_a_core():
    from types import SimpleNamespace

    from baselines import AttnShape
    from experiments.perfmodel.emulated.hardware import emulated_hardware
    from experiments.perfmodel.emulated.measured import HBM, KernelTimes, needed
    from experiments.perfmodel.model import predict_case

    cluster = {"emulated": True, "nodes": 2, "ranks_per_node": 2, "profile": "t_emu", "summary": "synthetic 2x2",
               "links": {"intra": {"bytes_per_s": 4e6, "kind": "nvlink", "latency_us": 0.0},
                         "inter": {"bytes_per_s": 1e6, "kind": "roce", "latency_us": 10.0}}}
    shape = AttnShape(batch=1, seqlen=256, heads=4, kv_heads=4, head_dim=8, world_size=4, dtype="float32",
                      causal=True, layout="zigzag")
    hw = emulated_hardware(cluster, "float32")
    case = SimpleNamespace(method="ring", shape=shape, mode="fwd_bwd", level="op")
    times = KernelTimes(procs=4, threads=1, seconds={k: (1e-9 if k == HBM else 0.01)
                                                     for k in needed([case], hw, predict=predict_case)})

    def schedule(cfs):
        return predict_case("ring", shape, mode="fwd_bwd", level="op", hardware=hw, keep_schedule=True,
                            costs=lambda h, dt: EmulatedCosts(h, dt, times=times, cfs=cfs)).schedule

    share = CfsShare(cores=1, cap=0.25, period_s=0.1)
    plain, fluid = schedule(None), schedule(share)
    assert [t.name for t in fluid.tasks] == [t.name for t in plain.tasks]
    for p, f in zip(plain.tasks, fluid.tasks):
        if f.kind == "compute":
            assert f.duration >= p.duration * share.cap - 1e-12      # at most a whole core: CPU <= wall
        else:
            assert f.duration == p.duration
    assert 0 < fluid.makespan < math.inf
