"""Where the G ranks of a case sit on a hardware profile, and which link each hop uses.

Ranks are placed node-major, as torchrun/SLURM number them: rank g is local
rank g % I of node g // I (I = devices per node). In a flat ring of G = I*E
ranks the hop from local rank I-1 to the next node's local rank 0 is
inter-node, every other hop intra-node.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from ..profiles.hardware import Hardware


@dataclass(frozen=True)
class Placement:
    world_size: int
    per_node: int

    @classmethod
    def of(cls, hw: Hardware, world_size: int) -> "Placement":
        if world_size < 1 or world_size > hw.devices:
            raise ValueError(f"world_size={world_size} must be between 1 and the {hw.devices} devices of "
                             f"hardware profile {hw.name!r} ({hw.nodes} nodes x {hw.devices_per_node})")
        return cls(world_size, hw.devices_per_node)

    def node(self, rank: int) -> int:
        return rank // self.per_node

    @property
    def nodes(self) -> int:
        return self.node(self.world_size - 1) + 1

    def same_node(self, a: int, b: int) -> bool:
        return self.node(a) == self.node(b)

    def crossing(self, hops) -> dict[int, int]:
        """``{node: ranks of that node sending to another node}`` for concurrent (src, dst) hops."""
        return dict(Counter(self.node(s) for s, d in hops if not self.same_node(s, d)))
