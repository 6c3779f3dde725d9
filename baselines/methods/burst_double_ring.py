"""BurstAttention on the topology-aware double ring (docs/papers.md §2, §4): ``burst_double_ring``.

The operator ``burst_impl.burst_attn_func`` with ``topology="double"``
(``burst_impl.topology.DoubleRing``): an intra-node ring over the I ranks of
each node runs I-1 steps while the block of the next round crosses to the
rank of the same local index on the next node, so a pass waits E-1 times on
the inter-node link (E nodes), each wait overlapped with a round of I
steps, instead of once per step as the flat ring's slowest hop does. Forward
K, V; backward as ``burst`` (``backward="auto"``: the query side with the
dQ accumulator, or K, V with dK, dV when that sends fewer bytes).

The nodes come from ``node_size=`` (ranks per node) or ``LOCAL_WORLD_SIZE``;
on one node, or with one rank per node, the double ring is the flat ring and
the call falls back to it (the counters' note "burst.topology" says so).
Bytes per (phase, kind) are ``burst``'s; per link class every rank sends
E*(I-1)/(G-1) of them intra-node and (E-1)/(G-1) inter-node.
``burst_double_ring_no_overlap`` waits for every transfer before computing.
"""
from __future__ import annotations

from burst_impl.layout import LAYOUT_NAMES

from burst_impl.method import Method, Schedule, no_overlap
from .burst import _burst_fn, burst_bytes, burst_link_bytes, ring_family_memory

ORDER = 5


def double_ring_formulas(backward: str) -> dict:
    """``comm_bytes`` and ``link_bytes`` of the operator with ``backward`` on the double ring (per rank:
    they differ between ranks only with uneven shards)."""
    return dict(
        comm_bytes=lambda s, rank=0, node_size=None, **_: burst_bytes(s, backward, rank, "double", node_size),
        link_bytes=lambda s, rank, node_size, **_: burst_link_bytes(s, rank, node_size, backward, topology="double"))


BURST_DOUBLE_RING = Method(
    name="burst_double_ring", colour=4, marker="D", layouts=LAYOUT_NAMES, level="op", masks=True, fn=_burst_fn("auto"),
    options={"topology": "double"}, operator_backward="auto", schedule=Schedule("ring", {"default": "burst"}),
    memory_bytes=ring_family_memory, **double_ring_formulas("auto"),
    description="BurstAttention on the double ring: intra-node rings, the next round's block crossing "
                "nodes meanwhile (same local rank on the next node)",
    travels="as burst; per rank E(I-1) intra-node and E-1 inter-node sends of each circulating tensor",
)

METHODS = (BURST_DOUBLE_RING, no_overlap(BURST_DOUBLE_RING))
