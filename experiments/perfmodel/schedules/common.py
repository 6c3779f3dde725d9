"""Building blocks every method's schedule is made of: ring passes, ring collectives, all-to-alls, GEMMs.

Bytes are never computed here: a builder ``take``s each ``(phase, kind)``
entry of the registry's formula (``Method.bytes(shape)``, what ONE rank
sends) and spreads it over the transfers that carry it; ``Ctx.check_consumed``
then fails if the schedule left a registry entry unplaced. So the simulated
bytes equal the registry's by construction, and a registry change the
schedules do not know about is an error, not a silent mismatch.

Communication model (docs/papers.md §1 "Overlap"; burst_impl/comm.py, attention.py):

* A ring step posts its sends and receives together (``batch_isend_irecv``),
  computes on the block it holds, and waits for both: the transfer of step
  s+1's block overlaps the compute of step s (double buffering), and a step
  ends when its compute, its send and its receive are done. A transfer starts
  when the sender has posted it and the receiver has posted the matching
  receive (NCCL pairs them), so a slow hop delays its neighbours, and through
  them the whole ring: a synchronous ring runs at its slowest hop.
* The gradient accumulator ring (dQ for Burst's backward, dK/dV for the K/V
  backward) is pushed after each step's compute: it waits for the previous
  push's send and receive, then sends on (``AccumulatorRing.push``).
* Every rank has one FIFO send channel per link class (ops on one NCCL
  communicator run in issue order) and one compute stream.
* Collectives (all-reduce, all-gather, reduce-scatter) are NCCL's ring
  algorithm over the group in rank order: 2(G-1) (or G-1) steps of 1/G of the
  buffer, each step needing the previous step's chunk from the left neighbour.
* An all-to-all sends its G-1 pieces on the intra-node and the inter-node
  channel in the order the rank posts them (``all_to_all``) and ends, for the
  whole group, when the last piece lands.
"""
from __future__ import annotations

from collections import Counter
from itertools import groupby
from dataclasses import dataclass, field
from typing import Callable

from baselines import AttnShape

from ..costs import FP32, CostModel
from ..placement import Placement
from ..simulator import Schedule

PHASES = ("forward", "backward")
EXCESS_SUFFIX = ".excess"            # names the task a transfer holds its sender's compute stream by
STEP_HOST_SUFFIX = ".host"           # names the task a ring step's host work holds its rank by (Ctx.step_host)


@dataclass
class Ctx:
    """Everything a schedule builder needs; builders add tasks to ``sch`` and notes to ``notes``."""

    sch: Schedule
    cost: CostModel
    place: Placement
    shape: AttnShape
    mode: str                        # forward | backward | fwd_bwd
    level: str                       # op | block
    table: dict                      # registry bytes still to place: {(phase, kind): bytes per rank}
    options: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    # Transient buffers per rank (bytes) by phase, for the memory model: {phase: {name: bytes}}.
    transient: dict = field(default_factory=lambda: {"forward": {}, "backward": {}})
    # {a non-blocking send's task: the task its sender's wait on it returns with} where the cost model releases a
    # sender before the transfer lands (``CostModel.sender_release``); ``own`` reads it
    released: dict = field(default_factory=dict)

    @property
    def phases(self) -> tuple[str, ...]:
        return {"forward": ("forward",), "backward": ("backward",), "fwd_bwd": PHASES}[self.mode]

    @property
    def ranks(self) -> range:
        return range(self.shape.world_size)

    @property
    def elem(self) -> int:
        return self.shape.elem_size

    def note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)

    def buffer(self, phase: str, name: str, nbytes: float) -> None:
        self.transient[phase][name] = self.transient[phase].get(name, 0) + int(nbytes)

    def take(self, phase: str, kinds) -> dict:
        """Remove and return the registry entries ``(phase, kind)`` for ``kinds`` (absent ones are 0:
        a formula drops zero entries, e.g. every kind at world size 1)."""
        return {(phase, k): self.table.pop((phase, k), 0) for k in kinds}

    def check_consumed(self, method: str) -> None:
        left = {k: v for k, v in self.table.items() if k[0] in self.phases and v}
        if left:
            raise ValueError(f"method={method!r}: the schedule placed no transfer for registry bytes "
                             f"{sorted(left)}; its schedule builder must be updated with the formula")

    def own(self, send: int | None) -> int | None:
        """What a rank that posted ``send`` waits for when it waits on it: the task the cost model releases it
        with (``send_held``), else the transfer itself (None stays None)."""
        return None if send is None else self.released.get(send, send)

    # ------------------------------------------------------------ single tasks

    def compute(self, rank: int, name: str, seconds: float, *, deps=(), phase: str, flops: float = 0.0) -> int:
        """An op of ``seconds`` of work on ``rank``'s compute stream, for as long as the cost model says
        such an op holds it (``CostModel.op_seconds``)."""
        return self.sch.add(name, kind="compute", resource=f"compute/{rank}", duration=self.cost.op_seconds(seconds),
                            deps=deps, rank=rank, phase=phase, flops=flops)

    def step_host(self, rank: int, name: str, *, dep: int | None, phase: str) -> int | None:
        """The host work a ring step holds ``rank`` for whatever its tiles (``CostModel.step_seconds``: posting
        and waiting on its hops, planning it), before its ops; ``dep`` itself where that is none (a GPU's)."""
        seconds = self.cost.step_seconds()
        if seconds <= 0:
            return dep
        return self.sch.add(name + STEP_HOST_SUFFIX, kind="compute", resource=f"compute/{rank}", duration=seconds,
                            deps=[dep], rank=rank, phase=phase)

    def send(self, src: int, dst: int, name: str, nbytes: dict, *, deps=(), phase: str,
             crossing: dict[tuple[int, int], int] | None = None, step: bool = False, messages: int = 1,
             two_way: bool = True, posted=None, beside: float | None = None) -> int:
        """A transfer (``send_held``), its task alone."""
        return self.send_held(src, dst, name, nbytes, deps=deps, phase=phase, crossing=crossing, step=step,
                              messages=messages, two_way=two_way, posted=posted, beside=beside)[0]

    def send_held(self, src: int, dst: int, name: str, nbytes: dict, *, deps=(), phase: str,
                  crossing: dict[tuple[int, int], int] | None = None, step: bool = False,
                  messages: int = 1, two_way: bool = True, posted=None,
                  beside: float | None = None) -> tuple[int, int | None]:
        """``crossing``: flows per (node, NIC) at the same time (``Placement.crossing``); an inter-node
        send gets its NIC's rate over the flows on that NIC. ``step``: a collective's step after its first
        (``CostModel.transfer``: the hop latency alone, where the profile has one). ``messages``: the
        equal messages the transfer stands for (an all-to-all's pieces on one link class,
        ``CostModel.sender_seconds``). ``posted``: for a non-blocking send (a ring's isend), the deps of
        its post on the sender alone; the transfer still waits for ``deps`` (the receiver's matching
        receive: gloo sends on rendezvous), but the sender's held task does not, since the sender's
        thread goes on computing after an isend while gloo's threads wait and move the bytes. None: a
        blocking send or collective, whose sender is held from ``deps`` on. ``beside``: the compute-stream
        seconds the sender runs after the post while the transfer is in flight (``CostModel.sender_seconds``).
        A non-blocking send's sender waits on it until ``CostModel.sender_release`` from the rendezvous where
        the cost model says so (a task ``own`` returns), else until it lands.
        Returns the transfer's task and the task its sender is held by (None where the cost model holds it
        for nothing)."""
        same = self.place.same_node(src, dst)
        conc = (crossing or {}).get(self.place.nic(src), 1)
        total = sum(nbytes.values())
        seconds = self.cost.transfer(total, same, conc, step=step)
        extra = self.cost.sender_seconds(total, same, messages, two_way, beside)
        held = None     # a zero task would still hold the sender's stream until the send's deps are met
        if extra > 0:
            held = self.sch.add(f"{name}{EXCESS_SUFFIX}", kind="compute", resource=f"compute/{src}",
                                duration=extra, deps=deps if posted is None else posted, rank=src, phase=phase)
        task = self.sch.add(name, kind="comm", resource=f"send.{'intra' if same else 'inter'}/{src}",
                            duration=seconds, deps=deps, rank=src, phase=phase,
                            nbytes={k: v for k, v in nbytes.items() if v})
        release = None if posted is None else self.cost.sender_release(total, seconds, same)
        if release is not None:
            # from the rendezvous (the transfer's deps), not the link's queue: the bytes wait in the socket
            self.released[task] = self.sch.add(f"{name}.released", kind="comm", duration=release, deps=deps,
                                               rank=src, phase=phase)
        return task, held


def split(total: int, parts: int) -> list[int]:
    """``total`` in ``parts`` integer pieces as equal as possible (the first ones take the remainder)."""
    if parts <= 0:
        return []
    q, r = divmod(int(total), parts)
    return [q + (1 if i < r else 0) for i in range(parts)]


def split_table(table: dict, parts: int) -> list[dict]:
    """One dict of byte counts per transfer: every entry of ``table`` split over ``parts`` transfers."""
    pieces = {k: split(v, parts) for k, v in table.items()}
    return [{k: pieces[k][i] for k in table} for i in range(parts)]


# ---------------------------------------------------------------- ring pass

Work = Callable[[int, int, int], list[tuple[str, float, float]]]


def ring_pass(ctx: Ctx, rings: list[list[int]], *, phase: str, name: str, hop: dict, work: Work,
              ready: dict[int, int | None], acc: dict | None = None, acc_sends: str = "n-1",
              overlap: bool = True) -> dict[int, int]:
    """One pass of circulating blocks around each ring in ``rings`` (lists of global ranks, all of
    one length n, running side by side).

    ``hop``: registry bytes of the circulating bundle (per rank, over the pass: n-1 sends).
    ``work(i, owner, step)``: the compute of ring index i on owner's block at ``step``, as
    ``[(label, seconds, flops), ...]`` run in order on the rank's compute stream.
    ``acc``: registry bytes of the accumulator ring, sent after each step's compute,
    ``acc_sends`` = "n-1" (steps 1..n-1: the owner's own block stays home; burst_impl) or
    "n" (every step, ring-flash-attn).
    ``overlap=False`` (burst_impl's ``overlap=False``): a step computes only after its own transfer
    has landed, and the next step starts only after the accumulator send it posted has.
    Returns ``{rank: task}`` after which the pass is over on that rank.
    """
    n = len(rings[0])
    hops = [(ring[i], ring[(i + 1) % n]) for ring in rings for i in range(n)] if n > 1 else []
    crossing = ctx.place.crossing(hops)
    hop_sends = split_table(hop, n - 1)
    first_acc = 1 if acc_sends == "n-1" else 0
    acc_parts = split_table(acc, n - first_acc) if acc is not None else []
    B, S, C, P, A = {}, {}, {}, {}, {}
    members = [(ring, i, g) for ring in rings for i, g in enumerate(ring)]
    # each step's work, once: a hop posted at step s runs beside step s's work, an accumulator posted after
    # step s's compute beside step s + 1's (``besides``)
    items = {(g, s): work(i, (i - s) % n, s) for s in range(n) for _, i, g in members}
    beside = besides(ctx, items, overlap)
    # a rank's hop is two-way across nodes when it also receives from another node
    across = {g: not ctx.place.same_node(ring[(i - 1) % n], g) for ring, i, g in members}
    for s in range(n):
        for ring, i, g in members:
            prev = ring[(i - 1) % n]
            deps = [ready.get(g)] if s == 0 else [C[g, s - 1], ctx.own(S.get((g, s - 1))), S.get((prev, s - 1)),
                                                  P.get((g, s - 1))]
            if s > 0 and not overlap:
                deps += [ctx.own(A.get((g, s - 1))), A.get((prev, s - 1))]
            B[g, s] = ctx.sch.marker(f"{name}.step[r{g},s{s}]", deps, rank=g, phase=phase)
        if s < n - 1:
            for ring, i, g in members:
                nxt = ring[(i + 1) % n]
                S[g, s] = ctx.send(g, nxt, f"{name}.send[r{g},s{s}]", hop_sends[s], deps=[B[g, s], B[nxt, s]],
                                   phase=phase, crossing=crossing, two_way=across[g], posted=[B[g, s]],
                                   beside=beside.get((g, s), 0.0))
        for ring, i, g in members:
            last = B[g, s]
            if not overlap and s < n - 1:
                prev = ring[(i - 1) % n]
                last = ctx.sch.marker(f"{name}.landed[r{g},s{s}]", [last, ctx.own(S[g, s]), S[prev, s]], rank=g,
                                      phase=phase)
            last = ctx.step_host(g, f"{name}.step[r{g},s{s}]", dep=last, phase=phase)
            for label, seconds, flops in items[g, s]:
                last = ctx.compute(g, f"{name}.{label}[r{g},s{s}]", seconds, deps=[last], phase=phase,
                                   flops=flops)
            C[g, s] = last
        if acc is not None and s >= first_acc:
            for ring, i, g in members:
                prev = ring[(i - 1) % n]
                P[g, s] = ctx.sch.marker(f"{name}.push[r{g},s{s}]",
                                         [C[g, s], ctx.own(A.get((g, s - 1))), A.get((prev, s - 1))], rank=g,
                                         phase=phase)
            for ring, i, g in members:
                nxt = ring[(i + 1) % n]
                if n > 1:
                    A[g, s] = ctx.send(g, nxt, f"{name}.acc[r{g},s{s}]", acc_parts[s - first_acc],
                                       deps=[P[g, s], P[nxt, s]], phase=phase, crossing=crossing, two_way=across[g],
                                       posted=[P[g, s]], beside=beside.get((g, s + 1), 0.0))
    end = {}
    for ring, i, g in members:
        prev = ring[(i - 1) % n]
        end[g] = ctx.sch.marker(f"{name}.done[r{g}]", [C[g, n - 1], P.get((g, n - 1)), ctx.own(A.get((g, n - 1))),
                                                       A.get((prev, n - 1))], rank=g, phase=phase)
    return end


def besides(ctx: Ctx, items: dict, overlap: bool) -> dict:
    """``{(rank, step): the compute-stream seconds of that step}``: its host work (``Ctx.step_host``) and its work
    items as ``Ctx.compute`` puts them there (``CostModel.op_seconds``): what a transfer posted beside that step runs
    beside (``CostModel.sender_seconds``). Empty without overlap: a step then waits for its transfers before it
    computes, so they run beside nothing."""
    if not overlap:
        return {}
    step = ctx.cost.step_seconds()
    return {k: step + sum(ctx.cost.op_seconds(seconds) for _, seconds, _ in v) for k, v in items.items()}


# ---------------------------------------------------------------- collectives


def ring_collective(ctx: Ctx, group: list[int], *, phase: str, name: str, nbytes: dict, steps: int,
                    ready: dict[int, int | None]) -> dict[int, int]:
    """NCCL ring algorithm over ``group`` (rank order): ``steps`` steps, each rank sending
    1/steps of its registry bytes to the next rank once it has the previous step's chunk.
    All-reduce: steps = 2(G-1); all-gather and reduce-scatter: G-1. The first step pays the link's
    latency (NCCL's base + hop), the others its ``step_latency_us`` where it has one (the hop)."""
    n = len(group)
    if n == 1 or steps == 0:
        return {g: ctx.sch.marker(f"{name}.done[r{g}]", [ready.get(g)], rank=g, phase=phase) for g in group}
    crossing = ctx.place.crossing([(group[i], group[(i + 1) % n]) for i in range(n)])
    parts = split_table(nbytes, steps)
    X: dict = {}
    for k in range(steps):
        for i, g in enumerate(group):
            nxt, prev = group[(i + 1) % n], group[(i - 1) % n]
            deps = [ready.get(g), ready.get(nxt)] if k == 0 else [X[prev, k - 1]]
            X[g, k] = ctx.send(g, nxt, f"{name}[r{g},k{k}]", parts[k], deps=deps, phase=phase, crossing=crossing,
                               step=k > 0, two_way=not ctx.place.same_node(prev, g))
    return {g: ctx.sch.marker(f"{name}.done[r{g}]", [X[g, steps - 1], X[group[(i - 1) % n], steps - 1]],
                              rank=g, phase=phase) for i, g in enumerate(group)}


def all_to_all(ctx: Ctx, groups: list[list[int]], *, phase: str, name: str, nbytes: dict,
               ready: dict[int, int | None]) -> dict[int, int]:
    """One all-to-all in each group (side by side). Each rank sends 1/(u-1) of its registry bytes
    to each other member: its intra-node pieces on one channel, inter-node ones on the other.

    A rank posts its pieces to the members after it in group order, wrapping round (r+1, ..., r-1:
    ``burst_impl.collectives._all_to_all_receive_first``), and the link classes come in runs of that
    order (rank 0 of a node of 4 in a 2 x 4 group: 3 intra pieces, then 4 inter). A run's link starts when
    its sender has done the work it is held for on the pieces posted before it (``Ctx.send``'s held task;
    none on a GPU profile, where the runs start together), and the call ends, for the whole group, when
    every piece has landed and every sender's held work is done."""
    u = len(groups[0])
    if u == 1:
        return {g: ctx.sch.marker(f"{name}.done[r{g}]", [ready.get(g)], rank=g, phase=phase)
                for grp in groups for g in grp}
    pieces = split_table(nbytes, u - 1)
    # ranks with an inter-node piece, per (node, NIC): they share that NIC
    crossing = dict(Counter(ctx.place.nic(g) for grp in groups for g in grp
                            if any(not ctx.place.same_node(g, h) for h in grp)))
    end = {}
    for grp in groups:
        start = ctx.sch.marker(f"{name}.start[g{grp[0]}]", [ready.get(g) for g in grp], phase=phase)
        sent = []
        for i, g in enumerate(grp):
            posted = [grp[(i + j) % u] for j in range(1, u)]     # piece j of ``pieces`` to posted[j]
            held = []                                           # the sender's held work on the runs so far
            for same, run in groupby(range(u - 1), key=lambda j: ctx.place.same_node(g, posted[j])):
                run = list(run)
                b = {k: sum(pieces[j][k] for j in run) for k in nbytes}
                tag = f"{name}.{'intra' if same else 'inter'}[r{g},p{run[0]}]"
                link, work = ctx.send_held(g, posted[run[0]], tag, b, deps=[start, *held], phase=phase,
                                           crossing=crossing, messages=len(run))
                sent.append(link)
                held.append(work)
            sent += held
        done = ctx.sch.marker(f"{name}.done[g{grp[0]}]", sent, phase=phase)
        end.update({g: done for g in grp})
    return end


# ---------------------------------------------------------------- compute helpers


def hbm_step(ctx: Ctx, label: str, nbytes: float) -> tuple[str, float, float]:
    return (label, ctx.cost.hbm(nbytes), 0.0)


def merge_bytes(batch: int, rows: int, heads: int, head_dim: int, elem: int) -> int:
    """HBM bytes of one online-softmax merge (burst_impl.attention.merge_partial): read the fp32
    running output and the block output, write the fp32 output; read two lse, write one."""
    return batch * rows * heads * (head_dim * (2 * FP32 + elem) + 3 * FP32)


def accumulate_bytes(batch: int, rows: int, heads: int, head_dim: int) -> int:
    """HBM bytes of adding a block gradient into an fp32 accumulator (read both, write one)."""
    return batch * rows * heads * head_dim * 3 * FP32


def projections(ctx: Ctx, rank: int, *, tokens: int, q_heads: int, kv_heads: int, out_heads: int,
                phase: str, which: str, deps) -> int:
    """The layer's QKV (``which="qkv"``) or output (``"out"``) projection on ``tokens`` rows,
    forward (1 GEMM) or backward (2: input and weight gradients)."""
    s, d = ctx.shape, ctx.shape.head_dim
    hidden = s.heads * d
    if which == "qkv":
        t, f = ctx.cost.gemm(s.batch * tokens, (q_heads + 2 * kv_heads) * d, hidden)
    else:
        t, f = ctx.cost.gemm(s.batch * tokens, hidden, out_heads * d)
    mult = 1 if phase == "forward" else 2
    return ctx.compute(rank, f"{which}_proj.{phase}[r{rank}]", mult * t, deps=deps, phase=phase, flops=mult * f)


def sequence_parallel(ctx: Ctx, forward: Callable[[dict], dict], backward: Callable[[dict], dict]) -> dict:
    """The schedule of a sequence-parallel method: its attention phases, and at layer level the
    projections around them on the rank's N/G tokens (every rank holds the full weights).

    ``forward(ready)`` / ``backward(ready)`` add the attention's tasks after ``{rank: task}``
    and return the tasks that end them."""
    s = ctx.shape
    tokens = s.seqlen // s.world_size
    layer = ctx.level == "layer"
    ready: dict = {g: None for g in ctx.ranks}

    def proj(which: str, phase: str) -> None:
        for g in ctx.ranks:
            ready[g] = projections(ctx, g, tokens=tokens, q_heads=s.heads, kv_heads=s.kv_heads,
                                   out_heads=s.heads, phase=phase, which=which, deps=[ready[g]])

    # the backward runs the layer in reverse: output projection, attention, QKV projection
    for phase, attention, (before, after) in (("forward", forward, ("qkv", "out")),
                                              ("backward", backward, ("out", "qkv"))):
        if phase not in ctx.phases:
            continue
        if layer:
            proj(before, phase)
        ready = dict(attention(ready))
        if layer:
            proj(after, phase)
    return ready
