"""The hardware cost model holds only hardware terms; the emulated one (experiments/perfmodel/emulated/costs.py)
adds exactly its host work per op and its transfers' overlap excess on top of it, through the two hooks
the schedules call on every cost model."""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from baselines import AttnShape
from experiments.perfmodel.costs import CostModel
from experiments.perfmodel.emulated.costs import EmulatedCosts
from experiments.perfmodel.emulated.hardware import emulated_hardware
from experiments.perfmodel.emulated.measured import HBM, KernelTimes, needed
from experiments.perfmodel.model import predict_case
from experiments.perfmodel.schedules.common import EXCESS_SUFFIX
from experiments.profiles.hardware import Link, known_hardware, load_hardware, parse_hardware

HOST = 0.003                                        # s per op
EXCESS = {"intra": (0.001, 2e-9), "inter": (0.002, 5e-9)}   # (s, s per byte) per link class


def test_every_hardware_profile_loads_without_host_or_excess_terms():
    assert {f.name for f in dataclasses.fields(CostModel)} == {"hw", "dtype", "memo"}
    assert not [f.name for f in dataclasses.fields(Link) if "excess" in f.name]
    for name in known_hardware():
        hw = load_hardware(name)
        cost = CostModel(hw, next(iter(hw.accelerator.peak_tflops)))
        assert not hasattr(cost, "host_s") and not hasattr(cost, "excess") and not hasattr(hw.intra, "excess_s")
        # the schedules' hooks: an op holds the stream for its work alone, a transfer takes nothing from it
        assert cost.op_seconds(0.25) == 0.25
        assert cost.sender_seconds(1 << 20, True) == 0.0 and cost.sender_seconds(1 << 20, False) == 0.0
    raw = {"name": "x", "nodes": 1, "devices_per_node": 2, "intra": {"kind": "nvlink", "gbits_s": 100,
           "latency_us": 1, "excess_s": 0.001},
           "accelerator": {"name": "a", "peak_tflops": {"bfloat16": 1}, "hbm_gib": 1, "hbm_gbytes_s": 1,
                           "attn_efficiency": [[1, 1.0]]}}
    with pytest.raises(ValueError, match="intra.excess_s.*unknown key"):
        parse_hardware(raw)


def _cluster() -> dict:
    """A record's ``cluster`` block: 2 nodes x 2 ranks, both link classes shaped."""
    return {"emulated": True, "nodes": 2, "ranks_per_node": 2, "profile": "t_emu", "summary": "synthetic 2x2",
            "links": {"intra": {"bytes_per_s": 4e6, "kind": "nvlink", "latency_us": 0.0},
                      "inter": {"bytes_per_s": 1e6, "kind": "roce", "latency_us": 10.0}}}


@pytest.mark.parametrize("method", ["burst", "ulysses", "burst_double_ring"])
def test_the_emulated_model_adds_its_host_and_excess_terms_and_nothing_else(method):
    shape = AttnShape(batch=1, seqlen=256, heads=4, kv_heads=4, head_dim=8, world_size=4, dtype="float32",
                      causal=False, layout="contiguous")
    hw = emulated_hardware(_cluster(), "float32")
    case = SimpleNamespace(method=method, shape=shape, mode="fwd_bwd", level="op")
    keys = needed([case], hw, predict=predict_case)
    times = KernelTimes(procs=4, threads=1, seconds={k: (1e-9 if k == HBM else 0.01) for k in keys})

    def schedule(**terms):
        return predict_case(method, shape, mode="fwd_bwd", level="op", hardware=hw, keep_schedule=True,
                            costs=lambda h, dt: EmulatedCosts(h, dt, times=times, **terms)).schedule

    def named(sch, task) -> list[str]:
        return [sch.tasks[d].name for d in task.deps]

    base, full = schedule(), schedule(host_s=HOST, excess=EXCESS)
    assert not [t for t in base.tasks if t.name.endswith(EXCESS_SUFFIX)]
    same = [t for t in full.tasks if not t.name.endswith(EXCESS_SUFFIX)]
    assert [t.name for t in same] == [t.name for t in base.tasks]
    for b, f in zip(base.tasks, same):
        # an all-to-all's later pieces and its end also wait for the held tasks (the test below)
        deps = [n for n in named(full, f) if not n.endswith(EXCESS_SUFFIX)]
        assert (f.kind, f.resource, f.rank, deps) == (b.kind, b.resource, b.rank, named(base, b))
        assert f.duration == pytest.approx(b.duration + (HOST if b.kind == "compute" else 0.0), abs=1e-15)
    # one excess task per non-empty transfer, on its sender's compute stream: a + k x bytes of its class
    sends = {t.name: t for t in base.tasks if t.kind == "comm" and sum(t.nbytes.values())}
    extra = {t.name[:-len(EXCESS_SUFFIX)]: t for t in full.tasks if t.name.endswith(EXCESS_SUFFIX)}
    assert sends and extra.keys() == sends.keys()
    for name, t in extra.items():
        s = sends[name]
        a, k = EXCESS["intra" if s.resource.startswith("send.intra") else "inter"]
        deps = [n for n in named(full, t) if not n.endswith(EXCESS_SUFFIX)]
        # a ring's isend holds its sender from its own post on (the first of the send's deps, its step), not from
        # the receiver's; a blocking all-to-all's piece from all of the send's deps
        want = named(base, s) if method == "ulysses" else named(base, s)[:1]
        post = base.tasks[s.deps[0]]
        assert method == "ulysses" or (post.kind, post.rank) == ("marker", s.rank)    # the sender's own step
        assert t.kind == "compute" and t.resource == f"compute/{s.rank}" and deps == want, (deps, want)
        assert t.duration == pytest.approx(a + k * sum(s.nbytes.values()))
    assert {s.resource.split("/")[0] for s in sends.values()} == {"send.intra", "send.inter"}
    assert full.makespan > base.makespan


def test_an_all_to_alls_pieces_go_in_posting_order_behind_their_senders_held_work():
    """A rank posts its pieces to r+1, ..., r-1 (burst_impl.collectives._all_to_all_receive_first): on 2 x 2,
    rank 0 sends intra (to 1) then inter (2, 3), rank 1 inter (2, 3) then intra (0). A run's link starts when
    the sender's held work on the runs before it is done; the call ends after every piece and held task."""
    shape = AttnShape(batch=1, seqlen=256, heads=4, kv_heads=4, head_dim=8, world_size=4, dtype="float32",
                      causal=False, layout="contiguous")
    hw = emulated_hardware(_cluster(), "float32")
    case = SimpleNamespace(method="ulysses", shape=shape, mode="forward", level="op")
    times = KernelTimes(procs=4, threads=1, seconds={k: (1e-9 if k == HBM else 0.01)
                                                     for k in needed([case], hw, predict=predict_case)})

    def schedule(**terms):
        sch = predict_case("ulysses", shape, mode="forward", level="op", hardware=hw, keep_schedule=True,
                           costs=lambda h, dt: EmulatedCosts(h, dt, times=times, **terms)).schedule
        return {t.name: t for t in sch.tasks}

    runs = {0: ["intra[r0,p0]", "inter[r0,p1]"], 1: ["inter[r1,p0]", "intra[r1,p2]"],
            2: ["intra[r2,p0]", "inter[r2,p1]"], 3: ["inter[r3,p0]", "intra[r3,p2]"]}
    base, full = schedule(), schedule(excess=EXCESS)
    for rank, (first, second) in runs.items():
        a, b = f"a2a_q.{first}", f"a2a_q.{second}"
        assert base[a].start == base[b].start          # nothing holds the sender: both runs start together
        assert full[b].start == pytest.approx(full[a + EXCESS_SUFFIX].end)   # the second waits for the first's work
        assert full[b + EXCESS_SUFFIX].start == pytest.approx(full[a + EXCESS_SUFFIX].end)
        assert full["a2a_q.done[g0]"].end >= max(full[b].end, full[b + EXCESS_SUFFIX].end)
    assert full["a2a_q.done[g0]"].end > base["a2a_q.done[g0]"].end


@pytest.mark.parametrize("method, two_way", [("burst", False), ("burst_double_ring", True)])
def test_an_inter_node_hop_is_charged_the_probe_case_of_its_own_pattern(method, two_way):
    """A flat ring's edge rank sends across and receives inside its node: the probe's ``oneway`` case. The double
    ring's inter ring on 2 nodes exchanges both ways with one peer: the ``pair`` case. A probe without the
    one-way case (older records) charges every inter hop the pair line."""
    shape = AttnShape(batch=1, seqlen=256, heads=4, kv_heads=4, head_dim=8, world_size=4, dtype="float32",
                      causal=False, layout="contiguous")
    hw = emulated_hardware(_cluster(), "float32")
    case = SimpleNamespace(method=method, shape=shape, mode="forward", level="op")
    times = KernelTimes(procs=4, threads=1, seconds={k: (1e-9 if k == HBM else 0.01)
                                                     for k in needed([case], hw, predict=predict_case)})
    lines = {**EXCESS, "inter_oneway": (0.0, 1e-9)}

    def inter_charges(excess):
        sch = predict_case(method, shape, mode="forward", level="op", hardware=hw, keep_schedule=True,
                           costs=lambda h, dt: EmulatedCosts(h, dt, times=times, excess=excess)).schedule
        sends = {t.name: t for t in sch.tasks if t.kind == "comm" and t.resource.startswith("send.inter")}
        held = {t.name[:-len(EXCESS_SUFFIX)]: t.duration for t in sch.tasks if t.name.endswith(EXCESS_SUFFIX)}
        assert sends and set(sends) <= set(held)
        return [(held[n], sum(t.nbytes.values())) for n, t in sends.items()]

    a, k = lines["inter" if two_way else "inter_oneway"]
    assert all(d == pytest.approx(a + k * b) for d, b in inter_charges(lines))
    a, k = EXCESS["inter"]
    assert all(d == pytest.approx(a + k * b) for d, b in inter_charges(EXCESS))
