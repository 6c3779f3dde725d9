"""BurstAttention (docs/papers.md §1) as registry methods: ``burst``, ``burst_qring``, ``burst_no_overlap``.

The implementation is the operator ``burst_impl.burst_attn_func``; these
entries bind its backward scheme: ``burst`` = ``backward="auto"`` (the
query-circulating backward, or the key/value-circulating one when that sends
fewer bytes, e.g. with grouped-query attention), ``burst_qring`` = the
query-circulating backward forced. All run on the flat ring (``topology``
"flat"; ``burst_double_ring`` is the topology-aware one). ``burst_no_overlap``
is ``burst`` with ``overlap=False``: every transfer is waited for before the
step computes, a timing variant that shows what double buffering hides.
"""
from __future__ import annotations

from burst_impl import burst_attn_func, volume
from burst_impl.layout import LAYOUT_NAMES
from burst_impl.shape import AttnShape

from burst_impl.method import Method, Schedule, no_overlap

ORDER = 0


def burst_bytes(s: AttnShape, backward: str = "auto", rank: int = 0, topology: str = "flat", node_size=None,
                **_) -> dict:
    """Bytes of ``rank`` (they differ between ranks only with uneven shards)."""
    chosen = volume.cheaper_backward(s) if backward == "auto" else backward
    return volume.expected_bytes(s, backward=chosen, rank=rank, topology=topology, node_size=node_size)


def burst_link_bytes(s: AttnShape, rank: int, node_size=None, backward: str = "auto", topology: str = "flat",
                     **_) -> dict:
    """Per link class (``volume.expected_link_bytes``) for the ring of ``topology``."""
    chosen = volume.cheaper_backward(s) if backward == "auto" else backward
    return volume.expected_link_bytes(s, chosen, topology=topology, node_size=node_size, rank=rank)


def ring_family_memory(s: AttnShape, **_) -> int:
    """Saved q, out, k, v, lse per rank (``volume.saved_bytes``): the whole ring family's model."""
    return volume.saved_bytes(s)


def _burst_fn(backward: str):
    def fn(q, k, v, *, causal=False, mask=None, softmax_scale=None, group=None, layout="contiguous", **kw):
        return burst_attn_func(q, k, v, causal=causal, mask=mask, softmax_scale=softmax_scale, group=group,
                               layout=layout, backward=backward, **kw)
    fn.__name__ = f"burst_{backward}"
    return fn


BURST = Method(
    name="burst", colour=0, marker="o", layouts=LAYOUT_NAMES, level="op", masks=True, fn=_burst_fn("auto"),
    comm_bytes=lambda s, rank=0, node_size=None, **_: burst_bytes(s, "auto", rank, node_size=node_size),
    memory_bytes=ring_family_memory,
    link_bytes=lambda s, rank, node_size, **_: burst_link_bytes(s, rank, node_size, "auto"),
    operator_backward="auto", schedule=Schedule("ring", {"default": "burst"}),
    description="BurstAttention: K/V ring forward; backward circulates whichever side is cheaper",
    travels="fwd: K, V; bwd: Q, dO, lse, delta + dQ ring (or K, V + dK, dV ring if cheaper)",
)

METHODS = (
    BURST,
    Method(
        name="burst_qring", colour=18, marker="P", layouts=LAYOUT_NAMES, level="op", masks=True, fn=_burst_fn("burst"),
        comm_bytes=lambda s, rank=0, node_size=None, **_: burst_bytes(s, "burst", rank, node_size=node_size),
        memory_bytes=ring_family_memory,
        link_bytes=lambda s, rank, node_size, **_: burst_link_bytes(s, rank, node_size, "burst"),
        operator_backward="burst", schedule=Schedule("ring", {"default": "burst"}),
        description="BurstAttention with the query-circulating backward forced",
        travels="fwd: K, V; bwd: Q, dO, lse, delta + dQ ring",
    ),
    no_overlap(BURST),
)
