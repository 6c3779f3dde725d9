"""Communication with exact byte accounting.

Every byte a method sends goes through this module, so that communication
volume is *counted by our code* (gloo emulates some collectives with more
traffic than NCCL, so the wire is not the truth we want).

Counting is per rank: each process records what *it* sends, keyed by
``(phase, kind)`` with phase in {"forward", "backward"} and kind a tensor name
("k", "v", "q", "dout", "lse", "delta", "dq", "dk", "dv", "qkv", ...).

    with burst_impl.comm.count_bytes() as counts:
        out = burst_attn_func(q, k, v, group=g)
        out.backward(dout)
    counts.total()                 # all bytes this rank sent
    counts.phase("backward")       # {kind: bytes}
    counts[("forward", "k")]       # bytes

Collectives are counted with the volume an optimal (ring/pairwise) algorithm
sends per rank, which is what NCCL does and what the papers' formulas assume:

* all_to_all_single of a local buffer of n bytes: n * (G-1)/G sent
* all_gather_into_tensor of a local shard of n bytes: n * (G-1)
* reduce_scatter_tensor of a full input of n bytes: n * (G-1)/G
* all_reduce of n bytes: 2 * n * (G-1)/G  (reduce-scatter + all-gather)

Link classes. Every send is also counted by the link class it uses,
``"intra"`` (inside a node) or ``"inter"`` (between nodes), in a separate view
``counts.links`` keyed by ``(phase, kind, link)`` (``counts.by_link()`` sums it
per class); the node of each rank comes from ``burst_impl.nodes`` (an
explicit ``node_size``, else ``LOCAL_WORLD_SIZE``). Sends recorded without a
class (formula bytes of adapters around other packages) are "unclassified".
``counts.wait_s`` holds the seconds this rank spent waiting for transfers,
per phase (host time; on CUDA timed between stream synchronisations, see ``Pending``).

Rings. ``circulate`` and ``AccumulatorRing`` run on a *transport*: an object
that says which block this rank holds at each step and how blocks and
gradient accumulators move between steps (see ``Transport``). ``Ring`` is
the flat ring; ``burst_impl.topology.DoubleRing`` the topology-aware one.
"""
from __future__ import annotations

import contextlib
import time
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import torch
import torch.distributed as dist

from .nodes import LINKS, Nodes, ring_links

Tensor = torch.Tensor

PHASES = ("forward", "backward")
UNCLASSIFIED = "unclassified"


class CommCounts(Counter):
    """Bytes sent by this rank, keyed by (phase, kind).

    ``notes`` holds decisions made while counting (e.g. which backward scheme
    ``backward="auto"`` chose), so a result record can state them.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.notes: dict[str, object] = {}
        self.links: Counter = Counter()      # {(phase, kind, link): bytes}, link in LINKS or UNCLASSIFIED
        self.wait_s: Counter = Counter()     # {phase: seconds spent waiting for transfers}

    def total(self) -> int:  # type: ignore[override]
        return int(sum(self.values()))

    def phase(self, phase: str) -> dict[str, int]:
        return {k: v for (p, k), v in self.items() if p == phase}

    def phase_total(self, phase: str) -> int:
        return int(sum(self.phase(phase).values()))

    def as_dict(self) -> dict[str, int]:
        """Flat ``{"phase/kind": bytes}``, handy for JSON records."""
        return {f"{p}/{k}": int(v) for (p, k), v in sorted(self.items())}

    def by_link(self, phase: str | None = None) -> dict[str, int]:
        """``{link class: bytes}`` this rank sent (in ``phase`` only, if given); classes with no bytes
        are left out."""
        out: Counter = Counter()
        for (p, _, link), b in self.links.items():
            if phase is None or p == phase:
                out[link] += b
        return {k: int(v) for k, v in out.items() if v}

    def link_dict(self) -> dict[tuple[str, str, str], int]:
        """``{(phase, kind, link): bytes}`` without zero entries (what the per-link formulas give)."""
        return {k: int(v) for k, v in self.links.items() if v}


_active: list[CommCounts] = []


@contextlib.contextmanager
def count_bytes() -> Iterator[CommCounts]:
    """Count the bytes this rank sends inside the block.

    Nestable (e.g. one counter per step around one per phase): every open
    counter records every send; a counter stops counting when its own block
    closes. Counters are told apart by identity (two counters with equal
    contents are still different counters).
    """
    counts = CommCounts()
    _active.append(counts)
    try:
        yield counts
    finally:
        for i in range(len(_active) - 1, -1, -1):
            if _active[i] is counts:
                del _active[i]
                break


def record(phase: str, kind: str, nbytes: int, link: str | None = None) -> None:
    """Add ``nbytes`` sent by this rank over a ``link`` class ("intra", "inter"; None: unclassified)
    to every active counter."""
    if phase not in PHASES:
        raise ValueError(f"phase={phase!r} must be one of {PHASES}")
    if link is not None and link not in LINKS:
        raise ValueError(f"link={link!r} must be one of {LINKS} (or None: unclassified)")
    for c in _active:
        c[(phase, kind)] += int(nbytes)
        c.links[(phase, kind, link or UNCLASSIFIED)] += int(nbytes)


def record_split(phase: str, kind: str, by_link: dict[str, int]) -> None:
    """``record`` one send made of pieces on several link classes (a collective)."""
    for link, b in by_link.items():
        if b:
            record(phase, kind, b, link)


def record_wait(phase: str, seconds: float) -> None:
    for c in _active:
        c.wait_s[phase] += seconds


def note(key: str, value: object) -> None:
    """Attach a decision to every active counter (last one wins)."""
    for c in _active:
        c.notes[key] = value


def nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


# ---------------------------------------------------------------- group helpers


def world(group=None) -> tuple[int, int]:
    """(rank, world size) in ``group``; (0, 1) when torch.distributed is not initialised.

    ValueError when this process is not a member of ``group`` (torch would
    report rank -1, and a ring of size -1 silently does nothing).
    """
    if not dist.is_available() or not dist.is_initialized():
        return 0, 1
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError(f"group={group!r}: this process (global rank {dist.get_rank()}) is not a member "
                         "of the group; call the method only on the group's ranks")
    return rank, dist.get_world_size(group)


def global_rank(group, group_rank: int) -> int:
    if group is None or group is dist.group.WORLD:
        return group_rank
    return dist.get_global_rank(group, group_rank)


# ---------------------------------------------------------------- cross-rank agreement (on by default)

_check_shapes = True


class check_shapes:
    """Turn the cross-rank agreement check of every ring / all-to-all method on (default) or off.

    A rank cannot see from its own inputs what the other ranks hold: how long
    their shards are (N = 10 over 3 ranks is 4/3/3), or whether they passed
    the same dtype, heads, mask, scale, layout or options. With the check on,
    the shared input validation (``burst_impl.attention.validate_call``)
    all-gathers a fixed-size int64 signature of every rank's call (17 ints
    per rank: hashes of the non-length parameters and the local length; not
    counted by ``count_bytes``: it is a check, not the method's traffic)
    before the first send. Every rank then knows every shard's length (so N),
    and raises the same ValueError, naming the parameter and each rank's
    value, if they disagree or if any rank's inputs failed its local checks;
    the group stays usable. Off, each rank takes N from ``seqlen=`` (where
    the method takes it) or as seq_local x G (even shards): for callers that
    guarantee agreement and want to save the collective.

        comm.check_shapes(False)            # from now on
        with comm.check_shapes(False): ...  # inside the block only
    """

    def __init__(self, enabled: bool = True):
        global _check_shapes
        self.previous, _check_shapes = _check_shapes, bool(enabled)

    def __enter__(self) -> "check_shapes":
        return self

    def __exit__(self, *exc) -> None:
        global _check_shapes
        _check_shapes = self.previous


def shape_check_enabled() -> bool:
    return _check_shapes


# ---- agreement once per call shape (the harness's timed region)
# None: every call all-gathers (the default a user calling an operator gets). A dict: inside
# ``agree_once``, the agreed rows of each (group, signature, vary) of a passing rank seen so far.
_agreed: dict | None = None
_collectives = {"agreement": 0}   # how many agreement all-gathers this process ran (tests read it)


@contextlib.contextmanager
def agree_once() -> Iterator[None]:
    """Inside the block, a call whose local signature this rank already agreed on reuses that
    agreement instead of all-gathering again; leaving the block forgets every agreement.

    For a timing harness: its untimed warm-up makes each method's first call of a case (which
    agrees, as any call does), and its timed calls repeat the very same inputs on every rank, so
    the check's collective and its blocking host copy stay out of the timed region (peers that do
    not check pay nothing like it). A rank can only tell that ITS signature repeats: a caller
    whose ranks could change their inputs independently inside the block must not use it (a rank
    that skips the collective while another runs it would leave that one waiting). Nestable: an
    inner block shares the outer one's agreements."""
    global _agreed
    outer = _agreed
    if outer is None:
        _agreed = {}
    try:
        yield
    finally:
        _agreed = outer


def agreement_count() -> int:
    """Agreement all-gathers this process has run (the check's own collectives, never a method's)."""
    return _collectives["agreement"]


def _device_of(group) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def agree_on_inputs(group, signature: Sequence[int], problem: Exception | None, describe: Callable[[list[int]], str],
                    *, names: Sequence[str] | None = None, values: Sequence[str] | None = None,
                    vary: Sequence[int] = ()) -> list[list[int]]:
    """All-gather ``signature`` (ints, the same count on every rank) and this rank's validation outcome
    over ``group``; ValueError on every rank unless every rank passed and the signatures agree outside
    the slots ``vary`` (e.g. the local length). Returns every rank's signature (rank order). Not counted.

    ``names``/``values``: the parameter name and this rank's readable value of each slot (a string, or a
    dict of named options, of which the differing keys are named); on a
    disagreement the readable values of the differing slots are gathered too (an error path only), so
    the message names the parameter and every rank's value, identically on every rank."""
    _, size = world(group)
    if size == 1:
        return [list(signature)]
    # a rank whose own checks failed always joins the collective: the others must hear of it
    # (id(None) is as fixed as any group's; ``vary`` too: a looser verdict must not serve a stricter caller)
    key = (id(group), tuple(signature), tuple(vary)) if problem is None else None
    if _agreed is not None and key in _agreed:
        return [list(row) for row in _agreed[key]]
    rows = _gather_and_judge(group, size, signature, problem, describe, names, values, vary)
    if _agreed is not None and key is not None:
        _agreed[key] = rows
    return rows


def _gather_and_judge(group, size: int, signature: Sequence[int], problem: Exception | None, describe,
                      names, values, vary) -> list[list[int]]:
    """``agree_on_inputs``'s collective and its verdict (ValueError, or every rank's signature)."""
    _collectives["agreement"] += 1
    mine = torch.tensor([0 if problem is None else 1, *signature], dtype=torch.int64, device=_device_of(group))
    every = [torch.empty_like(mine) for _ in range(size)]
    dist.all_gather(every, mine, group=group)
    rows = [t.cpu().tolist() for t in every]
    bad = [r for r, row in enumerate(rows) if row[0]]
    if bad and problem is None:
        raise ValueError(f"inputs rejected on rank(s) {bad} of the group (see the ValueError there); "
                         "nothing was sent")
    differ = [i for i in range(len(signature)) if i not in vary and any(row[i + 1] != rows[0][i + 1] for row in rows)]
    if bad or not differ:
        return [row[1:] for row in rows]
    if names is None or values is None:
        per_rank = "; ".join(f"rank {r}: {describe(row[1:])}" for r, row in enumerate(rows))
        raise ValueError(f"local shapes or dtypes differ across the ranks of the group ({per_rank}); every "
                         "rank must hold a shard of the same shape (the global sequence must split evenly)")
    readable = [None] * size
    dist.all_gather_object(readable, [values[i] for i in differ], group=group)
    parts = []
    for j, i in enumerate(differ):
        got = [readable[r][j] for r in range(size)]
        if all(isinstance(x, dict) for x in got):   # method options: name the keys that differ
            keys = sorted({key for x in got for key in x if any(y.get(key, "?") != x.get(key, "?") for y in got)})
            parts += [f"{names[i]}.{key}: " + ", ".join(f"rank {r}: {x.get(key, '(none)')}" for r, x in enumerate(got))
                      for key in keys]
        else:
            parts.append(f"{names[i]}: " + ", ".join(f"rank {r}: {x}" for r, x in enumerate(got)))
    raise ValueError("the ranks of the group disagree on " + "; ".join(parts) + " (every rank must pass the same "
                     "value; nothing was sent)")


# ---------------------------------------------------------------- point-to-point channels


class Channel:
    """One direction of neighbour traffic on a ring: send to global rank ``dst``, receive from ``src``.

    ``start(tensors, phase, kinds)`` posts the receives, then the sends, of one
    hop as a single ``batch_isend_irecv`` and returns a ``Pending`` whose
    ``wait()`` gives the received tensors. Every rank posts the same sequence
    of operations, so no ordering of blocking calls can deadlock, whatever
    the parity of the world size. ``link`` is the link class of the send
    (counted per class). ``tag`` keeps channels that share a process group
    and a peer apart (gloo matches a receive to a send by peer and tag; NCCL
    ignores tags, so there each channel gets its own group). Tensors of any
    strides are sent as contiguous copies (no copy when already contiguous).
    """

    def __init__(self, group, dst: int, src: int, link: str, tag: int = 0):
        self.group, self.dst, self.src, self.link, self.tag = group, dst, src, link, tag

    def start(self, tensors: Sequence[Tensor], phase: str, kinds: Sequence[str],
              recv_shapes: Sequence[Sequence[int]] | None = None) -> "Pending":
        tensors = [t.contiguous() for t in tensors]
        # what arrives is the peer's block, which may be a token longer or shorter than ours (uneven N)
        recv = [torch.empty(tuple(shape), dtype=t.dtype, device=t.device)
                for t, shape in zip(tensors, recv_shapes or [t.shape for t in tensors])]
        # Receives first, then sends. NCCL groups the batch, so the order is free there; gloo posts the
        # operations one by one, and when two ranks exchange with each other (a ring of 2: the double
        # ring's outer ring over 2 nodes, USP's ring over 2 groups) a send posted before its peer's
        # receive serialises the two directions: half the link rate (docs/findings.md).
        ops = [dist.P2POp(dist.irecv, r, self.src, self.group, self.tag) for r in recv]
        for t, kind in zip(tensors, kinds):
            ops.append(dist.P2POp(dist.isend, t, self.dst, self.group, self.tag))
            record(phase, kind, nbytes(t), self.link)
        reqs = dist.batch_isend_irecv(ops)
        return Pending(reqs, recv, keep=[op.tensor for op in ops], phase=phase)


def _synchronize(device: torch.device) -> None:
    torch.cuda.synchronize(device)


class Pending:
    """The transfers of one hop in flight; ``wait()`` gives the received tensors.

    The seconds it waits go to ``CommCounts.wait_s``. On CUDA ``r.wait()`` only makes the compute
    stream wait for the NCCL stream and returns at once, so while a counter is open (the harness's
    untimed counted step, never its timed calls) the wait is timed between two synchronisations:
    the work queued before it first (not a wait for a transfer), then the transfers' landing."""

    def __init__(self, reqs, recv, keep, phase: str = "forward"):
        self._reqs, self._recv, self._keep, self._phase = reqs, recv, keep, phase

    def wait(self) -> list[Tensor]:
        if self._reqs:
            # only while a counter is open (never a timed call): the device is looked at then alone
            device = self._recv[0].device if _active and self._recv else None
            timed_on_gpu = device is not None and device.type == "cuda"
            if timed_on_gpu:
                _synchronize(device)
            t0 = time.perf_counter()
            for r in self._reqs:
                r.wait()
            if timed_on_gpu:
                _synchronize(device)
            record_wait(self._phase, time.perf_counter() - t0)
            self._reqs = []
        self._keep = None
        return self._recv

    def drain(self) -> None:
        """Wait for every request, ignoring their errors (cleanup after a failure)."""
        for r in self._reqs:
            try:
                r.wait()
            except Exception:  # noqa: BLE001 - the original error is what gets reported
                pass
        self._reqs, self._keep = [], None


# ---------------------------------------------------------------- transports


@dataclass(frozen=True)
class AccRoute:
    """What happens to the gradient accumulator of one block at one step of a pass.

    ``takes``: write channels whose pending receive carries a partial sum for
    this block (added to this rank's contribution); ``kept``: also add the
    partial sum kept by an earlier ``then="keep"``; ``then``: "own" (this
    rank's own block: its contribution stays home; at the end of the pass,
    the totals are added to it), "keep" (hold the sum for a later route), or
    the name of a write channel to send the sum on.
    """

    takes: tuple[str, ...] = ()
    kept: bool = False
    then: str = "own"


class Transport:
    """How a pass over the G blocks of a group moves them: what ``circulate`` and
    ``AccumulatorRing`` ask of a ring.

    * ``owner(step)``: the group rank whose block this rank holds at ``step``
      (0 <= step < size; step 0 is the rank's own block);
    * ``bundle_posts(step)``: the read channels on which the held block is sent
      at ``step`` (posted before computing on it);
    * ``bundle_source(step)``: the read channel whose receive is the block of
      ``step + 1``;
    * ``acc_route(step)`` and ``acc_finish()``: the accumulator's ``AccRoute``
      at each step, and the routes after the last step (the last one "own");
    * ``read``/``write``: channels by name (the circulating blocks; the
      gradient accumulators).

    ``overlap=False`` waits for every transfer right after posting it, so
    communication and computation are serialised (to measure what overlap buys).
    """

    rank: int
    size: int
    overlap: bool = True
    read: dict[str, Channel]
    write: dict[str, Channel]
    description: str = ""

    def post(self, channel: Channel, tensors: Sequence[Tensor], phase: str, kinds: Sequence[str],
             recv_shapes: Sequence[Sequence[int]] | None = None) -> Pending:
        pending = channel.start(tensors, phase, kinds, recv_shapes)   # None: shaped like the sent tensors
        if not self.overlap:
            pending.wait()
        return pending

    def owner(self, step: int) -> int:
        raise NotImplementedError

    def src_owner(self, channel: str, step: int) -> int:
        """The owner of the block (or of the accumulator) that arrives on ``channel`` when it is posted at
        ``step`` (``size + i``: the i-th route of ``acc_finish``): what the sending peer holds then. With
        uneven shards it sizes the receive buffers."""
        raise NotImplementedError

    def bundle_posts(self, step: int) -> tuple[str, ...]:
        raise NotImplementedError

    def bundle_source(self, step: int) -> str:
        raise NotImplementedError

    def acc_route(self, step: int) -> AccRoute:
        raise NotImplementedError

    def acc_finish(self) -> tuple[AccRoute, ...]:
        raise NotImplementedError


class Ring(Transport):
    """The flat ring over ``group``: send to rank+1, receive from rank-1, G-1 hops.

    Step s holds the block of rank (rank - s) mod G. One channel ("next")
    carries both the circulating blocks and the accumulators. Its link class
    comes from ``nodes`` (default ``Nodes.of(group)``): with node-major
    placement only the rank at local index I-1 of each node sends across
    nodes, and every one of its G-1 hops does.
    """

    def __init__(self, group=None, *, nodes: Nodes | None = None, overlap: bool = True):
        self.group = group
        self.rank, self.size = world(group)
        self.overlap = bool(overlap)
        self.next = global_rank(group, (self.rank + 1) % self.size)
        self.prev = global_rank(group, (self.rank - 1) % self.size)
        if nodes is None and self.size > 1:
            nodes = Nodes.of(group)
        self.link = ring_links(nodes, self.rank) if self.size > 1 else "intra"
        channel = Channel(group, self.next, self.prev, self.link)
        self.read = self.write = {"next": channel}
        self.description = f"flat ring over {self.size} ranks"

    def owner(self, step: int) -> int:
        return (self.rank - step) % self.size

    def src_owner(self, channel: str, step: int) -> int:
        return (self.rank - 1 - step) % self.size   # rank-1 sends what it holds at this step

    def bundle_posts(self, step: int) -> tuple[str, ...]:
        return ("next",) if step < self.size - 1 else ()

    def bundle_source(self, step: int) -> str:
        return "next"

    def acc_route(self, step: int) -> AccRoute:
        # Step 1's accumulator starts here (the owner kept its own); from step 2 one arrives from prev.
        if step == 0:
            return AccRoute(then="own")
        return AccRoute(takes=("next",) if step >= 2 else (), then="next")

    def acc_finish(self) -> tuple[AccRoute, ...]:
        return (AccRoute(takes=("next",) if self.size > 1 else (), then="own"),)


# ---------------------------------------------------------------- the pass


class AccumulatorRing:
    """Gradient accumulators that follow a circulating bundle and end at its owner.

    The owner's own contribution (step 0) stays home. At every later step the
    accumulator of the visiting block is this rank's contribution plus the
    partial sums that arrive for the same block, and it moves on as the
    transport's ``acc_route`` says (flat ring: to the next rank; after the
    last step it is one hop from its owner, which receives it in ``finish``:
    G-1 sends per rank). Contributions are full-size (``like``'s shapes) or
    None (no work at that step).
    """

    def __init__(self, ring: Transport, kinds: Sequence[str], like: Sequence[Tensor], dtype,
                 acc_dtype=torch.float32, shapes: Callable[[int], list] | None = None):
        self.ring, self.kinds, self.dtype, self.acc_dtype = ring, kinds, dtype, acc_dtype
        self.like = like
        # owner -> shapes of that block's accumulators (uneven shards); None: every block is like ``like``
        self.shapes = shapes
        self.own: list[Tensor] | None = None
        self.kept: list[Tensor] | None = None
        self.pending: dict[str, Pending] = {}

    def _sum(self, route: AccRoute, grads: list[Tensor] | None, owner: int) -> list[Tensor]:
        parts = [self.pending.pop(ch).wait() for ch in route.takes]
        if route.kept:
            parts.append(self.kept)
            self.kept = None
        if not parts:
            return [g.to(self.dtype) for g in grads] if grads is not None else \
                [torch.zeros(shape, dtype=self.dtype, device=t.device) for t, shape in
                 zip(self.like, self.shapes(owner) if self.shapes else [t.shape for t in self.like])]
        acc = parts[0]
        for extra in parts[1:] + ([grads] if grads is not None else []):
            acc = [a.add_(x) for a, x in zip(acc, extra)]
        return acc

    def _dispatch(self, then: str, acc: list[Tensor], step: int) -> None:
        if then == "keep":
            self.kept = acc
            return
        assert then not in self.pending, f"accumulator channel {then!r} already has a transfer in flight"
        self.pending[then] = self.ring.post(self.ring.write[then], acc, "backward", self.kinds,
                                            self.shapes(self.ring.src_owner(then, step)) if self.shapes else None)

    def push(self, step: int, grads: list[Tensor] | None) -> None:
        """This rank's contribution to the block visiting at ``step`` (None: no work)."""
        route = self.ring.acc_route(step)
        if route.then == "own":
            self.own = grads
            return
        self._dispatch(route.then, self._sum(route, grads, self.ring.owner(step)), step)

    def finish(self) -> list[Tensor]:
        """Totals for this rank's own block, in ``acc_dtype``."""
        for i, route in enumerate(self.ring.acc_finish()):
            if route.then != "own":   # parts always arrive here (a finishing route never starts a sum)
                self._dispatch(route.then, self._sum(route, None, self.ring.rank), self.ring.size + i)
                continue
            own = self.own if self.own is not None else [torch.zeros_like(t, dtype=self.acc_dtype) for t in self.like]
            own = [o.to(self.acc_dtype) for o in own]
            parts = [self.pending.pop(ch).wait() for ch in route.takes] + ([self.kept] if route.kept else [])
            for part in parts:
                for o, r in zip(own, part):
                    o.add_(r.to(self.acc_dtype))
            return own
        raise AssertionError("a transport's acc_finish must end with a route to 'own'")

    def drain(self) -> None:
        for p in self.pending.values():
            p.drain()
        self.pending.clear()


def circulate(ring: Transport, bundle: list[Tensor], phase: str, kinds: Sequence[str],
              on_block: Callable[[int, int, list[Tensor]], list[Tensor] | None],
              acc: AccumulatorRing | None = None, shapes: Callable[[int], list] | None = None
              ) -> list[Tensor] | None:
    """Visit the G blocks of ``bundle``: ``on_block(step, owner, tensors)``; returns ``acc.finish()``.

    ``shapes(owner)``: the shapes of that owner's block of the bundle, where the shards differ in length
    (uneven N; ``seq_shapes``); None: every block has this rank's shapes.

    Step s holds the block of ``ring.owner(s)`` (flat ring: rank (rank - s)
    mod G). The transfers that bring the next blocks are posted before
    computing on the current one (double buffering; with ``ring.overlap``
    off they are waited for first). ``on_block`` returns this rank's
    contribution to the visiting block's accumulator (``acc``), or None.

    Failure. If ``on_block`` raises on this rank, the rank stops computing but
    keeps taking part in every remaining transfer of both rings (it forwards
    the blocks and accumulators it holds and adds no contribution), so its
    peers are never left waiting on it; then the original exception is raised
    here. The peers complete the ring and are not told (their results lack
    this rank's contribution): the caller, e.g. the experiment harness, learns
    of the failure from the failing rank. If communication itself fails (or
    an interrupt arrives), the transfers in flight are waited for (errors
    ignored) before the error is raised, so no posted operation is left
    behind; the peers then fail or time out in their next transfer.
    """
    error: Exception | None = None
    pending: dict[str, Pending] = {}
    try:
        for step in range(ring.size):
            for name in ring.bundle_posts(step):
                assert name not in pending, f"read channel {name!r} already has a transfer in flight"
                pending[name] = ring.post(ring.read[name], bundle, phase, kinds,
                                          shapes(ring.src_owner(name, step)) if shapes else None)
            contrib = None
            if error is None:
                try:
                    contrib = on_block(step, ring.owner(step), bundle)
                except Exception as e:  # noqa: BLE001 - re-raised after the ring completes
                    error = e
                    contrib = None
            if acc is not None:
                acc.push(step, contrib)
            if step < ring.size - 1:
                bundle = pending.pop(ring.bundle_source(step)).wait()
        result = acc.finish() if acc is not None else None
    except BaseException:
        for p in pending.values():
            p.drain()
        if acc is not None:
            acc.drain()
        raise
    if error is not None:
        raise error
    return result


def seq_shapes(tensors: Sequence[Tensor], seq_dims: Sequence[int], lengths: Sequence[int]
               ) -> Callable[[int], list] | None:
    """``owner -> shapes`` of ``tensors``' block held by ``owner``, whose sequence dimension (``seq_dims``,
    e.g. 1 for (B, S, Z, d), 2 for lse (B, Z, S)) is ``lengths[owner]`` long; None when all lengths are equal
    (every block then has this rank's shapes)."""
    if len(set(lengths)) <= 1:
        return None
    base = [list(t.shape) for t in tensors]

    def shapes(owner: int) -> list:
        out = []
        for shape, dim in zip(base, seq_dims):
            shape = list(shape)
            shape[dim] = lengths[owner]
            out.append(shape)
        return out
    return shapes
