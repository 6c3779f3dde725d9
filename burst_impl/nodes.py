"""Which node each rank of a process group is on, and which link class a hop between two ranks uses.

Two link classes: ``"intra"`` (inside a node: NVLink/PCIe) and ``"inter"``
(between nodes: InfiniBand/RoCE). Ranks are placed node-major, as torchrun and
SLURM place them: global rank = node * LOCAL_WORLD_SIZE + local index. The
node of each rank of a group comes from one of two places (the byte counters
and the topology of a ring take it from the same one):

* an explicit ``node_size`` (ranks of the group per node): group rank i is on
  node i // node_size. This is how tests emulate several nodes inside one
  machine (``node_size=2`` on a world of 4 processes = 2 nodes x 2 ranks);
* otherwise ``LOCAL_WORLD_SIZE`` (set by torchrun on every node): global rank
  g is on node g // LOCAL_WORLD_SIZE. Without it (plain ``python``, or a
  process group built by hand) every rank is on one node.

A flat ring over a group placed node-major crosses nodes on E hops of its G:
the hop from local index I-1 of each node to local index 0 of the next node
(I ranks per node, E nodes). The rank at local index I-1 sends everything it
sends on that ring over the inter-node link; every other rank sends only on
intra-node links. Ring collectives (all-reduce, all-gather, reduce-scatter:
the optimal ring algorithm our counters assume) do the same; an all-to-all
sends each peer its piece directly, so a rank sends (I-1) pieces intra-node
and G-I pieces inter-node.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Sequence

import torch.distributed as dist

LINKS = ("intra", "inter")


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name}={value!r} must be a positive integer (ranks per node)")
    return value


def env_node_size() -> int | None:
    """``LOCAL_WORLD_SIZE`` (processes per node, set by torchrun), or None when unset."""
    raw = os.environ.get("LOCAL_WORLD_SIZE")
    if raw is None or raw == "":
        return None
    try:
        return _positive_int("LOCAL_WORLD_SIZE", int(raw))
    except ValueError:
        raise ValueError(f"LOCAL_WORLD_SIZE={raw!r} must be a positive integer (processes per node)") from None


@dataclass(frozen=True)
class Nodes:
    """The node of each rank of a group: ``node[i]`` for group rank i; ``source`` says where it came from."""

    node: tuple[int, ...]
    source: str = "one node"

    # ------------------------------------------------------------ construction

    @classmethod
    def uniform(cls, world_size: int, node_size: int | None, source: str | None = None) -> "Nodes":
        """``world_size`` ranks, ``node_size`` consecutive ranks per node (None: one node).

        ValueError naming the rule if ``node_size`` does not divide ``world_size``.
        """
        if node_size is None:
            return cls((0,) * world_size, source or "one node")
        _positive_int("node_size", node_size)
        if world_size % node_size:
            raise ValueError(f"node_size={node_size} must divide the world size {world_size} "
                             "(every node holds the same number of ranks)")
        return cls(tuple(i // node_size for i in range(world_size)), source or f"node_size={node_size}")

    @classmethod
    def of(cls, group=None, node_size: "int | Nodes | None" = None) -> "Nodes":
        """Nodes of ``group``'s ranks: from ``node_size`` (group ranks per node; or a ``Nodes`` map of
        the group, as a method passes to its sub-groups) if given, else from ``LOCAL_WORLD_SIZE`` and
        the group's global ranks, else one node."""
        initialised = dist.is_available() and dist.is_initialized()
        ranks = group_ranks(group) if initialised else [0]
        if isinstance(node_size, Nodes):
            if node_size.size != len(ranks):
                raise ValueError(f"node map of {node_size.size} ranks for a group of {len(ranks)} ranks")
            return node_size
        if not initialised:
            return cls.uniform(1, None if node_size is None else _check_single(node_size))
        return cls.of_ranks(ranks, node_size)

    @classmethod
    def of_ranks(cls, ranks: Sequence[int], node_size: int | None = None) -> "Nodes":
        """Nodes of a group of these global ranks (group-rank order): ``node_size`` group ranks per node
        if given, else global rank g on node g // ``LOCAL_WORLD_SIZE``, else one node."""
        if node_size is not None:
            return cls.uniform(len(ranks), node_size)
        local = env_node_size()
        if local is None:
            return cls((0,) * len(ranks), "one node (LOCAL_WORLD_SIZE unset)")
        return cls(tuple(g // local for g in ranks), f"LOCAL_WORLD_SIZE={local}")

    def sub(self, members: Sequence[int]) -> "Nodes":
        """The nodes of a sub-group made of these group ranks (in the sub-group's rank order)."""
        return Nodes(tuple(self.node[m] for m in members), self.source)

    # ------------------------------------------------------------ queries

    @property
    def size(self) -> int:
        return len(self.node)

    @property
    def count(self) -> int:
        """Number of distinct nodes."""
        return len(set(self.node))

    def link(self, a: int, b: int) -> str:
        """Link class of a send from group rank ``a`` to group rank ``b``."""
        return "intra" if self.node[a] == self.node[b] else "inter"

    def same_node(self, a: int) -> int:
        """How many ranks of the group (``a`` included) are on ``a``'s node."""
        return sum(1 for n in self.node if n == self.node[a])

    def grid(self) -> tuple[int, int] | None:
        """(E nodes, I ranks per node) when the group is E runs of I consecutive ranks, one run per
        node (node-major placement, equal nodes); None otherwise."""
        runs: list[list[int]] = []
        for n in self.node:
            if runs and runs[-1][0] == n:
                runs[-1].append(n)
            else:
                runs.append([n])
        sizes = {len(r) for r in runs}
        if len(sizes) != 1 or len({r[0] for r in runs}) != len(runs):
            return None
        return len(runs), sizes.pop()

    def describe(self) -> str:
        grid = self.grid()
        shape = f"{grid[0]} node(s) x {grid[1]} rank(s)" if grid else f"nodes {list(self.node)}"
        return f"{shape} ({self.source})"


def formula_nodes(world_size: int, node_size: "int | Nodes | None" = None) -> Nodes:
    """The nodes a closed form assumes for a group of ``world_size`` ranks: ``node_size`` if given,
    else ``LOCAL_WORLD_SIZE`` with the group taken as global ranks 0..G-1 (what the runtime sees for
    the whole job's group), else one node."""
    if isinstance(node_size, Nodes):
        return node_size
    return Nodes.of_ranks(range(world_size), node_size)


def _check_single(node_size: int) -> int:
    _positive_int("node_size", node_size)
    if node_size != 1:
        raise ValueError(f"node_size={node_size} must divide the world size 1 (no process group: one rank)")
    return node_size


def group_ranks(group=None) -> list[int]:
    """Global ranks of ``group``'s members in group-rank order."""
    if group is None or group is dist.group.WORLD:
        return list(range(dist.get_world_size()))
    return dist.get_process_group_ranks(group)


# ---------------------------------------------------------------- per-link-class split of sends


def ring_links(nodes: Nodes, rank: int) -> str:
    """Link class of ``rank``'s sends on a flat ring (or a ring collective) over ``nodes``, rank order."""
    return nodes.link(rank, (rank + 1) % nodes.size)


def a2a_split(nodes: Nodes, rank: int, piece: int) -> dict[str, int]:
    """What ``rank`` sends in an all-to-all of one ``piece`` per peer, by link class."""
    same = nodes.same_node(rank)
    return {"intra": piece * (same - 1), "inter": piece * (nodes.size - same)}
