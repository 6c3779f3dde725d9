"""The cluster performance model (experiments/perfmodel): hand-computed schedules, bytes equal to the
registry's formulas, memory and OOM, the record schema, the CLI, and bad input.

Hand-computed cases run on toy hardware with round numbers (1 TFLOP/s, efficiency 1, no latency,
HBM so fast that elementwise work is ~1e-15 s), so every expected time is a formula written here.
"""
from __future__ import annotations

import json

import pytest

from baselines import METHODS, AttnShape, get
from experiments.profiles.hardware import load_hardware, parse_hardware
from experiments.harness import results as R
from burst_impl.flops import attention_flops
from experiments.harness.spec import load_any
from experiments.perfmodel import predict_case
from experiments.perfmodel.__main__ import main as cli
from experiments.perfmodel.costs import CostModel
from experiments.perfmodel.placement import Placement
from experiments.perfmodel.predict import predict_spec
from experiments.perfmodel.schedules import VARIANTS, schedules
from experiments.perfmodel.schedules.common import EXCESS_SUFFIX, Ctx, ring_collective, ring_pass
from experiments.perfmodel.schedules.double_ring import routed_pass
from experiments.perfmodel.simulator import Schedule

REL = 1e-9   # the toy HBM makes elementwise tasks ~1e-15 s next to ~1e-4 s of compute


def toy(*, nodes=1, per_node=2, intra_bytes_s=1e10, inter_bytes_s=1e8, peak=1.0):
    """Hardware with round numbers: rates in bytes/s (gbits_s = 8 * rate / 1e9), zero latency."""
    link = lambda rate: {"kind": "nvlink", "gbits_s": 8 * rate / 1e9, "latency_us": 0}  # noqa: E731 - one line
    raw = {"name": "toy", "nodes": nodes, "devices_per_node": per_node, "nics_per_node": per_node,
           "accelerator": {"name": "toy", "peak_tflops": {"bfloat16": peak}, "hbm_gib": 80,
                           "hbm_gbytes_s": 1e12, "attn_efficiency": [[1, 1.0]], "gemm_efficiency": 1.0},
           "intra": link(intra_bytes_s)}
    if nodes > 1:
        raw["inter"] = {**link(inter_bytes_s), "kind": "infiniband"}
    return parse_hardware(raw, "toy.yaml")


def shape(G, N, *, Z=1, Zkv=None, d=128, causal=False, layout="contiguous"):
    return AttnShape(batch=1, seqlen=N, heads=Z, kv_heads=Zkv or Z, head_dim=d, world_size=G,
                     dtype="bfloat16", causal=causal, layout=layout)


# one non-causal (1024 x 1024) block pair, Z=1, d=128 at 1 TFLOP/s; one K+V block of bf16
C_FWD = 4 * 1024 * 1024 * 128 / 1e12
KV_HOP = 2 * 1024 * 128 * 2


# ---------------------------------------------------------------- hand-computed schedules


def test_g2_ring_forward_compute_bound_hides_the_transfer():
    p = predict_case("burst", shape(2, 2048), mode="forward", level="op", hardware=toy(intra_bytes_s=1e10))
    assert KV_HOP / 1e10 < C_FWD
    assert p.time_s == pytest.approx(2 * C_FWD, rel=REL)
    assert p.breakdown["critical_comm_s"] == 0.0


def test_g2_ring_forward_comm_bound_waits_for_the_transfer():
    p = predict_case("burst", shape(2, 2048), mode="forward", level="op", hardware=toy(intra_bytes_s=1e8))
    t = KV_HOP / 1e8
    assert t > C_FWD
    assert p.time_s == pytest.approx(t + C_FWD, rel=REL)
    assert p.breakdown["critical_comm_s"] == pytest.approx(t, rel=REL)


@pytest.mark.parametrize("rate", [1e10, 1e8])
def test_g2_burst_backward_query_ring_then_dq_home(rate):
    # step 0: own block while Q, dO, lse, delta travel; step 1: the visiting block, then dQ (fp32) goes home
    p = predict_case("burst", shape(2, 2048), mode="backward", level="op", hardware=toy(intra_bytes_s=rate))
    c = 2.5 * C_FWD
    t_q = (2 * 1024 * 128 * 2 + 2 * 1024 * 4) / rate
    t_dq = 1024 * 128 * 4 / rate
    assert p.time_s == pytest.approx(max(c, t_q) + c + t_dq, rel=REL)


def test_2x2_flat_ring_runs_at_the_inter_node_hop():
    # G=4 on 2 nodes x 2: hops 1->2 and 3->0 cross nodes; every rank sends or receives one of them
    hw = toy(nodes=2, per_node=2, intra_bytes_s=1e10, inter_bytes_s=1e8)
    p = predict_case("burst", shape(4, 4096), mode="forward", level="op", hardware=hw)
    t_inter = KV_HOP / 1e8
    assert KV_HOP / 1e10 < C_FWD < t_inter
    assert p.time_s == pytest.approx(3 * t_inter + C_FWD, rel=REL)


def test_slow_hop_paces_ranks_whose_own_hops_are_fast():
    # 2 nodes x 3: rank 1 only talks intra-node, yet the synchronous ring drags it to the inter hop's pace
    hw = toy(nodes=2, per_node=3, intra_bytes_s=1e10, inter_bytes_s=1e8)
    p = predict_case("burst", shape(6, 6144), mode="forward", level="op", hardware=hw, keep_schedule=True)
    t_inter = KV_HOP / 1e8
    assert p.time_s == pytest.approx(5 * t_inter + C_FWD, rel=REL)
    ends = [max(t.end for t in p.schedule.tasks if t.rank == g) for g in range(6)]
    assert min(ends) > 4 * t_inter


def test_2x2_double_ring_waits_for_the_inter_node_hop_once_per_round():
    # round 0: the inter hop of the next round's block (posted at step 0) overlaps steps 0 and 1;
    # round 1 starts when it lands. Flat ring: 3 t_inter + C (test above). overlap=False serialises.
    hw = toy(nodes=2, per_node=2, intra_bytes_s=1e10, inter_bytes_s=1e8)
    t_inter, t_intra = KV_HOP / 1e8, KV_HOP / 1e10
    assert t_intra < C_FWD and 2 * C_FWD < t_inter
    for method, want in [("burst_double_ring", t_inter + 2 * C_FWD),
                         ("burst_double_ring_no_overlap", t_inter + t_intra + 4 * C_FWD),
                         ("burst_no_overlap", 3 * (t_inter + C_FWD) + C_FWD)]:
        p = predict_case(method, shape(4, 4096), mode="forward", level="op", hardware=hw)
        assert p.time_s == pytest.approx(want, rel=REL), method


def test_2x2_double_ring_backward_dq_crosses_at_the_round_boundary_and_comes_home():
    # Q, dO, lse, delta: the inter hop lands at t_b (> 2 c); round 1's chain sends dQ intra after step 2,
    # inter after step 3; the last inter hop meets the kept round-0 sum, one intra hop home.
    hw = toy(nodes=2, per_node=2, intra_bytes_s=1e10, inter_bytes_s=1e8)
    c = 2.5 * C_FWD
    t_b = (2 * 1024 * 128 * 2 + 2 * 1024 * 4) / 1e8
    t_dq_inter, t_dq_intra = 1024 * 128 * 4 / 1e8, 1024 * 128 * 4 / 1e10
    p = predict_case("burst_double_ring", shape(4, 4096), mode="backward", level="op", hardware=hw)
    assert t_b > 2 * c
    assert p.time_s == pytest.approx(t_b + 2 * c + t_dq_inter + t_dq_intra, rel=REL)


@pytest.mark.parametrize("grid", [(2, 2), (2, 4), (4, 2)])
def test_double_ring_sends_per_link_class_as_the_registry_says(grid):
    E, I = grid
    hw = toy(nodes=E, per_node=I)
    s = shape(E * I, 1024 * E * I, Z=2, causal=True, layout="zigzag")
    for method in ("burst", "burst_double_ring"):
        p = predict_case(method, s, mode="fwd_bwd", level="op", hardware=hw, keep_schedule=True)
        for g in range(E * I):
            sent = {"intra": 0, "inter": 0}
            for t in p.schedule.tasks:
                if t.kind == "comm" and t.rank == g:
                    sent[t.resource.split("/")[0].removeprefix("send.")] += sum(t.nbytes.values())
            want = {"intra": 0, "inter": 0}
            for (_, _, link), b in get(method).links(s, g, I).items():
                want[link] += b
            assert sent == want, (method, g)


def test_all_reduce_is_2g_minus_2_steps_of_one_gth():
    hw = toy(per_node=4, intra_bytes_s=1e9)
    s = shape(4, 4096)
    n = 8_000_000
    ctx = Ctx(sch=Schedule(), cost=CostModel(hw), place=Placement.of(hw, 4), shape=s, mode="forward",
              level="layer", table={})
    end = ring_collective(ctx, [0, 1, 2, 3], phase="forward", name="ar", nbytes={("forward", "x"): 2 * n * 3 // 4},
                          steps=6, ready={})
    assert ctx.sch.end(end.values()) == pytest.approx(6 * (n / 4) / 1e9, rel=REL)
    assert ctx.sch.bytes_sent()[0] == {("forward", "x"): 2 * n * 3 // 4}


class _HeldCost(CostModel):
    """A cost model whose every transfer holds its sender 0.5 s (as the emulated cluster's excess does)."""

    def sender_seconds(self, nbytes, same_node, messages=1, two_way=True, beside=None):
        return 0.5


def test_a_ring_senders_held_time_does_not_wait_for_its_receiver():
    """A ring rank posts its isend and computes (burst_impl.comm: post, compute, wait): the CPU its transfer takes
    (the held task) starts at its post, not when the slower receiver posts its receive; the transfer itself, and
    with it the sender's next step, still waits for the receiver (gloo sends on rendezvous)."""
    hw = toy(per_node=4)
    ctx = Ctx(sch=Schedule(), cost=_HeldCost(hw), place=Placement.of(hw, 3), shape=shape(3, 4096), mode="forward",
              level="layer", table={})
    slow = {(1, 0): 10.0}          # ring index 1 (rank 0's receiver) is slow at step 0: it reaches step 1 at 10.5 s

    def work(i, owner, s):
        return [("w", slow.get((i, s), 1.0), 0.0)]

    ring_pass(ctx, [[0, 1, 2]], phase="forward", name="p", hop={("forward", "kv"): 1000}, work=work, ready={})
    t = {x.name: x for x in ctx.sch.tasks}
    assert t["p.step[r1,s1]"].start > 10
    # rank 0 posts its step-1 send at 1.5 s and computes on: two steps of 1 s, each after its post's 0.5 s
    assert t["p.w[r0,s1]"].end == pytest.approx(2 * (1.0 + 0.5), rel=REL)
    # ...but its send at step 1 lands only once rank 1 posts its receive at step 1, so rank 0's step 2 waits for it
    assert t["p.send[r0,s1]"].start == pytest.approx(t["p.step[r1,s1]"].start, rel=REL)
    assert t["p.step[r0,s2]"].start >= t["p.send[r0,s1]"].end


class _ReleasedCost(CostModel):
    """A CPU rank's gloo send: the wait on a ring's send returns ``share`` of the way through its transfer from the
    rendezvous (0: the bytes fit the socket buffers), not when it lands (``emulated.send_buffer``)."""

    def __init__(self, hw, share):
        super().__init__(hw)
        object.__setattr__(self, "share", share)

    def sender_release(self, nbytes, seconds, same_node):
        return self.share * seconds


@pytest.mark.parametrize("share", [None, 0.0, 0.5])
def test_a_ring_sender_goes_on_when_its_send_releases_it_and_its_receiver_when_it_lands(share):
    """Ring [0, 1, 2, 3] over 2 nodes: rank 1's hop to rank 2 crosses them (1 s), every other hop 1 ms. A sender
    waits on its own send at the end of its step: on the hardware model (None) until the bytes land; where the cost
    model releases it earlier, from the rendezvous plus that hold. Its receiver waits for the bytes either way."""
    hw = toy(nodes=2, per_node=2, intra_bytes_s=1e6, inter_bytes_s=1e3)
    cost = CostModel(hw) if share is None else _ReleasedCost(hw, share)
    ctx = Ctx(sch=Schedule(), cost=cost, place=Placement.of(hw, 4), shape=shape(4, 4096), mode="forward",
              level="layer", table={})
    ring_pass(ctx, [[0, 1, 2, 3]], phase="forward", name="p", hop={("forward", "kv"): 3000},
              work=lambda i, owner, s: [("w", 0.1, 0.0)], ready={})
    t = {x.name: x for x in ctx.sch.tasks}
    cross = t["p.send[r1,s0]"]
    assert cross.duration == pytest.approx(1.0, rel=REL) and cross.start == pytest.approx(0.0, abs=1e-9)
    assert t["p.step[r2,s1]"].start >= cross.end                      # the receiver waits for the bytes
    if share is None:
        assert t["p.step[r1,s1]"].start >= cross.end
        assert "p.send[r1,s0].released" not in t
    else:
        # rank 1 waits for its step's work (0.1 s), its incoming 1 ms hop and its own send's hold from the rendezvous
        assert t["p.step[r1,s1]"].start == pytest.approx(max(0.1, share * 1.0), rel=1e-6)
    # the bytes on the link are the formula's either way
    assert ctx.sch.bytes_sent()[1] == {("forward", "kv"): 3000}


class _BesideCost(CostModel):
    """Holds a transfer's sender 0.1 x the compute it runs beside, and notes what it was told (name, beside)."""

    def __init__(self, hw):
        super().__init__(hw)
        object.__setattr__(self, "seen", [])

    def sender_seconds(self, nbytes, same_node, messages=1, two_way=True, beside=None):
        self.seen.append(beside)
        return 0.1 * (beside or 0.0)


def test_a_ring_hop_is_told_the_work_it_runs_beside():
    """A hop posted at step s runs beside step s's work; an accumulator posted after step s's compute beside step
    s + 1's, the last one beside nothing (the overlap probe's excess grows with that compute: EmulatedCosts)."""
    hw = toy(per_node=4)
    ctx = Ctx(sch=Schedule(), cost=_BesideCost(hw), place=Placement.of(hw, 3), shape=shape(3, 4096),
              mode="forward", level="layer", table={})

    def work(i, owner, s):
        return [("w", 1.0 + s, 0.0), ("m", 0.5, 0.0)]          # step s: 1.5 + s s of work on every rank

    ring_pass(ctx, [[0, 1, 2]], phase="forward", name="p", hop={("forward", "kv"): 1000}, work=work, ready={},
              acc={("forward", "acc"): 1000})
    # step 0's hops; step 1's hops, then its accumulators (beside step 2); step 2's accumulators (beside nothing)
    assert ctx.cost.seen == [1.5] * 3 + [2.5] * 3 + [3.5] * 3 + [0.0] * 3
    t = {x.name: x for x in ctx.sch.tasks}
    assert t[f"p.send[r0,s1]{EXCESS_SUFFIX}"].duration == pytest.approx(0.25)
    assert t[f"p.acc[r0,s1]{EXCESS_SUFFIX}"].duration == pytest.approx(0.35)
    # without overlap a step computes only once its transfers have landed: they run beside nothing
    ctx = Ctx(sch=Schedule(), cost=_BesideCost(hw), place=Placement.of(hw, 3), shape=shape(3, 4096),
              mode="forward", level="layer", table={})
    ring_pass(ctx, [[0, 1, 2]], phase="forward", name="p", hop={("forward", "kv"): 1000}, work=work, ready={},
              acc={("forward", "acc"): 1000}, overlap=False)
    assert ctx.cost.seen == [0.0] * 12
    # the double ring (2 nodes x 2): every bundle posted at step s runs beside step s's work, every accumulator
    # beside the next step's or (finishing) nothing; without overlap all beside nothing
    for overlap in (True, False):
        hw2 = toy(nodes=2, per_node=2)
        ctx = Ctx(sch=Schedule(), cost=_BesideCost(hw2), place=Placement.of(hw2, 4), shape=shape(4, 4096),
                  mode="forward", level="layer", table={})
        routed_pass(ctx, [[0, 1, 2, 3]], (2, 2), phase="forward", name="d", hop={("forward", "kv"): 3000},
                    work=work, ready={}, acc={("forward", "acc"): 3000}, overlap=overlap)
        seen = set(ctx.cost.seen)
        if overlap:     # step 0's bundles beside 1.5 s ... step 3's beside 4.5 s; finishing accumulators beside 0
            assert {1.5, 4.5} <= seen <= {1.5, 2.5, 3.5, 4.5, 0.0}
        else:
            assert seen == {0.0}


def test_inter_node_rate_is_shared_by_the_ranks_crossing_at_once():
    hw = parse_hardware({"name": "x", "nodes": 2, "devices_per_node": 8, "nics_per_node": 4,
                         "accelerator": {"name": "a", "peak_tflops": {"bfloat16": 1}, "hbm_gib": 1,
                                         "hbm_gbytes_s": 1, "attn_efficiency": [[1, 1.0]]},
                         "intra": {"kind": "nvlink", "gbits_s": 1600, "latency_us": 0},
                         "inter": {"kind": "infiniband", "gbits_s": 200, "latency_us": 0, "shared_by": 2}})
    cost = CostModel(hw)
    nic = 200e9 / 8
    assert cost.rate(False, 1) == nic                      # a flat ring: one rank per node crosses
    assert cost.rate(False, 8) == nic / 2 == hw.inter.bytes_per_s   # everyone crosses: the profile's share


def _nic_hw(per_node: int, nics: int, share: float = 2.5e7):
    """2 nodes of ``per_node`` ranks behind ``nics`` NICs, each rank's share ``share`` bytes/s (a NIC: q shares)."""
    q = per_node // nics
    return parse_hardware({"name": "nic", "nodes": 2, "devices_per_node": per_node, "nics_per_node": nics,
                           "accelerator": {"name": "a", "peak_tflops": {"bfloat16": 1.0}, "hbm_gib": 80,
                                           "hbm_gbytes_s": 1e12, "attn_efficiency": [[1, 1.0]]},
                           "intra": {"kind": "nvlink", "gbits_s": 80, "latency_us": 0},
                           "inter": {"kind": "infiniband", "gbits_s": 8 * share * q / 1e9, "latency_us": 0,
                                     "shared_by": q}}, "nic.yaml")


@pytest.mark.parametrize("k", [1, 2, 4])
def test_nic_rule_a_lone_flow_gets_the_nic_k_concurrent_flows_one_kth(k):
    cost = CostModel(_nic_hw(per_node=4, nics=1))
    assert cost.rate(False, k) == pytest.approx(1e8 / k)
    assert cost.transfer(1e6, False, k) == pytest.approx(1e6 / (1e8 / k))
    assert cost.rate(True, k) == pytest.approx(1e10)                    # intra-node: per rank, never shared


def test_crossing_counts_flows_per_nic():
    """Which NIC a rank crosses on is the profile's map (consecutive local ranks share one)."""
    place = Placement.of(_nic_hw(per_node=4, nics=2), 8)
    assert [place.nic(g) for g in range(8)] == [(0, 0), (0, 0), (0, 1), (0, 1), (1, 0), (1, 0), (1, 1), (1, 1)]
    flat = [(g, (g + 1) % 8) for g in range(8)]                             # only local rank 3 crosses
    assert place.crossing(flat) == {(0, 1): 1, (1, 1): 1}
    double = [(g, (g + 4) % 8) for g in range(8)]                           # every rank crosses
    assert place.crossing(double) == {(0, 0): 2, (0, 1): 2, (1, 0): 2, (1, 1): 2}
    assert place.crossing([(0, 4), (1, 5)]) == {(0, 0): 2}                 # both on NIC 0: they split it
    assert place.crossing([(0, 4), (2, 6)]) == {(0, 0): 1, (0, 1): 1}      # one per NIC: each gets a NIC


def test_flat_ring_crossing_hop_is_faster_on_a_shared_nic_double_ring_is_not():
    """Same per-rank share (every rank crossing), different wiring: the flat ring's lone crossing hop gets the
    whole shared NIC (2 shares), so its pass runs at up to twice the rate; the double ring, whose ranks all
    cross at once, sees the per-rank share either way."""
    s = shape(8, 8 * 1024, Z=8, d=64, causal=True, layout="zigzag")
    per_rank, shared = _nic_hw(per_node=4, nics=4, share=5e7), _nic_hw(per_node=4, nics=2, share=5e7)
    assert per_rank.inter.bytes_per_s == pytest.approx(shared.inter.bytes_per_s)       # same share
    assert shared.inter.nic_bytes_per_s == pytest.approx(2 * per_rank.inter.nic_bytes_per_s)
    t = {(m, hw.nics): predict_case(m, s, mode="forward", level="op", hardware=hw).time_s
         for m in ("burst", "burst_double_ring") for hw in (per_rank, shared)}
    assert t["burst", 2] < t["burst", 4]
    assert t["burst_double_ring", 2] == pytest.approx(t["burst_double_ring", 4], rel=1e-9)


# ---------------------------------------------------------------- sources of truth


def test_every_registered_method_has_a_schedule():
    assert set(METHODS) <= set(schedules())


SHAPES = [
    shape(4, 8192, Z=8, d=64, causal=True, layout="zigzag"),
    shape(4, 8192, Z=8, d=64, causal=True, layout="contiguous"),
    shape(3, 6144, Z=6, Zkv=3, d=64, causal=True, layout="striped"),
    shape(8, 16384, Z=8, Zkv=2, d=64, causal=True, layout="zigzag"),
    shape(16, 65536, Z=32, Zkv=8, d=128, causal=True, layout="zigzag"),    # two A800 nodes
    shape(1, 4096, Z=8, d=64, causal=True),
]


@pytest.mark.parametrize("s", SHAPES, ids=lambda s: f"G{s.world_size}-Z{s.heads}kv{s.kv_heads}-{s.layout}")
def test_predicted_bytes_equal_the_registry_formulas(s):
    checked = 0
    for name in list(schedules()) + list(VARIANTS):
        base = VARIANTS[name][0] if name in VARIANTS else name
        try:
            get(base).validate(s)
        except ValueError:
            continue
        level = "layer" if get(base).level == "layer" else "op"
        for mode in ("forward", "fwd_bwd"):
            p = predict_case(name, s, mode=mode, level=level, hardware="a800_ib_4x8")
            phases = ("forward",) if mode == "forward" else ("forward", "backward")
            want = {k: v for k, v in get(base).bytes(s).items() if k[0] in phases and v}
            for g in range(s.world_size):
                assert p.bytes_per_rank.get(g, {}) == want, (name, mode, g)
        checked += 1
    assert checked >= 5


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_attention_flops_over_ranks_equal_the_suite_formula(layout):
    s = shape(4, 8192, Z=4, d=64, causal=True, layout=layout)
    for mode in ("forward", "backward"):
        p = predict_case("burst", s, mode=mode, level="op", hardware=toy(per_node=4), keep_schedule=True)
        work = sum(t.flops for t in p.schedule.tasks if t.kind == "compute")
        assert work == pytest.approx(attention_flops(s, mode=mode), rel=1e-12)


def test_burst_picks_the_registry_backward():
    mha = predict_case("burst", shape(4, 8192, Z=8, d=64), mode="backward", level="op", hardware="a800_ib_4x8")
    gqa = predict_case("burst", shape(4, 8192, Z=8, Zkv=2, d=64), mode="backward", level="op",
                       hardware="a800_ib_4x8")
    assert ("backward", "q") in mha.bytes_per_rank[0] and ("backward", "k") in gqa.bytes_per_rank[0]


# ---------------------------------------------------------------- memory


def test_ring_rsa_runs_out_of_memory_where_burst_fits():
    s = shape(32, 1 << 20, Z=40, causal=True, layout="zigzag")
    rsa = predict_case("ring_rsa", s, mode="fwd_bwd", level="op", hardware="a800_ib_4x8")
    burst = predict_case("burst", s, mode="fwd_bwd", level="op", hardware="a800_ib_4x8")
    # the device's usable memory (experiments/perfmodel/usable_memory.py): 79.33 GiB reported, less the
    # CUDA context and NCCL's buffers
    assert rsa.status == "oom" and "exceeds the 79.0 GiB usable on NVIDIA A800 80GB SXM" in rsa.reason
    assert burst.status == "ok" and burst.memory["total_bytes"] < 80 * 2**30
    # the probabilities (B, Z, N/G, N) dominate ring_rsa's memory model
    assert rsa.memory["kept_bytes"] >= 40 * (1 << 15) * (1 << 20) * 2


def test_tp_without_flash_materialises_its_scores():
    s = shape(8, 1 << 17, Z=32, causal=True, layout="zigzag")
    flash = predict_case("tp_v3", s, mode="forward", level="layer", hardware="a100_pcie_8")
    noflash = predict_case("tp_v3_noflash", s, mode="forward", level="layer", hardware="a100_pcie_8")
    scores = 2 * 4 * (1 << 17) ** 2 * 2          # scores + probabilities, 4 heads per rank, bf16
    assert noflash.memory["total_bytes"] - flash.memory["total_bytes"] == scores
    assert flash.status == "ok" and noflash.status == "oom"


# ---------------------------------------------------------------- records, CLI, bad input


def test_records_follow_the_results_schema():
    spec = load_any("table2_prefill_7b_8gpu").specs[0]
    exp, recs, extra = predict_spec(spec)
    assert exp == spec.name and len(recs) == len(spec.cases())
    for r in recs + extra:
        assert not [k for k in R.REQUIRED_KEYS if k not in r]
        # the spec's cluster a100_8_p2p_off is made of the sourced profile
        assert r["source"] == "modelled" and r["hardware_profile"] == "a100_pcie_8_sourced"
        assert r["status"] in R.STATUSES and r["time_samples_s"] == []
        assert "MODELLED" in r["hardware"]["summary"]
        json.dumps(r, default=str)
    ok = [r for r in recs if r["status"] == "ok"]
    assert ok and all(r["time_median_s"] > 0 and r["comm_fwd_bytes"] == r["comm_fwd_formula_bytes"] for r in ok)
    assert {r["variant_of"] for r in extra} == {"burst", "tp_v1", "tp_v3"}


def test_cli_writes_records_figures_and_tables(tmp_path):
    assert cli(["fig4a_scaling_13b_64k", "--results", str(tmp_path / "r"), "--plots", str(tmp_path / "p")]) == 0
    exp = tmp_path / "r" / "fig4a_scaling_13b_64k"
    recs = R.read_records(exp / R.RESULTS_FILE)
    assert recs and all(r["source"] == "modelled" for r in recs)
    figs = sorted(p.name for p in (tmp_path / "p" / "fig4a_scaling_13b_64k").iterdir())
    assert "table_modelled.md" in figs and "scaling_world_size_modelled.png" in figs
    assert all("modelled" in f for f in figs)
    table = (tmp_path / "p" / "fig4a_scaling_13b_64k" / "table_modelled.md").read_text()
    assert "MODELLED" in table and "a100_pcie_8" in table and "## Assumptions" in table


def test_cli_other_hardware_gets_its_own_experiment(tmp_path):
    cli(["fig4b_batch_7b_4k", "--hardware", "h200_sxm_ib_4x8", "--no-plots", "--results", str(tmp_path / "r"),
         "--plots", str(tmp_path / "p")])
    recs = R.read_records(tmp_path / "r" / "fig4b_batch_7b_4k__h200_sxm_ib_4x8" / R.RESULTS_FILE)
    assert recs and {r["hardware_profile"] for r in recs} == {"h200_sxm_ib_4x8"}


@pytest.mark.parametrize("kw,match", [
    (dict(hardware="nope"), r"hardware='nope': no such hardware profile"),
    (dict(hardware="a100_pcie_8", s=shape(16, 16384)), r"world_size=16 must be between 1 and the 8 devices"),
    (dict(method="flash_magic"), r"method='flash_magic' has no performance-model schedule"),
    (dict(mode="sideways"), r"mode='sideways' is unknown"),
    (dict(level="op", method="tp_v1", s=shape(4, 4096, Z=8)), r"level='op'.*attention layer"),
    (dict(s=shape(4, 1004, layout="zigzag")), r"seqlen=1004 must be a multiple of 8 .* for the performance model"),
    (dict(s=shape(3, 3072, Z=4), method="ulysses"), r"heads=4 must be divisible by the Ulysses degree 3"),
])
def test_bad_input_names_parameter_value_and_rule(kw, match):
    args = dict(method="burst", s=shape(4, 4096), mode="forward", level="op", hardware="a800_ib_4x8") | kw
    with pytest.raises(ValueError, match=match):
        predict_case(args["method"], args["s"], mode=args["mode"], level=args["level"], hardware=args["hardware"])


# ---------------------------------------------------------------- the sourced PCIe server's terms (issue 35)


def test_a_collective_pays_its_base_latency_once_where_the_profile_splits_it():
    """NCCL's tuning model: base + hop latency on a collective's first step, the hop alone on each later one;
    a profile without step_latency_us charges every step its latency_us, as before."""
    n = 8_000_000

    def all_reduce(step_latency):
        raw = {"name": "toy", "nodes": 1, "devices_per_node": 4,
               "accelerator": {"name": "toy", "peak_tflops": {"bfloat16": 1.0}, "hbm_gib": 80,
                               "hbm_gbytes_s": 1e12, "attn_efficiency": [[1, 1.0]], "gemm_efficiency": 1.0},
               "intra": {"kind": "pcie", "gbits_s": 8.0, "latency_us": 14.1, "step_latency_us": step_latency}}
        hw = parse_hardware(raw, "toy.yaml")
        ctx = Ctx(sch=Schedule(), cost=CostModel(hw), place=Placement.of(hw, 4), shape=shape(4, 4096),
                  mode="forward", level="layer", table={})
        end = ring_collective(ctx, [0, 1, 2, 3], phase="forward", name="ar", steps=6, ready={},
                              nbytes={("forward", "x"): 2 * n * 3 // 4})
        return ctx.sch.end(end.values())

    wire = 6 * (n / 4) / 1e9
    assert all_reduce(5.7) == pytest.approx(wire + (14.1 + 5 * 5.7) * 1e-6, rel=REL)
    assert all_reduce(None) == pytest.approx(wire + 6 * 14.1e-6, rel=REL)


def test_few_head_flash_kernels_pay_their_last_wave():
    """A TP rank's Z/8 = 4 heads at 4K tokens: 4 x 32 blocks of 128 rows on 108 SMs, one each: 2 waves for
    1.19 waves of work (the sourced profile's grid); 32 heads fill 9.5 of 10 waves; no grid, no factor."""
    sourced, plain = CostModel(load_hardware("a100_pcie_8_sourced")), CostModel(load_hardware("a100_pcie_8"))
    assert sourced.wave_efficiency(1, 4, 4096) == pytest.approx(128 / 108 / 2)
    assert sourced.wave_efficiency(1, 32, 4096) == pytest.approx(1024 / 108 / 10)
    assert plain.wave_efficiency(1, 4, 4096) == 1.0
    t4, f4 = sourced.attention(1, 4, 128, 4096, 4096, True, "forward")
    assert t4 == pytest.approx(f4 / (312e12 * 0.48 * 128 / 108 / 2))


def test_tp_v3_runs_its_norms_on_its_own_tokens_and_v1_on_all():
    """Same bytes, same GEMMs: at one rate V3's MLP block differs from V1's by the norms and residual adds it
    runs on N/G tokens instead of N (two norms read + write (T, H), two adds read 2 write 1)."""
    from experiments.perfmodel.model_level import mlp_schedule
    from burst_impl.model.config import get_config
    hw, cfg, s = load_hardware("a100_pcie_8_sourced"), get_config("llama2_7b"), shape(8, 4096, Z=32)
    cost, place = CostModel(hw), Placement.of(hw, 8)
    v1, v3 = (mlp_schedule(m, cfg, s, cost, place, "forward")[0].makespan for m in ("tp_v1", "tp_v3"))
    saved = cost.hbm((2 * 2 + 2 * 3) * (4096 - 4096 // 8) * cfg.hidden * 2)
    # V3's two collectives pay one more base latency than V1's one all-reduce
    assert v1 - v3 == pytest.approx(saved - (14.1 - 5.7) * 1e-6, rel=1e-6)


@pytest.mark.parametrize("method,rows", [("tp_v1", 4096), ("tp_v3", 512), ("burst", 512)])
def test_the_prefill_head_as_the_authors_timed_it(method, rows):
    from experiments.perfmodel.model_level import predict_model, prefill_head_rows
    s = shape(8, 4096, Z=32, causal=True, layout="zigzag")
    assert prefill_head_rows(method, s, "last") == 1 and prefill_head_rows(method, s, "local") == rows
    hw = load_hardware("a100_pcie_8_sourced")
    local = predict_model(method, "llama2_7b", s, mode="forward", hardware=hw, head="local")
    assert local.parts["head"] == pytest.approx(CostModel(hw).gemm(rows, 32000, 4096)[0])
    with pytest.raises(ValueError, match=r"head='all': the prefill LM head runs on \('last', 'local'\)"):
        predict_model(method, "llama2_7b", s, mode="forward", hardware=hw, head="all")
