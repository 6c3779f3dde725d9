"""LoongTrain's USP, InternEvo's 2D attention (Gu et al. 2024, "LoongTrain"): ``loongtrain_usp``.

The same Ulysses grid as ``usp``/``burst_usp`` (u consecutive ranks per
all-to-all group: InternEvo's ``head_first=True`` placement; the context
ring over the ranks with the same index in their group), with LoongTrain's
ring across the groups instead of ours: ``loongtrain_double_ring``'s, K and
V circulating forward and backward with the fp32 dK, dV accumulators (its
``operator_backward``, read from that entry, not restated here).

Degrees and ring. docs/papers.md §4 gives Burst-USP's degrees (Ulysses = GPUs per
node) but not LoongTrain-USP's. The authors' harness ran it with head
degree 4 and context degree 8 on 32 GPUs of 8 per node, and with one window
(thunlp/BurstEngine ``evaluation/baselines/InternEvo/exp.sh`` lines 2 and
22: ``cp_size=8`` "is USP", ``HP_SIZE`` = GPUs / ``cp_size``;
``configs/7B_llama2.py`` line 202: ``window_size = cp_size`` when the head
degree is > 1; line 217: ``head_first=True``; docs/memory.md,
"LoongTrain-USP"). One window is one inner ring over the whole context
group: a flat ring. InternEvo's own documented example of the
configuration (``doc/code-docs/source/parallel.rst``, "2D-Attention":
``head_size=2, context_size=4, window_size=1, head_first=True`` on 8 GPUs)
is a flat ring too. So the defaults here are the authors' run:

* ``ulysses_degree`` (LoongTrain's head degree): on several nodes of I
  ranks, the largest divisor u <= I/2 of I that splits the heads (4 of 8:
  the context ring keeps 2 ranks per node, as in the authors' 32-GPU run;
  on 8 ranks, 2 x 4 nodes, u = 2 is InternEvo's documented example); on
  one node, ``usp``'s one-node default (at most half the group);
* ``ring_topology="flat"``: one window. ``ring_topology="double"`` runs
  LoongTrain's double ring with a window per node (the ring's ranks on one
  node), where the ring has >= 2 ranks per node (else the flat ring, noted).

``loongtrain_usp_no_overlap`` waits for every ring transfer before computing.
"""
from __future__ import annotations

import torch

from burst_impl import comm
from burst_impl.method import Method, Schedule, no_overlap
from burst_impl.nodes import Nodes, formula_nodes

from . import usp
from .loongtrain_double_ring import LOONGTRAIN_DOUBLE_RING

ORDER = 81      # after loongtrain_double_ring, whose ring it runs
BACKWARD = LOONGTRAIN_DOUBLE_RING.operator_backward     # the K/V-circulating backward
TOPOLOGY = "flat"       # one window, as the authors ran it (module docstring)


def default_degree(world_size: int, heads: int, kv_heads: int, node_size: int | Nodes | None = None) -> int:
    """LoongTrain-USP's head degree when none is given (module docstring, "Degrees and ring")."""
    grid = formula_nodes(world_size, node_size).grid()
    if grid is None or grid[0] < 2:
        return usp.default_ulysses_degree(world_size, heads, kv_heads, node_size)
    per_node = grid[1]
    fits = [u for u in range(1, per_node // 2 + 1) if per_node % u == 0 and usp._splits(heads, kv_heads, u)]
    return max(fits, default=1)


def _degree(s, ulysses_degree=None, node_size=None) -> int:
    return ulysses_degree if ulysses_degree is not None else default_degree(s.world_size, s.heads, s.kv_heads,
                                                                            node_size)


def _fn(q, k, v, *, group=None, ulysses_degree=None, node_size=None, ring_topology=TOPOLOGY, **kw):
    if "backward" in kw:
        raise ValueError(f"backward={kw['backward']!r}: loongtrain_usp binds LoongTrain's K/V backward "
                         f"({BACKWARD!r}); usp takes backward=")
    if ulysses_degree is None:
        four_d = all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (q, k))   # else usp's checks name it
        ulysses_degree = default_degree(comm.world(group)[1], q.shape[2], k.shape[2],
                                        Nodes.of(group, node_size)) if four_d else 1
    return usp.usp_attn_func(q, k, v, group=group, ulysses_degree=ulysses_degree, node_size=node_size,
                             ring_topology=ring_topology, backward=BACKWARD, **kw)


def _check(s, ulysses_degree=None, node_size=None, **_) -> None:
    usp._check(s, ulysses_degree=_degree(s, ulysses_degree, node_size))


LOONGTRAIN_USP = Method(
    name="loongtrain_usp", colour=22, marker="d", level="op", fn=_fn, masks=True,
    layouts=("contiguous", "zigzag", "balanced"),
    comm_bytes=lambda s, ulysses_degree=None, node_size=None, rank=0, ring_topology=TOPOLOGY, **_:
        usp.usp_comm_bytes(s, _degree(s, ulysses_degree, node_size), BACKWARD, rank, ring_topology, node_size),
    link_bytes=lambda s, rank, node_size=None, ulysses_degree=None, ring_topology=TOPOLOGY, **_:
        usp.usp_link_bytes(s, rank, node_size, ulysses_degree=_degree(s, ulysses_degree, node_size),
                           backward=BACKWARD, ring_topology=ring_topology),
    memory_bytes=lambda s, ulysses_degree=None, node_size=None, **_: usp.usp_memory_bytes(
        s, _degree(s, ulysses_degree, node_size)),
    check=_check, schedule=Schedule("usp", {"method": "loongtrain_usp", "ring_topology": TOPOLOGY}),
    fresh_output=lambda s, ulysses_degree=None, node_size=None, **_: _degree(s, ulysses_degree, node_size) > 1,
    description="LoongTrain-USP (InternEvo 2D attention): Ulysses over half a node's ranks (head_first), "
                "LoongTrain's K/V ring over the context group, one window (flat) as the authors ran it",
    travels="Ulysses all-to-alls (a2a_*) within u ranks + K/V ring over G/u ranks: fwd K, V; "
            "bwd K, V + dK, dV ring (fp32)",
    external="LoongTrain / InternEvo (2D attention, head x context parallelism), not wrapped",
)

METHODS = (LOONGTRAIN_USP, no_overlap(LOONGTRAIN_USP))
