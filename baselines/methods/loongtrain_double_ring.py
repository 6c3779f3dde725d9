"""LoongTrain's double ring (Gu et al. 2024, "LoongTrain"): ``loongtrain_double_ring``.

BurstEngine's main table and attention-only benchmark compare against it. Its
forward is ``burst_double_ring``'s (K, V circulate on the double ring:
intra-node rings of I ranks while the next round's block crosses to the rank
of the same local index on the next node); its backward is the key/value
side's, as in every context-parallel ring that does not circulate the query
side: K, V and the fp32 dK, dV accumulators travel the same double ring
(``burst_attn_func(..., backward="ring", topology="double")``), so against
``burst_double_ring`` it sends 4 d-wide tensors backward instead of Q, dO,
dQ and the two per-row floats.

Bytes per (phase, kind) are ``ring``'s; per link class every rank sends
E*(I-1)/(G-1) of them intra-node and (E-1)/(G-1) inter-node (E nodes of I
ranks). On one node, or with one rank per node, it is ``ring``.
"""
from __future__ import annotations

from burst_impl.layout import LAYOUT_NAMES
from burst_impl.method import Method, Schedule, no_overlap

from .burst import _burst_fn, ring_family_memory
from .burst_double_ring import double_ring_formulas

ORDER = 80     # after every older method: registry order sets the figures' colours


LOONGTRAIN_DOUBLE_RING = Method(
    name="loongtrain_double_ring", colour=14, marker=">", layouts=LAYOUT_NAMES, level="op", masks=True,
    fn=_burst_fn("ring"),
    options={"topology": "double"}, operator_backward="ring", schedule=Schedule("ring", {"default": "ring"}),
    memory_bytes=ring_family_memory, **double_ring_formulas("ring"),
    description="LoongTrain's double ring: K/V circulate on the double ring forward and backward, with the "
                "fp32 dK, dV accumulators",
    travels="fwd: K, V; bwd: K, V + dK, dV ring (fp32), on the double ring",
    external="LoongTrain / InternEvo (double-ring context parallelism), not wrapped",
)

METHODS = (LOONGTRAIN_DOUBLE_RING, no_overlap(LOONGTRAIN_DOUBLE_RING))
