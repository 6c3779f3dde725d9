"""NCCL-safe channel groups (issue 39, item 5): every rank of a double ring's group creates every
channel group, in one fixed order, at the first ring over the group (before its first send).

No process group: ``torch.distributed`` is replaced, inside ``burst_impl.topology`` only, by a
recording fake that says "nccl", and each rank of a 2 x 2 and a 2 x 3 grid builds its ``DoubleRing``
in turn. A real NCCL group creation waits for every rank that must take part, so two ranks that
create different groups at the same point, or the same groups in another order, hang there; the
test checks what each rank asked for, which is what decides it.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from burst_impl import comm, topology
from burst_impl.nodes import Nodes


class FakeDist:
    """The calls of ``torch.distributed`` that building a ``DoubleRing`` makes, recorded."""

    def __init__(self, size: int, bound: bool, world_ranks: int | None = None):
        self.size, self.world_size = size, world_ranks or size
        self.group = SimpleNamespace(WORLD=SimpleNamespace(bound_device_id="cuda:0" if bound else None))
        self.calls: list[tuple] = []
        self.rank = 0

    def get_backend(self, group=None):
        return "nccl"

    def get_world_size(self, group=None):
        return self.world_size

    def new_group(self, ranks, **kw):
        self.calls.append(("new_group", tuple(ranks), kw.get("use_local_synchronization", False)))
        return ("group", tuple(ranks))

    def split_group(self, parent=None, split_ranks=None, **kw):
        self.calls.append(("split_group", tuple(tuple(s) for s in split_ranks)))
        mine = next(s for s in split_ranks if self.rank in s)
        return ("group", tuple(mine))


def _build_every_rank(monkeypatch, E: int, I: int, bound: bool, world_ranks: int | None = None):
    size = E * I
    fake = FakeDist(size, bound, world_ranks)
    monkeypatch.setattr(topology, "dist", fake)
    monkeypatch.setattr(topology, "group_ranks", lambda group=None: list(range(size)))
    per_rank, rings = [], []
    for rank in range(size):
        topology._SUBGROUPS.clear()   # each rank is its own process: nothing cached from another rank
        fake.rank, fake.calls = rank, []
        monkeypatch.setattr(comm, "world", lambda group=None, _r=rank: (_r, size))
        ring = topology.DoubleRing(None, Nodes.uniform(size, I))
        topology.DoubleRing(None, Nodes.uniform(size, I))      # a second call of the same group
        per_rank.append(fake.calls)
        rings.append(ring)
    topology._SUBGROUPS.clear()
    return per_rank, rings


@pytest.mark.parametrize("E,I", [(2, 2), (2, 3)])
def test_every_rank_creates_every_group_in_one_order(monkeypatch, E, I):
    per_rank, rings = _build_every_rank(monkeypatch, E, I, bound=False)
    nodes = [tuple(n * I + i for i in range(I)) for n in range(E)]
    rails = [tuple(m * I + l for m in range(E)) for l in range(I)]
    want = [("new_group", g, False) for g in nodes + rails]   # the whole world: every rank joins each
    assert per_rank == [want] * (E * I), "a rank created other groups, or in another order, or twice"
    for rank, ring in enumerate(rings):
        node, rail = nodes[rank // I], rails[rank % I]
        assert ring.write["intra"].group == ("group", node)
        assert ring.write["inter"].group == ring.read["inter"].group == ("group", rail)


def test_a_group_smaller_than_the_world_synchronises_its_members_only(monkeypatch):
    per_rank, _ = _build_every_rank(monkeypatch, 2, 2, bound=False, world_ranks=8)
    assert {c[2] for calls in per_rank for c in calls} == {True}
    assert len({tuple(calls) for calls in per_rank}) == 1 and len(per_rank[0]) == 4


def test_a_bound_default_group_splits_the_parent(monkeypatch):
    """Bound to a device, NCCL splits new groups from the default communicator: collective over all of
    its ranks, so the channel groups come from ``split_group`` on the ring's group, nodes then rails."""
    per_rank, rings = _build_every_rank(monkeypatch, 2, 3, bound=True)
    want = [("split_group", ((0, 1, 2), (3, 4, 5))), ("split_group", ((0, 3), (1, 4), (2, 5)))]
    assert per_rank == [want] * 6
    assert rings[4].write["intra"].group == ("group", (3, 4, 5))
    assert rings[4].read["inter"].group == ("group", (1, 4))
