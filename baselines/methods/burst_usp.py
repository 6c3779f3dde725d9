"""BurstEngine's Burst-USP (docs/papers.md §2 and §4): ``burst_usp``.

Ulysses inside the node, our Burst ring across nodes: ``usp``'s grid
(``baselines.methods.usp``; u consecutive ranks per all-to-all group, the
ring over the ranks with the same index in their group) with two choices
bound. The Ulysses degree is the GPUs per node when the group spans several
nodes (docs/papers.md §4, "Burst-USP": "The Ulysses degree equals the GPUs per node (8)",
or the largest divisor of it that splits the heads, ``usp.default_ulysses_degree``);
on one node it is ``usp``'s one-node default. The ring's backward is the
query side's (``backward="burst"``: Q, dO, lse, delta circulate and dQ comes
home; K, V, dK, dV stay), forced rather than chosen by bytes, because it is
the backward Burst-USP is built on. The ring is the double ring where the ring
group has >= 2 ranks per node (u < I), else the flat ring (noted): with
u = I every ring rank is on its own node.

Sequence-level checkpointing. Burst-USP's backward starts from (O, lse), so
``checkpoint: seq``/``whole`` cache them for it as they do for ``burst``
(``Method.cached_attention``, ``UspCache``): the cached forward is USP's
with the ring's lse sent back through one more all-to-all (``a2a_lse``: one
fp32 per row and query head); the backward from the cache sends q, k, v, O
and lse to head shards again (the block recompute of ``full`` sends q, k, v
and O too), runs the ring's backward from (O, lse) (``burst_attn_backward``)
and sends dq, dk, dv back. Under ``whole`` the ring's forward never runs
again; under ``seq`` it runs on the first halves only. A ring degree of 1
(``ulysses_degree`` = G > 1: pure Ulysses, no ring) has no Burst ring to
cache: ValueError.

``burst_usp_no_overlap`` waits for every ring transfer before computing.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from burst_impl import burst_attn_func, comm
from burst_impl.attention import burst_attn_backward
from burst_impl.collectives import all_to_all_
from burst_impl.layout import group_layout, lengths
from burst_impl.method import Method, Schedule, no_overlap
from burst_impl.nodes import Nodes
from burst_impl import reorder
from burst_impl.topology import check_transport

from . import usp
from .ulysses import check_ulysses

ORDER = 41      # after usp, whose grid and formulas it binds
BACKWARD = "burst"     # the query-side backward (module docstring)
Tensor = torch.Tensor


def _degree_of(q, k, group, ulysses_degree, node_size) -> int:
    if ulysses_degree is not None:
        return ulysses_degree
    four_d = all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (q, k))   # else usp's checks name it
    return usp.default_ulysses_degree(comm.world(group)[1], q.shape[2], k.shape[2],
                                      Nodes.of(group, node_size)) if four_d else 1


def _fn(q, k, v, *, group=None, ulysses_degree=None, node_size=None, ring_topology="double", **kw):
    if "backward" in kw:
        raise ValueError(f"backward={kw['backward']!r}: burst_usp binds the query-side backward "
                         f"({BACKWARD!r}); usp takes backward=")
    return usp.usp_attn_func(q, k, v, group=group, ulysses_degree=_degree_of(q, k, group, ulysses_degree, node_size),
                             node_size=node_size, ring_topology=ring_topology, backward=BACKWARD, **kw)


# ---------------------------------------------------------------- the cache hook (seq / whole checkpointing)


@dataclass(frozen=True)
class _Grid:
    """One rank's place in the USP grid for one call, settled (and agreed) before any byte is sent."""

    u: int
    ring_group: object
    uly_group: object
    uly_nodes: Nodes
    ring_nodes: Nodes
    ring_layout: object
    perm: object              # gathered -> ring-level layout order (None: identity)
    sizes: list | None        # members' shard lengths where they differ
    rep: int                  # kv-head replication before the all-to-all
    mask: object
    n: int


def _grid(q, k, v, *, causal, layout, group, opts: dict) -> _Grid:
    g, G = comm.world(group)
    u, r = usp.check_degrees(G, _degree_of(q, k, group, opts.get("ulysses_degree"), opts.get("node_size")))
    if r == 1 and G > 1:
        raise ValueError(f"ulysses_degree={u} = the group size {G}: burst_usp without a ring (pure Ulysses) "
                         "has no Burst ring whose (O, lse) sequence-level checkpointing could cache; "
                         "use checkpoint 'full' or a smaller ulysses_degree")
    topology, overlap = opts.get("ring_topology", "double"), opts.get("overlap", True)
    rep, the_mask, layout, n = check_ulysses(
        q, k, v, layout, u, G, opts.get("softmax_scale"), opts.get("backend"), group, causal, opts.get("mask"),
        method="burst_usp", options=dict(ulysses_degree=u, ring_topology=topology, overlap=overlap))
    i, j = divmod(g, u)
    members = tuple(i * u + m for m in range(u))
    nodes = Nodes.of(group, opts.get("node_size"))
    ring_nodes = nodes.sub([m * u + j for m in range(r)])
    check_transport(ring_nodes, topology, overlap)
    uly_group, ring_group = usp.subgroups(group, u)
    ring_layout = group_layout(layout, G, u, n)
    perm = reorder.gather_perm(layout, G, n, members, i, r, ring_layout) if u > 1 else None
    sizes = [lengths(layout, G, n)[m] for m in members]
    return _Grid(u, ring_group, uly_group, nodes.sub(list(members)), ring_nodes, ring_layout, perm,
                 None if len(set(sizes)) == 1 else sizes, rep, the_mask, n)


def _to_heads(x: Tensor, grid: _Grid, phase: str, kind: str) -> Tensor:
    """(B, S, z, ...) sequence shard -> (B, sum S_j, z/u, ...) in ring-level layout order."""
    if grid.u == 1:
        return x
    y = all_to_all_(x, 2, 1, grid.uly_group, phase, kind, grid.uly_nodes, gather_sizes=grid.sizes)
    return reorder.apply(y, grid.perm)


def _to_seq(y: Tensor, grid: _Grid, phase: str, kind: str) -> Tensor:
    if grid.u == 1:
        return y
    y = reorder.apply(y, None if grid.perm is None else reorder.inverse(grid.perm))
    return all_to_all_(y, 1, 2, grid.uly_group, phase, kind, grid.uly_nodes, scatter_sizes=grid.sizes)


def _kv(k: Tensor, v: Tensor, rep: int) -> tuple[Tensor, Tensor]:
    return (k, v) if rep == 1 else (k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2))


@dataclass
class UspCache:
    """``Method.cached_attention`` of ``burst_usp``: its forward -> (O, lse) and its backward from them,
    on sequence shards (B, S, Z, d), lse (B, Z, S); no autograd (``burst_impl.model.checkpoint``)."""

    causal: bool
    layout: str
    group: object = None
    options: dict = field(default_factory=dict)

    def _ring_kw(self, grid: _Grid) -> dict:
        o = self.options
        return dict(mask=grid.mask, softmax_scale=o.get("softmax_scale"), group=grid.ring_group,
                    layout=grid.ring_layout, backward=BACKWARD, backend=o.get("backend"),
                    topology=o.get("ring_topology", "double"), node_size=grid.ring_nodes,
                    overlap=o.get("overlap", True), seqlen=grid.n)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, layout: str) -> tuple[Tensor, Tensor]:
        grid = _grid(q, k, v, causal=self.causal, layout=layout, group=self.group, opts=self.options)
        k, v = _kv(k, v, grid.rep)
        qh, kh, vh = (_to_heads(x, grid, "forward", f"a2a_{n}") for x, n in ((q, "q"), (k, "k"), (v, "v")))
        with comm.check_shapes(False):    # the whole group agreed in _grid
            oh, lseh = burst_attn_func(qh, kh, vh, return_lse=True, **self._ring_kw(grid))
        out = _to_seq(oh, grid, "forward", "a2a_out")
        lse = _to_seq(lseh.transpose(1, 2), grid, "forward", "a2a_lse").transpose(1, 2).contiguous()
        return out, lse

    def backward(self, dout, q, k, v, out, lse) -> tuple[Tensor, Tensor, Tensor]:
        grid = _grid(q, k, v, causal=self.causal, layout=self.layout, group=self.group, opts=self.options)
        zkv = k.shape[2]
        k, v = _kv(k, v, grid.rep)
        qh, kh, vh, oh, doh = (_to_heads(x, grid, "backward", f"a2a_{n}")
                               for x, n in ((q, "q"), (k, "k"), (v, "v"), (out, "out"), (dout, "dout")))
        lseh = _to_heads(lse.transpose(1, 2), grid, "backward", "a2a_lse").transpose(1, 2).contiguous()
        with comm.check_shapes(False):
            dqh, dkh, dvh = burst_attn_backward(doh, qh, kh, vh, oh, lseh, **self._ring_kw(grid))
        dq, dk, dv = (_to_seq(x, grid, "backward", f"a2a_{n}") for x, n in ((dqh, "dq"), (dkh, "dk"), (dvh, "dv")))
        if grid.rep > 1:   # each kv head's replicas' gradients sum to its own
            b, s, _, d = dk.shape
            dk, dv = (x.view(b, s, zkv, grid.rep, d).sum(3) for x in (dk, dv))
        return dq, dk, dv


def _cache(*, causal, layout, group, options) -> UspCache:
    return UspCache(causal=causal, layout=layout, group=group, options=dict(options))


# ---------------------------------------------------------------- closed forms and registry entry


def _bytes(s, ulysses_degree=None, node_size=None, rank=0, ring_topology="double", **_) -> dict:
    return usp.usp_comm_bytes(s, usp._degree(s, ulysses_degree, node_size), BACKWARD, rank, ring_topology, node_size)


def _links(s, rank, node_size=None, ulysses_degree=None, ring_topology="double", **_) -> dict:
    return usp.usp_link_bytes(s, rank, node_size, ulysses_degree=ulysses_degree, backward=BACKWARD,
                              ring_topology=ring_topology)


BURST_USP = Method(
    name="burst_usp", colour=20, marker="H", level="op", fn=_fn, masks=True,
    layouts=("contiguous", "zigzag", "balanced"), comm_bytes=_bytes, link_bytes=_links,
    memory_bytes=lambda s, ulysses_degree=None, node_size=None, **_: usp.usp_memory_bytes(
        s, usp._degree(s, ulysses_degree, node_size)),
    check=usp._check, schedule=Schedule("usp", {"method": "burst_usp"}), cached_attention=_cache,
    fresh_output=lambda s, ulysses_degree=None, node_size=None, **_: usp._degree(s, ulysses_degree, node_size) > 1,
    description="BurstEngine's Burst-USP: Ulysses inside the node (degree = ranks per node), Burst ring "
                "across nodes with the query-side backward (double ring where it has >= 2 ranks per node); "
                "seq/whole checkpointing caches its (O, lse)",
    travels="Ulysses all-to-alls (a2a_*) within the node + Burst ring over G/u ranks: fwd K, V; "
            "bwd Q, dO, lse, delta + dQ ring",
)

METHODS = (BURST_USP, no_overlap(BURST_USP))
