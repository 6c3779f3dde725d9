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
"""
from __future__ import annotations

import contextlib
from collections import Counter
from typing import Callable, Iterator, Sequence

import torch
import torch.distributed as dist

Tensor = torch.Tensor

PHASES = ("forward", "backward")


class CommCounts(Counter):
    """Bytes sent by this rank, keyed by (phase, kind).

    ``notes`` holds decisions made while counting (e.g. which backward scheme
    ``backward="auto"`` chose), so a result record can state them.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.notes: dict[str, object] = {}

    def total(self) -> int:  # type: ignore[override]
        return int(sum(self.values()))

    def phase(self, phase: str) -> dict[str, int]:
        return {k: v for (p, k), v in self.items() if p == phase}

    def phase_total(self, phase: str) -> int:
        return int(sum(self.phase(phase).values()))

    def as_dict(self) -> dict[str, int]:
        """Flat ``{"phase/kind": bytes}``, handy for JSON records."""
        return {f"{p}/{k}": int(v) for (p, k), v in sorted(self.items())}


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


def record(phase: str, kind: str, nbytes: int) -> None:
    """Add ``nbytes`` sent by this rank to every active counter."""
    if phase not in PHASES:
        raise ValueError(f"phase={phase!r} must be one of {PHASES}")
    for c in _active:
        c[(phase, kind)] += int(nbytes)


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


# ---------------------------------------------------------------- opt-in cross-rank shape check

_check_shapes = False


class check_shapes:
    """Turn the cross-rank shape check of every ring / all-to-all method on or off.

    A rank cannot see from its own shard that another rank holds a shard of a
    different length (e.g. N=10 over 3 ranks split 4/3/3): each rank's local
    checks pass and the first transfer then hangs until the process-group
    timeout. With the check on, the shared input validation
    (``burst_impl.attention.check_inputs``) all-gathers every rank's shapes
    and dtype (14 integers per rank, not counted by ``count_bytes``: it is a
    check, not the method's traffic) before the first send, and every rank
    raises the same ValueError if they differ, or if any rank's inputs failed
    its local checks. Off by default (it is one extra collective per call);
    the experiment worker turns it on.

        comm.check_shapes(True)            # from now on
        with comm.check_shapes(True): ...  # inside the block only
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


def agree_on_inputs(group, signature: Sequence[int], problem: Exception | None, describe: Callable[[list[int]], str]
                    ) -> None:
    """All-gather ``signature`` (ints) and this rank's validation outcome over ``group``; ValueError
    on every rank unless every rank passed and all signatures are equal. Not counted."""
    _, size = world(group)
    if size == 1:
        return
    device = torch.device("cpu")
    if dist.get_backend(group) == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    mine = torch.tensor([0 if problem is None else 1, *signature], dtype=torch.int64, device=device)
    every = [torch.empty_like(mine) for _ in range(size)]
    dist.all_gather(every, mine, group=group)
    rows = [t.cpu().tolist() for t in every]
    bad = [r for r, row in enumerate(rows) if row[0]]
    if bad and problem is None:
        raise ValueError(f"inputs rejected on rank(s) {bad} of the group (see the ValueError there); "
                         "nothing was sent")
    if not bad and any(row != rows[0] for row in rows):
        per_rank = "; ".join(f"rank {r}: {describe(row[1:])}" for r, row in enumerate(rows))
        raise ValueError(f"local shapes or dtypes differ across the ranks of the group ({per_rank}); every "
                         "rank must hold a shard of the same shape (the global sequence must split evenly)")


# ---------------------------------------------------------------- ring point-to-point


class Ring:
    """Neighbour exchange on a ring over ``group``: send to rank+1, receive from rank-1.

    ``start(tensors, phase, kinds)`` posts the sends and receives of one ring
    step as a single ``batch_isend_irecv`` and returns a ``Pending`` whose
    ``wait()`` gives the received tensors. The caller computes on the current
    block while the next one travels (double buffering). Sends and receives of
    one step are posted together in one batch, so every rank posts the same
    sequence of operations and no ordering of blocking calls can deadlock,
    whatever the parity of the world size. Tensors of any strides are sent
    as contiguous copies (no copy when already contiguous).
    """

    def __init__(self, group=None):
        self.group = group
        self.rank, self.size = world(group)
        self.next = global_rank(group, (self.rank + 1) % self.size)
        self.prev = global_rank(group, (self.rank - 1) % self.size)

    def start(self, tensors: Sequence[Tensor], phase: str, kinds: Sequence[str]) -> "Pending":
        tensors = [t.contiguous() for t in tensors]
        recv = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors]
        ops = []
        for t, r, kind in zip(tensors, recv, kinds):
            ops.append(dist.P2POp(dist.isend, t, self.next, self.group))
            ops.append(dist.P2POp(dist.irecv, r, self.prev, self.group))
            record(phase, kind, nbytes(t))
        reqs = dist.batch_isend_irecv(ops)
        return Pending(reqs, recv, keep=[op.tensor for op in ops])


class Pending:
    def __init__(self, reqs, recv, keep):
        self._reqs, self._recv, self._keep = reqs, recv, keep

    def wait(self) -> list[Tensor]:
        for r in self._reqs:
            r.wait()
        self._keep = None
        return self._recv

    def drain(self) -> None:
        """Wait for every request, ignoring their errors (cleanup after a failure)."""
        for r in self._reqs:
            try:
                r.wait()
            except Exception:  # noqa: BLE001 - the original error is what gets reported
                pass
        self._keep = None


def _drain(pending: "Pending | None") -> None:
    if pending is not None:
        pending.drain()


class AccumulatorRing:
    """Gradient accumulators that follow a circulating bundle and end at its owner.

    The owner's own contribution (step 0) stays home. From step 1 the
    accumulator for the visiting block is this rank's contribution plus what
    the previous rank accumulated for the same block (sent at its step s-1);
    it is then sent on. After the last step it is one hop from its owner,
    which receives it in ``finish``. G-1 sends per rank in all.
    Contributions are full-size (``like``'s shapes) or None (no work at that step).
    """

    def __init__(self, ring: Ring, kinds: Sequence[str], like: Sequence[Tensor], dtype, acc_dtype=torch.float32):
        self.ring, self.kinds, self.dtype, self.acc_dtype = ring, kinds, dtype, acc_dtype
        self.like = like
        self.own: list[Tensor] | None = None
        self.pending: Pending | None = None

    def push(self, step: int, grads: list[Tensor] | None) -> None:
        """This rank's contribution to the block visiting at ``step`` (None: no work)."""
        if step == 0:
            self.own = grads
            return
        incoming = self.pending.wait() if self.pending is not None else None
        self.pending = None
        if incoming is None:
            acc = [g.to(self.dtype) for g in grads] if grads is not None else \
                [torch.zeros_like(t, dtype=self.dtype) for t in self.like]
        else:
            acc = incoming if grads is None else [a.add_(g) for a, g in zip(incoming, grads)]
        self.pending = self.ring.start(acc, "backward", self.kinds)

    def finish(self) -> list[Tensor]:
        """Totals for this rank's own block, in ``acc_dtype``."""
        own = self.own if self.own is not None else [torch.zeros_like(t, dtype=self.acc_dtype) for t in self.like]
        own = [o.to(self.acc_dtype) for o in own]
        if self.pending is not None:
            for o, r in zip(own, self.pending.wait()):
                o.add_(r.to(self.acc_dtype))
            self.pending = None
        return own

    def drain(self) -> None:
        _drain(self.pending)
        self.pending = None


def circulate(ring: Ring, bundle: list[Tensor], phase: str, kinds: Sequence[str],
              on_block: Callable[[int, int, list[Tensor]], list[Tensor] | None],
              acc: AccumulatorRing | None = None) -> list[Tensor] | None:
    """Visit the G blocks of ``bundle``: ``on_block(step, owner, tensors)``; returns ``acc.finish()``.

    Step s holds the block of rank (rank - s) mod G. The next block's
    transfer is posted before computing on the current one (double buffering).
    ``on_block`` returns this rank's contribution to the visiting block's
    accumulator (``acc``, a second ring), or None.

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
    pending: Pending | None = None
    try:
        for step in range(ring.size):
            pending = ring.start(bundle, phase, kinds) if step < ring.size - 1 else None
            contrib = None
            if error is None:
                try:
                    contrib = on_block(step, (ring.rank - step) % ring.size, bundle)
                except Exception as e:  # noqa: BLE001 - re-raised after the ring completes
                    error = e
                    contrib = None
            if acc is not None:
                acc.push(step, contrib)
            if pending is not None:
                bundle = pending.wait()
                pending = None
        result = acc.finish() if acc is not None else None
    except BaseException:
        _drain(pending)
        if acc is not None:
            acc.drain()
        raise
    if error is not None:
        raise error
    return result
