"""The double ring (burst_impl.topology) against the fp64 reference, bytes per link class, bad input.

Nodes are emulated with ``node_size=`` on the pool's gloo groups: world 4 =
2 nodes x 2 ranks, world 6 = 2 x 3 (odd inner ring) and 3 x 2. Every case
of one world size runs inside one pool call (a list of configurations), so
the suite pays the pool round trip once per grid.
"""
from __future__ import annotations

import itertools
import os

import pytest
import torch
import torch.distributed as dist

from burst_impl import burst_attn_func, comm, volume
from burst_impl.layout import shard
from burst_impl.nodes import Nodes
from burst_impl.shape import AttnShape
from burst_impl.comm import circulate
from burst_impl.topology import DoubleRing, DoubleRingSchedule
from tests.refs import attention_reference, make_inputs, max_err

B, D, CHUNK = 2, 8, 3       # 3 tokens per layout chunk (odd); zigzag has 2G chunks: N = 2*G*CHUNK
HEADS = {"mha": (4, 4), "gqa": (4, 2)}
# fp32 against fp64, relative to the largest reference value: as tests/test_burst_attention.py
# (N <= 36 keys here, one merge per ring step; worst case ~N*eps = 4e-6, a real mistake ~1e-1).
FP32_RTOL = 2e-5
GRIDS = [(2, 2), (2, 3), (3, 2)]     # (nodes E, ranks per node I)


def _configs(G: int) -> list[dict]:
    out = []
    for causal, layout, heads, backward in itertools.product(
            (False, True), ("contiguous", "zigzag", "striped"), ("mha", "gqa"), ("burst", "ring")):
        if layout == "striped" and not causal:
            continue   # striped only changes causal block masks; non-causal is covered by the others
        out.append(dict(causal=causal, layout=layout, heads=heads, backward=backward, overlap=True))
    # overlap off (serialised) and the auto choice, on a few cases
    out += [dict(causal=True, layout="zigzag", heads="mha", backward="burst", overlap=False),
            dict(causal=True, layout="striped", heads="gqa", backward="ring", overlap=False),
            dict(causal=False, layout="contiguous", heads="gqa", backward="auto", overlap=True)]
    return out


def _run_all(node_size: int, configs: list[dict], topology: str = "double") -> list[dict]:
    rank, G = dist.get_rank(), dist.get_world_size()
    results = []
    for cfg in configs:
        z, zkv = HEADS[cfg["heads"]]
        q, k, v, do = make_inputs(B, 2 * G * CHUNK, z, zkv, D, torch.float32)
        ql, kl, vl = (shard(t, cfg["layout"], rank, G).requires_grad_() for t in (q, k, v))
        with comm.count_bytes() as counts:
            out, lse = burst_attn_func(ql, kl, vl, causal=cfg["causal"], layout=cfg["layout"],
                                       backward=cfg["backward"], return_lse=True, topology=topology,
                                       node_size=node_size, overlap=cfg["overlap"])
            out.backward(shard(do, cfg["layout"], rank, G))
        results.append(dict(out=out.detach(), lse=lse, dq=ql.grad, dk=kl.grad, dv=vl.grad, counts=dict(counts),
                            links=counts.link_dict(), notes=dict(counts.notes)))
    return results


def _check_against_reference(results, configs, G, node_size, topology="double"):
    for i, cfg in enumerate(configs):
        z, zkv = HEADS[cfg["heads"]]
        ref = attention_reference(*make_inputs(B, 2 * G * CHUNK, z, zkv, D, torch.float64), cfg["causal"])
        shape = AttnShape(B, 2 * G * CHUNK, z, zkv, D, G, dtype="float32")
        chosen = results[0][i]["notes"]["burst.backward"]
        assert chosen == (volume.cheaper_backward(shape) if cfg["backward"] == "auto" else cfg["backward"]), cfg
        for rank in range(G):
            res = results[rank][i]
            for name in ("out", "lse", "dq", "dk", "dv"):
                expect = shard(ref[name], cfg["layout"], rank, G, dim=2 if name == "lse" else 1)
                err, tol = max_err(res[name], expect), FP32_RTOL * max(ref[name].abs().max().item(), 1.0)
                assert err <= tol, f"rank {rank} {name}: error {err:.3g} > {tol:.3g} ({cfg}, node_size={node_size})"
            assert res["counts"] == volume.expected_bytes(shape, chosen), (rank, cfg)
            expect = volume.expected_link_bytes(shape, chosen, topology=topology, node_size=node_size, rank=rank)
            assert res["links"] == expect, f"rank {rank} ({cfg}): per link {res['links']} != formula {expect}"
            assert res["notes"]["burst.topology"].startswith("double ring" if topology == "double" else "flat")


@pytest.mark.parametrize("grid", GRIDS, ids=lambda g: f"{g[0]}x{g[1]}")
def test_double_ring_matches_fp64_reference(pools, grid):
    """Forward, burst backward, ring backward and auto; causal and not; MHA and GQA; every layout;
    overlap on and off: out, lse, dq, dk, dv on every rank, bytes per (phase, kind) and per link class."""
    E, I = grid
    G = E * I
    configs = _configs(G)
    results = pools.run(G, _run_all, I, configs, timeout=240)
    _check_against_reference(results, configs, G, I)


# ---------------------------------------------------------------- the schedule, simulated for every rank


def _simulate(E: int, I: int):
    """Run every rank's DoubleRingSchedule by hand: FIFO queues per (side, channel, receiver)."""
    from collections import Counter, defaultdict, deque

    G = E * I
    plans = [DoubleRingSchedule(E, I, r) for r in range(G)]
    queues: dict = defaultdict(deque)
    sends: Counter = Counter()
    held, seen = list(range(G)), [[] for _ in range(G)]
    own, kept = [None] * G, [None] * G

    def send(r, side, ch, payload):
        queues[(side, ch, plans[r].peer(ch, 1))].append(payload)
        sends[(r, side, ch)] += 1

    def gather(r, route, contrib, block):
        acc = set(contrib)
        for ch in route.takes:
            acc |= queues[("write", ch, r)].popleft()
        if route.kept:
            acc |= kept[r]
            kept[r] = None
        assert {b for _, b in acc} == {block}, f"rank {r}: partial sums of other blocks {acc} mixed in"
        return acc

    def dispatch(r, then, acc):
        if then == "keep":
            kept[r] = acc
        else:
            send(r, "write", then, acc)

    for t in range(G):
        for r in range(G):
            for ch in plans[r].bundle_posts(t):
                send(r, "read", ch, held[r])
        for r in range(G):
            assert held[r] == plans[r].owner(t), f"rank {r} step {t}: holds {held[r]}, owner says {plans[r].owner(t)}"
            seen[r].append(held[r])
            route = plans[r].acc_route(t)
            if route.then == "own":
                own[r] = {(r, r)}
            else:
                dispatch(r, route.then, gather(r, route, {(r, held[r])}, held[r]))
        if t < G - 1:
            for r in range(G):
                held[r] = queues[("read", plans[r].bundle_source(t), r)].popleft()
    finish = [plans[r].acc_finish() for r in range(G)]
    for k in range(len(finish[0])):
        for r in range(G):
            route = finish[r][k]
            if route.then == "own":
                own[r] = own[r] | gather(r, route, set(), r)
            else:
                block = plans[r].peer("intra", 1)   # the kept round-0 sum is the next rank's block
                dispatch(r, route.then, gather(r, route, set(), block))
    return plans, seen, own, sends, queues


@pytest.mark.parametrize("grid", GRIDS + [(2, 4), (4, 2), (3, 3), (4, 3)], ids=lambda g: f"{g[0]}x{g[1]}")
def test_schedule_visits_every_block_once_and_brings_every_sum_home(grid):
    """Pure simulation of the double ring's routes: the block a rank receives is the one ``owner``
    names (so causal skipping sees the true source), every rank sees every block once, every
    accumulator reaches its owner with all G contributions and nothing else, and each rank sends
    E(I-1) intra-node and E-1 inter-node blocks per tensor on each side. Larger grids than the pool
    runs: 2x4, 4x2, 3x3, 4x3."""
    E, I = grid
    G = E * I
    plans, seen, own, sends, queues = _simulate(E, I)
    for r in range(G):
        assert sorted(seen[r]) == list(range(G)), f"rank {r} saw {seen[r]}"
        assert own[r] == {(x, r) for x in range(G)}, f"rank {r}: accumulator holds {sorted(own[r])}"
        for side in ("read", "write"):
            assert sends[(r, side, "intra")] == E * (I - 1) and sends[(r, side, "inter")] == E - 1, (r, side, sends)
    assert not any(queues.values()), "a transfer was posted that nobody received"


def test_schedule_2x2_table():
    """The table of the issue's closing note: which block each rank holds per step (2 nodes x 2 ranks).
    Round 0 (steps 0-1) inside the node, round 1 (steps 2-3) the other node's blocks."""
    table = [[DoubleRingSchedule(2, 2, r).owner(t) for t in range(4)] for r in range(4)]
    assert table == [[0, 1, 2, 3], [1, 0, 3, 2], [2, 3, 0, 1], [3, 2, 1, 0]]


# ---------------------------------------------------------------- the transport: overlap and channels


class _Logged:
    """A channel that logs its posts and the waits of its transfers into ``log``."""

    def __init__(self, channel, side, name, log):
        self.channel, self.side, self.name, self.log = channel, side, name, log

    def start(self, tensors, phase, kinds, recv_shapes=None):
        pending = self.channel.start(tensors, phase, kinds, recv_shapes)
        self.log.append(("post", self.side, self.name))
        log, side, name, wait = self.log, self.side, self.name, pending.wait

        def logged_wait():
            if pending._reqs:
                log.append(("wait", side, name))
            return wait()

        pending.wait = logged_wait
        return pending


def _transport_events(topology: str, node_size: int, overlap: bool, subgroups: bool = False):
    """One pass with an accumulator on every rank: the event log, the accumulated totals and the bytes."""
    rank = dist.get_rank()
    nodes = Nodes.of(None, node_size)
    ring = DoubleRing(None, nodes, overlap=overlap, subgroups=subgroups) if topology == "double" else \
        comm.Ring(None, nodes=nodes, overlap=overlap)
    log: list = []
    ring.read = {name: _Logged(ch, "read", name, log) for name, ch in ring.read.items()}
    ring.write = {name: _Logged(ch, "write", name, log) for name, ch in ring.write.items()}
    bundle = [torch.full((3,), float(rank), dtype=torch.float64)]

    def on_block(step, owner, blk):
        log.append(("compute", step))
        assert blk[0][0].item() == owner, f"step {step}: block of {blk[0][0].item()} where owner says {owner}"
        return [torch.full((3,), float((rank + 1) * (owner + 1)), dtype=torch.float64)]

    acc = comm.AccumulatorRing(ring, ("dq",), bundle, torch.float64, torch.float64)
    with comm.count_bytes() as counts:
        (total,) = circulate(ring, bundle, "forward", ("q",), on_block, acc=acc)
    return log, total[0].item(), counts.link_dict()


def _check_overlap(log, overlap: bool, G: int, I: int, topology: str):
    computes = [i for i, e in enumerate(log) if e[0] == "compute"]
    pairs = []   # (index of post, index of its wait) per (side, channel), matched in order
    open_posts: dict = {}
    for i, e in enumerate(log):
        if e[0] == "post":
            open_posts.setdefault(e[1:], []).append(i)
        elif e[0] == "wait":
            pairs.append((e[1:], open_posts[e[1:]].pop(0), i))
    if not overlap:   # every transfer is waited for right after it was posted
        assert all(w == p + 1 for _, p, w in pairs), log
        return
    # overlap: every read transfer is waited for only after at least one computation ran since its post
    for key, p, w in pairs:
        if key[0] == "read":
            ran = sum(1 for c in computes if p < c < w)
            want = I if (topology == "double" and key[1] == "inter") else 1
            assert ran >= want, f"{key} posted at {p}, waited at {w}: {ran} computations in between ({log})"


def test_overlap_is_real_and_sums_come_home(pools):
    """2 nodes x 2 ranks: the inter-node block is posted before the round's first computation and waited
    for after its last (the whole round overlaps it); each intra-node hop overlaps one computation;
    overlap=False waits for every transfer right after posting it. The accumulator totals are exact on
    both topologies, with the NCCL-style channel sub-groups as well as gloo's tags; bytes per link class
    match the formula."""
    G, I = 4, 2
    for topology, overlap, subgroups in [("double", True, False), ("double", False, False), ("double", True, True),
                                         ("flat", True, False), ("flat", False, False)]:
        out = pools.run(G, _transport_events, topology, I, overlap, subgroups)
        for rank, (log, total, links) in enumerate(out):
            assert total == (rank + 1) * G * (G + 1) / 2, (topology, overlap, rank, total)
            _check_overlap(log, overlap, G, I, topology)
            hops = volume.ring_hops(Nodes.uniform(G, I), rank, topology)
            assert links == volume.split_by_link({("forward", "q"): 24 * (G - 1), ("backward", "dq"): 24 * (G - 1)},
                                                 hops), (topology, rank, links)


# ---------------------------------------------------------------- every method: bytes per link class


def _method_cases(G: int, node_size: int) -> list[dict]:
    """Every method we implement that runs here, from the registry: the sequence-parallel ones (timing
    variants included: they wait differently, and their link bytes are their own formula's) on zigzag,
    MHA and GQA alternating, and the layer-level ones on contiguous. Peer adapters are left out: their
    sends happen inside the peer's package, so no counter sees a link (``bytes_by_formula``)."""
    from baselines.registry import methods_with

    z = 6 if G % 3 == 0 else 4
    mha, gqa = (z, z), (z, z // 2)
    ops = methods_with(level="op", layout="zigzag", adapters=False, available=True)
    cases = [dict(method=m, heads=(gqa, mha)[i % 2], layout="zigzag", options={}) for i, m in enumerate(ops)]
    cases += [dict(method=m, heads=mha, layout="contiguous", options={}, layer=True)
              for m in methods_with(level="layer", layout="contiguous", adapters=False, available=True)]
    return [dict(c, node_size=node_size) for c in cases]


def _run_methods(cases: list[dict], env_local: int | None = None) -> list[dict]:
    """Every case on this rank: outputs and gradients, and the counters (``node_size`` passed, or taken
    from LOCAL_WORLD_SIZE=env_local when the case's node_size is None)."""
    from baselines import get
    from baselines.layer import layer_forward, layer_input, make_layer

    rank, G = dist.get_rank(), dist.get_world_size()
    old = os.environ.get("LOCAL_WORLD_SIZE")
    if env_local is not None:
        os.environ["LOCAL_WORLD_SIZE"] = str(env_local)
    try:
        out = []
        for c in cases:
            z, zkv = c["heads"]
            opts = dict(c["options"], **({} if c["node_size"] is None else {"node_size": c["node_size"]}))
            n = 2 * G * CHUNK
            with comm.count_bytes() as counts:
                if c.get("layer"):
                    shape = AttnShape(B, n, z, zkv, D, G, dtype="float32", causal=True, layout=c["layout"])
                    lay = make_layer(c["method"], shape, **opts)
                    x = layer_input(lay, torch.randn(B, n, z * D, generator=torch.Generator().manual_seed(1)))
                    y = layer_forward(lay, x.requires_grad_())
                    y.backward(torch.ones_like(y))
                    res = {}
                else:
                    q, k, v, do = make_inputs(B, n, z, zkv, D, torch.float32)
                    ql, kl, vl = (shard(t, c["layout"], rank, G).requires_grad_() for t in (q, k, v))
                    o = get(c["method"]).call(ql, kl, vl, causal=True, layout=c["layout"], **opts)
                    o.backward(shard(do, c["layout"], rank, G))
                    res = dict(out=o.detach(), dq=ql.grad, dk=kl.grad, dv=vl.grad)
            out.append(dict(res, counts=dict(counts), links=counts.link_dict(), notes=dict(counts.notes)))
        return out
    finally:
        if env_local is not None:
            if old is None:
                del os.environ["LOCAL_WORLD_SIZE"]
            else:
                os.environ["LOCAL_WORLD_SIZE"] = old


def _check_methods(results, cases, G, node_size_for_formula):
    from baselines import get

    for i, c in enumerate(cases):
        z, zkv = c["heads"]
        n = 2 * G * CHUNK
        shape = AttnShape(B, n, z, zkv, D, G, dtype="float32", causal=True, layout=c["layout"])
        method = get(c["method"])
        ref = None if c.get("layer") else attention_reference(*make_inputs(B, n, z, zkv, D, torch.float64), True)
        for rank in range(G):
            res = results[rank][i]
            what = f"{c['method']} rank {rank} ({c})"
            if ref is not None:
                for name in ("out", "dq", "dk", "dv"):
                    err = max_err(res[name], shard(ref[name], c["layout"], rank, G))
                    tol = FP32_RTOL * max(ref[name].abs().max().item(), 1.0)
                    assert err <= tol, f"{what} {name}: error {err:.3g} > {tol:.3g}"
            assert res["counts"] == method.bytes(shape, node_size=node_size_for_formula, **c["options"]), what
            expect = method.links(shape, rank, node_size_for_formula, **c["options"])
            assert res["links"] == expect, f"{what}: per link {res['links']} != formula {expect}"


@pytest.mark.parametrize("grid", GRIDS, ids=lambda g: f"{g[0]}x{g[1]}")
def test_every_method_counts_bytes_per_link_class(pools, grid):
    """burst (flat ring: only the rank at local index I-1 of a node sends inter-node), the double ring,
    ring, ring_rsa (rings and ring all-reduces), ulysses (all-to-all pieces by peer), node-aware usp,
    tp_v1/tp_v3 (ring collectives) and the no-overlap variants: outputs and gradients against fp64 (the
    op-level methods), counted bytes per (phase, kind) and per link class equal the closed forms on
    every rank. 2x2 passes node_size=; 2x3 and 3x2 take the nodes from LOCAL_WORLD_SIZE."""
    E, I = grid
    G = E * I
    cases = _method_cases(G, I if grid == (2, 2) else None)
    results = pools.run(G, _run_methods, cases, None if grid == (2, 2) else I, timeout=240)
    old = os.environ.get("LOCAL_WORLD_SIZE")
    os.environ["LOCAL_WORLD_SIZE"] = str(I)   # the formulas read the same variable as the runtime
    try:
        _check_methods(results, cases, G, I if grid == (2, 2) else None)
    finally:
        if old is None:
            del os.environ["LOCAL_WORLD_SIZE"]
        else:
            os.environ["LOCAL_WORLD_SIZE"] = old
    notes = {c["method"]: results[0][i]["notes"].get("burst.topology", "") for i, c in enumerate(cases)}
    assert notes["burst_double_ring"].startswith("double ring"), notes
    assert notes["burst"].startswith("flat ring"), notes


def _usp_double_and_big_grid() -> list[dict]:
    # about usp's inner double ring and the double-ring methods at 2 x 4, so kept by name
    G = dist.get_world_size()
    cases = [dict(method="usp", heads=(4, 2), layout="zigzag", options={"ulysses_degree": 2}, node_size=4),
             dict(method="usp", heads=(4, 4), layout="contiguous", options={"ulysses_degree": 2, "backward": "ring"},
                  node_size=4),
             dict(method="burst_double_ring", heads=(4, 4), layout="striped", options={}, node_size=4),
             dict(method="burst_double_ring", heads=(4, 2), layout="zigzag", options={}, node_size=4),
             dict(method="burst", heads=(4, 4), layout="zigzag", options={}, node_size=4),
             dict(method="loongtrain_double_ring", heads=(4, 2), layout="zigzag", options={}, node_size=4),
             dict(method="loongtrain_double_ring", heads=(4, 4), layout="striped", options={}, node_size=4)]
    assert G == 8
    return _run_methods(cases) + [cases]


@pytest.mark.slow
def test_2x4_double_ring_inside_usp_and_link_bytes(pools):
    """2 nodes x 4 ranks (world 8): usp with u = 2 < 4 ranks per node runs its ring over 4 ranks, 2 per
    node, as a double ring; burst_double_ring at 2x4; per-link bytes against the formulas (the issue's
    closing-note grid, at a small N)."""
    out = pools.run(8, _usp_double_and_big_grid, timeout=240)
    cases = out[0][-1]
    results = [r[:-1] for r in out]
    _check_methods(results, cases, 8, 4)
    assert results[0][0]["notes"]["burst.topology"].startswith("double ring over 2 nodes x 2 ranks")
    assert results[0][2]["notes"]["burst.topology"].startswith("double ring over 2 nodes x 4 ranks")
    assert results[0][5]["notes"]["burst.topology"].startswith("double ring over 2 nodes x 4 ranks")
    assert results[0][5]["notes"]["burst.backward"] == "ring"


def test_closing_note_bytes_per_link_class():
    """B=1, Z=Z_kv=8, N=8192, d=64, bf16, 2 nodes x 4 ranks, one forward + backward (query-side
    backward, fp32 dQ): the flat ring sends 42.44 MiB per rank, all of it inter-node on local index 3
    and intra-node elsewhere; the double ring sends 36.38 MiB intra-node and 6.06 MiB inter-node on
    every rank (1/7 of it: E-1 = 1 of G-1 = 7 sends)."""
    from baselines.report_bytes import link_table   # what `python -m baselines.report_bytes --links` prints

    s = AttnShape(1, 8192, 8, 8, 64, 8, dtype="bfloat16")
    mib = 2 ** 20
    rows = {(r["method"], r["rank"]): r for r in link_table(["burst", "burst_double_ring"], s, 4)}
    for rank in range(8):
        flat, double = rows[("burst", rank)], rows[("burst_double_ring", rank)]
        want = (0, 42.4375 * mib) if rank % 4 == 3 else (42.4375 * mib, 0)
        assert (flat["intra"], flat["inter"]) == want, (rank, flat)
        assert (double["intra"], double["inter"]) == (36.375 * mib, 6.0625 * mib), (rank, double)


# ---------------------------------------------------------------- fallback, bad input, failure


def _fallbacks() -> list[dict]:
    rank, G = dist.get_rank(), dist.get_world_size()
    out = []
    for node_size in (1, G, None):
        q, k, v, do = make_inputs(B, 2 * G * CHUNK, 4, 2, D, torch.float32)
        ql, kl, vl = (shard(t, "zigzag", rank, G).requires_grad_() for t in (q, k, v))
        with comm.count_bytes() as counts:
            o = burst_attn_func(ql, kl, vl, causal=True, layout="zigzag", topology="double", node_size=node_size)
            o.backward(shard(do, "zigzag", rank, G))
        out.append(dict(out=o.detach(), dq=ql.grad, dk=kl.grad, dv=vl.grad, links=counts.link_dict(),
                        note=counts.notes["burst.topology"], backward=counts.notes["burst.backward"]))
    return out


def test_double_ring_falls_back_to_the_flat_ring(pools):
    """One rank per node (node_size=1), one node (node_size=G) or no node information: topology='double'
    is the flat ring, says so in the counters' notes, and sends what the flat ring sends per link class."""
    G = 4
    results = pools.run(G, _fallbacks)
    ref = attention_reference(*make_inputs(B, 2 * G * CHUNK, 4, 2, D, torch.float64), True)
    shape = AttnShape(B, 2 * G * CHUNK, 4, 2, D, G, dtype="float32")
    for rank in range(G):
        for res, node_size in zip(results[rank], (1, G, None)):
            assert "fell back" in res["note"] and res["note"].startswith("flat ring"), res["note"]
            for name in ("out", "dq", "dk", "dv"):
                tol = FP32_RTOL * max(ref[name].abs().max().item(), 1.0)
                assert max_err(res[name], shard(ref[name], "zigzag", rank, G)) <= tol, (node_size, name)
            expect = volume.expected_link_bytes(shape, res["backward"], topology="flat", node_size=node_size, rank=rank)
            assert res["links"] == expect, (node_size, rank, res["links"])
    assert {link for _, _, link in results[0][0]["links"]} == {"inter"}   # node_size=1: 4 nodes x 1, every hop inter


BAD = [
    ("burst", dict(topology="double", node_size=3), None, "node_size=3 must divide the world size 4"),
    ("burst", dict(topology="double", node_size=0), None, "node_size=0 must be a positive integer"),
    ("burst", dict(topology="double", node_size=True), None, "node_size=True must be a positive integer"),
    ("burst", dict(topology="triple"), None, "topology='triple' is unknown"),
    ("burst", dict(topology="double", overlap="no"), None, "overlap='no' must be True or False"),
    ("burst", dict(topology="double", node_size=2, layout="diagonal"), None, "layout='diagonal' is unknown"),
    ("burst", dict(topology="double"), 3, "split into equal nodes of consecutive ranks"),   # 3 + 1 ranks
    ("ring", dict(node_size=3), None, "node_size=3 must divide"),
    ("ring_rsa", dict(overlap=1), None, "overlap=1 must be True or False"),
    ("ulysses", dict(node_size=5), None, "node_size=5 must divide"),
    ("usp", dict(ulysses_degree=2, ring_topology="ring"), None, "topology='ring' is unknown"),
    ("usp", dict(ulysses_degree=2, node_size=3), None, "node_size=3 must divide"),
    ("usp", dict(ulysses_degree=2, layout="striped"), None, "layout='striped' is not supported by usp"),
]


def _bad_topology_inputs(cases) -> list[str]:
    from baselines import get

    rank, G = dist.get_rank(), dist.get_world_size()
    q, k, v, _ = make_inputs(1, 4 * G, 4, 2, 8, torch.float32)
    msgs = []
    for method, kw, env_local, needle in cases:
        kw = dict(kw)
        layout = kw.pop("layout", "contiguous")
        ql, kl, vl = (shard(t, "contiguous", rank, G) for t in (q, k, v))
        old = os.environ.get("LOCAL_WORLD_SIZE")
        if env_local is not None:
            os.environ["LOCAL_WORLD_SIZE"] = str(env_local)
        try:
            with comm.count_bytes() as counts:
                try:
                    get(method).call(ql, kl, vl, causal=True, layout=layout, **kw)
                    msgs.append("")
                except ValueError as e:
                    msgs.append(str(e))
        finally:
            if old is None:
                os.environ.pop("LOCAL_WORLD_SIZE", None)
            else:
                os.environ["LOCAL_WORLD_SIZE"] = old
        assert counts.total() == 0, f"{method} {kw}: bytes counted before the ValueError: {dict(counts)}"
        t = torch.ones(1)
        dist.all_reduce(t)          # the group still works: no rank is stuck in a half-started transfer
        assert t.item() == G
    return msgs


def test_bad_topology_input_raises_before_any_byte(pools):
    msgs = pools.run(4, _bad_topology_inputs, BAD)
    for rank_msgs in msgs:
        for (method, kw, env, needle), m in zip(BAD, rank_msgs):
            assert needle in m, f"{method} {kw} (LOCAL_WORLD_SIZE={env}): {m!r} lacks {needle!r}"


def test_failure_inside_the_double_ring_leaves_the_group_usable(pools):
    """As tests/test_defects.py for the flat ring: a block raising on rank 1 at any step (both rounds,
    both sides of a round boundary) of the forward, the burst backward or the ring backward; the rank
    raises its own error after the pass, its peers complete, and the group keeps working (a collective
    and a correct double-ring call follow)."""
    from tests.test_defects import _fail_inside_ring

    scenarios = [(phase, i) for phase in ("forward", "burst_backward", "ring_backward") for i in range(4)]
    seen = pools.run(4, _fail_inside_ring, scenarios, timeout=120, topology="double", node_size=2)
    for rank in range(4):
        for (phase, i), what in zip(scenarios, seen[rank]):
            expect = f"injected block failure ({phase}, call {i})" if rank == 1 else "completed"
            assert what == expect, (rank, phase, i, what)
