"""USP: Ulysses x ring over a 2-D split of the sequence group (BurstEngine's Burst-USP).

The G ranks of ``group`` form a (ring degree r) x (Ulysses degree u) grid,
G = u * r. Sequence-group rank g sits at ring index i = g // u and Ulysses
index j = g % u, so a Ulysses group is u consecutive ranks (one node in
practice: all-to-all over the fast links) and a ring group is the ranks with
the same j, one per node (the ring crosses nodes, docs/papers.md §2).

Each rank passes its ``layout`` shard over all G ranks, as for every other
method. The all-to-all inside the Ulysses group gathers the u shards of the
group: with contiguous they form the contiguous shard i of the ring level;
with zigzag, ranks i*u..i*u+u-1 hold chunks i*u..(i+1)*u-1 and their mirror
images, which are exactly ring-level zigzag chunks i and 2r-1-i, so a local
permutation (``burst_impl.reorder``) gives the ring-level zigzag shard. The
ring part is our BurstAttention (``burst_attn_func``) over the ring group
with the same layout; with r == 1 it is local attention (pure Ulysses), with
u == 1 it is pure Burst.

Node-aware degrees (BurstEngine's Burst-USP, docs/papers.md §2/§4). When the group
spans several nodes of I ranks each (``node_size=``, else ``LOCAL_WORLD_SIZE``;
``burst_impl.nodes``), the default Ulysses degree is u = I, or the largest
divisor of I the heads split over (``kv_replication``): every all-to-all
stays inside a node, on the fast links, and only the ring crosses nodes. Its
ranks are the G/u ranks with the same index j in their Ulysses group, one per
node when u = I (then every ring hop crosses nodes, but each rank's ring sends
are 1/u of a G-rank Burst ring's: Z/u heads over N/r tokens per block), or
I/u per node when u < I, where the ring runs as a double ring
(``ring_topology="double"``, the default; it falls back to the flat ring,
noted, when the ring group has one rank per node or one node). When the
group is one node the default is unchanged: the largest divisor u <= min(8,
G/2) that splits the heads (a ring of at least 2 ranks).

Sub-groups: ``dist.new_group`` must be called by every process of the default
group in the same order, so the groups are created on first use for each
(sequence group, u) and cached; call ``usp_attn_func`` collectively on every
rank of the job (as with any collective) the first time a degree is used.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from burst_impl import burst_attn_func, comm, volume
from burst_impl.layout import group_layout
from burst_impl.nodes import Nodes, formula_nodes
from burst_impl.shape import AttnShape
from burst_impl.topology import check_transport

from burst_impl.local import local_attn
from burst_impl.method import CHUNKED_LAYOUTS, Method, Schedule, no_overlap
from .ulysses import a2a_bytes, a2a_link_bytes, check_ulysses, kv_replication, ulysses_core

ORDER = 40
Tensor = torch.Tensor

_GROUPS: dict[tuple, tuple] = {}


def check_degrees(world_size: int, ulysses_degree, ring_degree=None) -> tuple[int, int]:
    """(u, r) with u * r == world_size, or ValueError naming the rule."""
    if ulysses_degree is None:
        raise ValueError("ulysses_degree=None: USP needs ulysses_degree= (ranks per all-to-all group)")
    u = int(ulysses_degree)
    if u <= 0 or world_size % u:
        raise ValueError(f"ulysses_degree={ulysses_degree} must be a positive divisor of the world size "
                         f"{world_size} (ulysses_degree * ring_degree = world size)")
    r = world_size // u
    if ring_degree is not None and int(ring_degree) != r:
        raise ValueError(f"ulysses_degree={u} x ring_degree={ring_degree} = {u * int(ring_degree)} "
                         f"must equal the world size {world_size}")
    return u, r


def _raise(error: Exception):
    raise error


def _group_ranks(group) -> list[int]:
    if group is None or group is dist.group.WORLD:
        return list(range(dist.get_world_size()))
    return dist.get_process_group_ranks(group)


def subgroups(group, u: int):
    """(ulysses_group, ring_group) of this rank for degree ``u``; created once and cached."""
    _, G = comm.world(group)
    r = G // u
    if u == 1:
        return None, group          # no all-to-all; the ring is the whole group
    if r == 1:
        return group, None          # pure Ulysses; no ring
    ranks = _group_ranks(group)
    key = (tuple(ranks), u)
    if key not in _GROUPS:
        # Every process creates every sub-group in the same order.
        uly = [dist.new_group([ranks[i * u + j] for j in range(u)]) for i in range(r)]
        ring = [dist.new_group([ranks[i * u + j] for i in range(r)]) for j in range(u)]
        _GROUPS[key] = (uly, ring)
    uly, ring = _GROUPS[key]
    g = dist.get_rank(group)
    return uly[g // u], ring[g % u]


def usp_attn_func(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False, mask=None,
                  softmax_scale: float | None = None, group=None, layout="contiguous",
                  ulysses_degree: int | None = None, ring_degree: int | None = None,
                  backward: str = "auto", backend: str | None = None, node_size: int | Nodes | None = None,
                  ring_topology: str = "double", overlap: bool = True, seqlen: int | None = None) -> Tensor:
    """USP on local sequence shards (B, N/G, Z, d) -> (B, N/G, Z, d).

    ``ulysses_degree`` u (required) ranks per all-to-all group; the ring
    degree is G/u (``ring_degree``, if given, must agree). ``backward`` is
    the Burst ring's backward scheme ("auto", "burst" or "ring");
    ``ring_topology`` its ring ("double": the double ring where the ring group
    has >= 2 nodes of >= 2 ranks, else the flat ring; or "flat"); ``overlap``
    as in ``burst_attn_func``. ``node_size``: ranks of ``group`` per node
    (None: ``LOCAL_WORLD_SIZE``, else one node).
    """
    g, G = comm.world(group)
    try:   # a bad degree on one rank is named on every rank by the agreement (checks=), not left to hang it
        u, r = check_degrees(G, ulysses_degree, ring_degree)
        degree_checks: tuple = ()
    except ValueError as e:
        u, r, degree_checks = 1, G, (lambda e=e: _raise(e),)
    opts = dict(ulysses_degree=u, backward=backward, node_size=getattr(node_size, "node", node_size),
                ring_topology=ring_topology, overlap=overlap)
    rep, the_mask, layout, n = check_ulysses(q, k, v, layout, u, G, softmax_scale, backend, group, causal, mask,
                                             method="usp", options=opts, seqlen=seqlen, checks=degree_checks)
    if isinstance(layout, str) and layout not in CHUNKED_LAYOUTS and u > 1 and r > 1:
        raise ValueError(f"layout={layout!r} is not supported by usp with ulysses_degree={u} and ring degree {r}: "
                         "the all-to-all of u consecutive ranks gathers tokens that are not a ring-level "
                         f"{layout} shard; use one of {CHUNKED_LAYOUTS} or balanced")
    i, j = divmod(g, u)
    nodes = Nodes.of(group, node_size)
    uly_nodes, ring_nodes = nodes.sub([i * u + m for m in range(u)]), nodes.sub([m * u + j for m in range(r)])
    check_transport(ring_nodes, ring_topology, overlap)   # before the first all-to-all sends a byte
    uly_group, ring_group = subgroups(group, u)
    ring_layout = group_layout(layout, G, u, n)   # what ring index i holds once its Ulysses group gathered

    def inner(qh, kh, vh):  # (B, N/r, Z/u, d) in ring-level layout order
        if r == 1:
            return local_attn(qh, kh, vh, mask=the_mask, softmax_scale=softmax_scale, backend=backend)
        # the whole group agreed above (check_ulysses): the ring level's inputs follow from agreed ones,
        # so its call skips a second agreement and takes N from it
        with comm.check_shapes(False):
            return burst_attn_func(qh, kh, vh, mask=the_mask, softmax_scale=softmax_scale, group=ring_group,
                                   layout=ring_layout, backward=backward, backend=backend, topology=ring_topology,
                                   node_size=ring_nodes, overlap=overlap, seqlen=n)

    if u == 1:
        return inner(q, k, v)
    return ulysses_core(q, k, v, rep=rep, a2a_group=uly_group, members=tuple(i * u + m for m in range(u)),
                        world_size=G, layout=layout, inner_rank=i, inner_size=r, inner=inner, prefix="a2a_",
                        inner_layout=ring_layout if r > 1 else None, nodes=uly_nodes, seqlen=n)


# ---------------------------------------------------------------- closed forms


def _ring_shape(s: AttnShape, u: int, r: int) -> AttnShape:
    """The ring level: r ranks, N/r tokens each, Z/u query heads, Zkv*rep/u kv heads."""
    return s.replace(heads=s.heads // u, kv_heads=s.kv_heads * kv_replication(s.heads, s.kv_heads, u) // u,
                     world_size=r)


def _ring_lengths(s: AttnShape, u: int, r: int) -> tuple[int, ...]:
    """Tokens of each ring rank once its Ulysses group gathered (the sums of u consecutive shards)."""
    lens = s.lengths
    return tuple(sum(lens[i * u:(i + 1) * u]) for i in range(r))


def usp_comm_bytes(s: AttnShape, ulysses_degree: int, backward: str = "auto", rank: int = 0,
                   ring_topology: str = "double", node_size=None) -> dict[tuple[str, str], int]:
    """All-to-all bytes within the Ulysses group plus Burst ring bytes at the ring level (of ``rank``:
    they differ between ranks only with uneven shards)."""
    u, r = check_degrees(s.world_size, ulysses_degree)
    out = a2a_bytes(s, u, prefix="a2a_", rank=rank)
    if r > 1:
        ring = _ring_shape(s, u, r)
        chosen = volume.cheaper_backward(ring) if backward == "auto" else backward
        i, j = divmod(rank, u)
        nodes = formula_nodes(s.world_size, node_size).sub([m * u + j for m in range(r)])
        for key, b in volume.expected_bytes(ring, backward=chosen, rank=i, topology=ring_topology, node_size=nodes,
                                            lengths=_ring_lengths(s, u, r)).items():
            out[key] = out.get(key, 0) + b
    return {k: v for k, v in out.items() if v}


def usp_link_bytes(s: AttnShape, rank: int, node_size=None, ulysses_degree: int | None = None,
                   backward: str = "auto", ring_topology: str = "double", **_) -> dict[tuple[str, str, str], int]:
    """Per link class: the all-to-alls on the nodes of rank's Ulysses group (ranks i*u..i*u+u-1),
    the ring on the nodes of its ring group (ranks j, u+j, ...) with ``ring_topology``."""
    nodes = formula_nodes(s.world_size, node_size)
    u, r = check_degrees(s.world_size, _degree(s, ulysses_degree, nodes))
    i, j = divmod(rank, u)
    out = a2a_link_bytes(s, u, "a2a_", rank, nodes.sub([i * u + m for m in range(u)]))
    if r > 1:
        ring = _ring_shape(s, u, r)
        chosen = volume.cheaper_backward(ring) if backward == "auto" else backward
        out.update(volume.expected_link_bytes(ring, chosen, topology=ring_topology,
                                              node_size=nodes.sub([m * u + j for m in range(r)]), rank=i,
                                              lengths=_ring_lengths(s, u, r)))
    return out


def usp_memory_bytes(s: AttnShape, ulysses_degree: int) -> int:
    # As Burst/Ulysses: head-sharded q, out, k, v and lse of B*N/G rows' worth of elements.
    u, _ = check_degrees(s.world_size, ulysses_degree)
    return volume.saved_bytes(s, s.kv_heads * kv_replication(s.heads, s.kv_heads, u))


# ---------------------------------------------------------------- registry entry


def _splits(heads: int, kv_heads: int, u: int) -> bool:
    try:
        kv_replication(heads, kv_heads, u)
    except ValueError:
        return False
    return True


def default_ulysses_degree(world_size: int, heads: int, kv_heads: int, node_size: int | Nodes | None = None) -> int:
    """USP's Ulysses degree when none is given.

    Group on several nodes of I ranks (``node_size``, else ``LOCAL_WORLD_SIZE``): the largest
    divisor u of I for which the heads split (``kv_replication``): Ulysses inside a node, the ring
    across nodes. Group on one node (or not split into equal nodes): the largest divisor u of G with
    u <= min(8, G/2) (at most one 8-GPU node of all-to-all, at least a 2-way ring) for which the
    heads split. 1 if none.
    """
    grid = formula_nodes(world_size, node_size).grid()
    if grid is not None and grid[0] >= 2:
        candidates = [u for u in range(1, grid[1] + 1) if grid[1] % u == 0]
    else:
        candidates = [u for u in range(1, min(8, world_size // 2) + 1) if world_size % u == 0]
    return max([u for u in candidates if _splits(heads, kv_heads, u)], default=1)


def _degree(s: AttnShape, ulysses_degree=None, node_size=None) -> int:
    if ulysses_degree is not None:
        return ulysses_degree
    return default_ulysses_degree(s.world_size, s.heads, s.kv_heads, node_size)


def _usp_fn(q, k, v, *, group=None, ulysses_degree=None, node_size=None, **kw):
    if ulysses_degree is None:  # q, k that are not 4-D tensors are left to usp_attn_func's checks
        four_d = all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (q, k))
        ulysses_degree = default_ulysses_degree(comm.world(group)[1], q.shape[2], k.shape[2],
                                                Nodes.of(group, node_size)) if four_d else 1
    return usp_attn_func(q, k, v, group=group, ulysses_degree=ulysses_degree, node_size=node_size, **kw)


def _check(s: AttnShape, ulysses_degree=None, node_size=None, **_) -> None:
    u, _r = check_degrees(s.world_size, _degree(s, ulysses_degree, node_size))
    kv_replication(s.heads, s.kv_heads, u)


USP = Method(
    name="usp", colour=10, marker="h", level="op", fn=_usp_fn, masks=True, layouts=("contiguous", "zigzag", "balanced"),
    comm_bytes=lambda s, ulysses_degree=None, backward="auto", node_size=None, rank=0, ring_topology="double",
    **_: usp_comm_bytes(s, _degree(s, ulysses_degree, node_size), backward, rank, ring_topology, node_size),
    memory_bytes=lambda s, ulysses_degree=None, node_size=None, **_: usp_memory_bytes(
        s, _degree(s, ulysses_degree, node_size)),
    link_bytes=usp_link_bytes, check=_check, schedule=Schedule("usp"),
    # the output all-to-all's result is a new buffer where the Ulysses degree is > 1
    fresh_output=lambda s, ulysses_degree=None, node_size=None, **_: _degree(s, ulysses_degree, node_size) > 1,
    description="USP / Burst-USP: Ulysses all-to-all inside groups of ulysses_degree ranks (a node, when the "
                "group spans nodes), Burst ring across them (double ring where it has >= 2 ranks per node)",
    travels="Ulysses all-to-alls (a2a_*) within u ranks + Burst ring bytes over G/u ranks",
)

METHODS = (USP, no_overlap(USP))
