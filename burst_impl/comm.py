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
from typing import Iterator, Sequence

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
    """Count the bytes this rank sends inside the block (nestable)."""
    counts = CommCounts()
    _active.append(counts)
    try:
        yield counts
    finally:
        _active.remove(counts)


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
    """(rank, world size) in ``group``; (0, 1) when torch.distributed is not initialised."""
    if not dist.is_available() or not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def global_rank(group, group_rank: int) -> int:
    if group is None or group is dist.group.WORLD:
        return group_rank
    return dist.get_global_rank(group, group_rank)


# ---------------------------------------------------------------- ring point-to-point


class Ring:
    """Neighbour exchange on a ring over ``group``: send to rank+1, receive from rank-1.

    ``start(tensors, phase, kinds)`` posts the sends and receives of one ring
    step as a single ``batch_isend_irecv`` and returns a ``Pending`` whose
    ``wait()`` gives the received tensors. The caller computes on the current
    block while the next one travels (double buffering). Sends and receives of
    one step are posted together in one batch, so every rank posts the same
    sequence of operations and no ordering of blocking calls can deadlock,
    whatever the parity of the world size.
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
