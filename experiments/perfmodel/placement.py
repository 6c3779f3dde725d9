"""Where the G ranks of a case sit on a hardware profile, and which link each hop uses.

Ranks are placed node-major, as torchrun/SLURM number them: rank g is local
rank g % I of node g // I (I = devices per node). In a flat ring of G = I*E
ranks the hop from local rank I-1 to the next node's local rank 0 is
inter-node, every other hop intra-node. A rank crosses nodes on the NIC the
hardware profile maps its local rank to (``Hardware.nic_of``: ``per_nic``
consecutive local ranks share one).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from ..profiles.hardware import Hardware


@dataclass(frozen=True)
class Placement:
    world_size: int
    per_node: int
    per_nic: int = 1                 # consecutive local ranks behind one NIC

    def __post_init__(self):
        if self.per_nic < 1 or self.per_node % self.per_nic:
            raise ValueError(f"per_nic={self.per_nic} must be >= 1 and divide per_node={self.per_node}")

    @classmethod
    def of(cls, hw: Hardware, world_size: int) -> "Placement":
        if world_size < 1 or world_size > hw.devices:
            raise ValueError(f"world_size={world_size} must be between 1 and the {hw.devices} devices of "
                             f"hardware profile {hw.name!r} ({hw.nodes} nodes x {hw.devices_per_node})")
        return cls(world_size, hw.devices_per_node, hw.ranks_per_nic)

    def node(self, rank: int) -> int:
        return rank // self.per_node

    def nic(self, rank: int) -> tuple[int, int]:
        """(node, NIC of that node) that ``rank`` crosses nodes on."""
        return self.node(rank), (rank % self.per_node) // self.per_nic

    @property
    def nodes(self) -> int:
        return self.node(self.world_size - 1) + 1

    def same_node(self, a: int, b: int) -> bool:
        return self.node(a) == self.node(b)

    def crossing(self, hops) -> dict[tuple[int, int], int]:
        """``{(node, nic): flows leaving through that NIC}`` for concurrent (src, dst) hops: what splits the
        NIC's rate (``CostModel.rate``)."""
        return dict(Counter(self.nic(s) for s, d in hops if not self.same_node(s, d)))
