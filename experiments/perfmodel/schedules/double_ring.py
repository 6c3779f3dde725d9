"""The double ring's pass (burst_impl/topology.py, docs/papers.md §2, §4) as a schedule, and the choice of pass.

The routes are the runtime's own: ``burst_impl.topology.DoubleRingSchedule``
(which block a rank holds at each step, on which channel the held block is
sent, which channel brings the next one, where each accumulator goes). A
pass of ring index i of E nodes x I ranks:

* step s posts the read sends the schedule names (the inter-node hop at the
  first step of a round, the intra-node hop at every step but a round's
  last), each starting once the receiver has reached the same step (it
  posts its receive then), then computes;
* a step starts when the previous step's compute and accumulator push are
  done and the transfer that brings its block has landed (the intra hop of
  the previous step, or the inter hop posted at the start of the round, so
  a slow inter-node hop overlaps the whole round);
* the accumulator push of a step waits for the partial sums it takes (an
  intra hop one step old, an inter hop one round old) and sends on; after
  the last step the final inter hop and the intra hop home are not overlapped.

``overlap=False`` (the ``*_no_overlap`` methods): a step computes only after
the transfers it posted have landed, and the next step starts only after the
accumulator sends it posted have (the runtime waits right after posting).

Sends go on one FIFO channel per rank and link class (``Ctx.send``); the
runtime's separate read and write communicators inside the node are not
modelled (a slightly pessimistic intra-node side). Flows crossing on one NIC
at once split it (``Placement.crossing``): in a double ring all I ranks of a
node cross together, so each NIC carries as many flows as it has ranks
(the profile's per-rank rate), where a flat ring's lone crossing hop gets a
whole NIC.
"""
from __future__ import annotations

from burst_impl.nodes import Nodes
from burst_impl.topology import DoubleRingSchedule

from .common import Ctx, Work, besides, ring_pass, split_table


def grid_of(ctx: Ctx, ring: list[int]) -> tuple[int, int] | None:
    """(E, I) of a ring group of global ranks on the placement when it is a real double ring, else None."""
    grid = Nodes(tuple(ctx.place.node(g) for g in ring)).grid()
    if grid is None or grid[0] < 2 or grid[1] < 2:
        return None
    return grid


def pass_for(ctx: Ctx, rings: list[list[int]], *, topology: str = "flat", overlap: bool = True, **kw) -> dict:
    """``ring_pass`` (flat) or ``routed_pass`` (double ring, where the rings have >= 2 nodes of >= 2 ranks)."""
    grid = grid_of(ctx, rings[0]) if topology == "double" else None
    if grid is None:
        if topology == "double":
            ctx.note("double ring falls back to the flat ring (one node, or one rank per node, in a ring group)")
        return ring_pass(ctx, rings, overlap=overlap, **kw)
    ctx.note(f"double ring over {grid[0]} nodes x {grid[1]} ranks: intra-node rings, the next round's block "
             "crossing to the same local rank of the next node meanwhile")
    return routed_pass(ctx, rings, grid, overlap=overlap, **kw)


def routed_pass(ctx: Ctx, rings: list[list[int]], grid: tuple[int, int], *, phase: str, name: str, hop: dict,
                work: Work, ready: dict, acc: dict | None = None, acc_sends: str = "n-1",
                overlap: bool = True) -> dict[int, int]:
    """One pass of the double ring over each ring group in ``rings`` (global ranks, side by side);
    arguments as ``common.ring_pass``. Returns ``{rank: task}`` after which the pass is over."""
    if acc_sends != "n-1":
        raise ValueError(f"acc_sends={acc_sends!r}: the double ring's accumulators make n-1 sends")
    E, I = grid
    n = E * I
    members = [(ring, i, g, DoubleRingSchedule(E, I, i)) for ring in rings for i, g in enumerate(ring)]
    peer = {(g, ch, d): ring[plan.peer(ch, d)] for ring, i, g, plan in members for ch in ("intra", "inter")
            for d in (1, -1)}
    crossing = ctx.place.crossing([(g, peer[g, "inter", 1]) for _, _, g, _ in members])
    hop_parts, acc_parts = split_table(hop, n - 1), split_table(acc or {}, n - 1)
    read_count = {g: 0 for _, _, g, _ in members}
    acc_count = dict(read_count)
    X: dict = {}          # (side, g, channel, step) -> send task of g posted at that step
    posted: dict = {}     # (side, g, channel) -> step of g's latest post on that channel
    B, C, P = {}, {}, {}

    def landed(side: str, g: int, ch: str) -> list:
        """The transfer g waits for on ``ch``: its own latest send there and the matching one into it."""
        s = posted.pop((side, g, ch))
        return [ctx.own(X.get((side, g, ch, s))), X.get((side, peer[g, ch, -1], ch, s))]

    # each step's work, once: a bundle posted at step s runs beside step s's work, an accumulator posted after
    # step s's compute beside step s + 1's, a finishing one beside nothing (``besides``)
    items = {(g, s): work(i, plan.owner(s), s) for s in range(n) for _, i, g, plan in members}
    beside = besides(ctx, items, overlap)

    def post(side: str, g: int, ch: str, s: int, nbytes: dict, deps: list) -> None:
        after = s if side == "read" else s + 1
        X[side, g, ch, s] = ctx.send(g, peer[g, ch, 1], f"{name}.{side}.{ch}[r{g},s{s}]", nbytes, deps=deps,
                                     phase=phase, crossing=crossing if ch == "inter" else None, posted=deps[:1],
                                     beside=beside.get((g, after), 0.0))
        posted[side, g, ch] = s

    for s in range(n):
        for ring, i, g, plan in members:
            if s == 0:
                deps = [ready.get(g)]
            else:
                deps = [C[g, s - 1], P.get((g, s - 1))] + landed("read", g, plan.bundle_source(s - 1))
                if not overlap:   # the accumulator sends of the previous step were waited for right away
                    deps += [X.get(("acc", h, ch, s - 1)) for ch in ("intra", "inter")
                             for h in (g, peer[g, ch, -1])]
            B[g, s] = ctx.sch.marker(f"{name}.step[r{g},s{s}]", deps, rank=g, phase=phase)
        for ring, i, g, plan in members:
            for ch in plan.bundle_posts(s):
                dst = peer[g, ch, 1]
                post("read", g, ch, s, hop_parts[read_count[g]], [B[g, s], B[dst, s]])
                read_count[g] += 1
        for ring, i, g, plan in members:
            last = B[g, s]
            if not overlap:
                last = ctx.sch.marker(f"{name}.landed[r{g},s{s}]", [last] + [
                    t for ch in plan.bundle_posts(s)
                    for t in (ctx.own(X["read", g, ch, s]), X["read", peer[g, ch, -1], ch, s])],
                    rank=g, phase=phase)
            last = ctx.step_host(g, f"{name}.step[r{g},s{s}]", dep=last, phase=phase)
            for label, seconds, flops in items[g, s]:
                last = ctx.compute(g, f"{name}.{label}[r{g},s{s}]", seconds, deps=[last], phase=phase, flops=flops)
            C[g, s] = last
        if acc is not None:
            _push_all(ctx, members, s, name, phase, C, P, landed, post, acc_parts, acc_count, peer)
    if acc is not None:
        for k in range(len(members[0][3].acc_finish())):
            for ring, i, g, plan in members:
                route = plan.acc_finish()[k]
                deps = [C[g, n - 1], P.get((g, n - 1))] + [t for ch in route.takes for t in landed("acc", g, ch)]
                P[g, n - 1] = ctx.sch.marker(f"{name}.finish{k}[r{g}]", deps, rank=g, phase=phase)
            for ring, i, g, plan in members:
                route = plan.acc_finish()[k]
                if route.then not in ("own", "keep"):
                    post("acc", g, route.then, n + k, acc_parts[acc_count[g]],
                         [P[g, n - 1], P[peer[g, route.then, 1], n - 1]])
                    acc_count[g] += 1
    return {g: ctx.sch.marker(f"{name}.done[r{g}]", [C[g, n - 1], P.get((g, n - 1))], rank=g, phase=phase)
            for _, _, g, _ in members}


def _push_all(ctx, members, s, name, phase, C, P, landed, post, acc_parts, acc_count, peer) -> None:
    for ring, i, g, plan in members:
        route = plan.acc_route(s)
        if route.then == "own":
            continue
        deps = [C[g, s]] + [t for ch in route.takes for t in landed("acc", g, ch)]
        P[g, s] = ctx.sch.marker(f"{name}.push[r{g},s{s}]", deps, rank=g, phase=phase)
    for ring, i, g, plan in members:
        route = plan.acc_route(s)
        if route.then in ("own", "keep"):
            continue
        dst = peer[g, route.then, 1]
        post("acc", g, route.then, s, acc_parts[acc_count[g]], [P[g, s], P.get((dst, s), C[dst, s])])
        acc_count[g] += 1
