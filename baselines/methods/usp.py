"""USP: Ulysses x ring over a 2-D split of the sequence group (BurstEngine's Burst-USP).

The G ranks of ``group`` form a (ring degree r) x (Ulysses degree u) grid,
G = u * r. Sequence-group rank g sits at ring index i = g // u and Ulysses
index j = g % u, so a Ulysses group is u consecutive ranks (one node in
practice: all-to-all over the fast links) and a ring group is the ranks with
the same j, one per node (the ring crosses nodes, PAPER.md §2).

Each rank passes its ``layout`` shard over all G ranks, as for every other
method. The all-to-all inside the Ulysses group gathers the u shards of the
group: with contiguous they form the contiguous shard i of the ring level;
with zigzag, ranks i*u..i*u+u-1 hold chunks i*u..(i+1)*u-1 and their mirror
images, which are exactly ring-level zigzag chunks i and 2r-1-i, so a local
permutation (``baselines.reorder``) gives the ring-level zigzag shard. The
ring part is our BurstAttention (``burst_attn_func``) over the ring group
with the same layout; with r == 1 it is local attention (pure Ulysses), with
u == 1 it is pure Burst.

Sub-groups: ``dist.new_group`` must be called by every process of the default
group in the same order, so the groups are created on first use for each
(sequence group, u) and cached; call ``usp_attn_func`` collectively on every
rank of the job (as with any collective) the first time a degree is used.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from burst_impl import burst_attn_func, comm, volume
from burst_impl.shape import AttnShape

from ..local import local_attn
from ..method import Method
from .ulysses import a2a_bytes, check_ulysses, kv_replication, ulysses_core

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


def usp_attn_func(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False,
                  softmax_scale: float | None = None, group=None, layout: str = "contiguous",
                  ulysses_degree: int | None = None, ring_degree: int | None = None,
                  backward: str = "auto", backend: str | None = None) -> Tensor:
    """USP on local sequence shards (B, N/G, Z, d) -> (B, N/G, Z, d).

    ``ulysses_degree`` u (required) ranks per all-to-all group; the ring
    degree is G/u (``ring_degree``, if given, must agree). ``backward`` is
    the Burst ring's backward scheme ("auto", "burst" or "ring").
    """
    g, G = comm.world(group)
    u, r = check_degrees(G, ulysses_degree, ring_degree)
    rep = check_ulysses(q, k, v, layout, u, G, softmax_scale, backend, group)
    uly_group, ring_group = subgroups(group, u)
    i, j = divmod(g, u)

    def inner(qh, kh, vh):  # (B, N/r, Z/u, d) in ring-level layout order
        if r == 1:
            return local_attn(qh, kh, vh, causal=causal, softmax_scale=softmax_scale, backend=backend)
        return burst_attn_func(qh, kh, vh, causal=causal, softmax_scale=softmax_scale, group=ring_group,
                               layout=layout, backward=backward, backend=backend)

    if u == 1:
        return inner(q, k, v)
    return ulysses_core(q, k, v, rep=rep, a2a_group=uly_group, members=tuple(i * u + m for m in range(u)),
                        world_size=G, layout=layout, inner_rank=i, inner_size=r, inner=inner, prefix="a2a_")


# ---------------------------------------------------------------- closed forms


def usp_comm_bytes(s: AttnShape, ulysses_degree: int, backward: str = "auto") -> dict[tuple[str, str], int]:
    """All-to-all bytes within the Ulysses group plus Burst ring bytes at the ring level."""
    u, r = check_degrees(s.world_size, ulysses_degree)
    out = a2a_bytes(s, u, prefix="a2a_")
    if r > 1:
        # Ring level: r ranks, N/r tokens each, Z/u query heads, Zkv*rep/u kv heads.
        ring = s.replace(heads=s.heads // u, kv_heads=s.kv_heads * kv_replication(s.heads, s.kv_heads, u) // u,
                         world_size=r)
        chosen = volume.cheaper_backward(ring) if backward == "auto" else backward
        for key, b in volume.expected_bytes(ring, backward=chosen).items():
            out[key] = out.get(key, 0) + b
    return {k: v for k, v in out.items() if v}


def usp_memory_bytes(s: AttnShape, ulysses_degree: int) -> int:
    # As Burst/Ulysses: head-sharded q, out, k, v and lse of B*N/G rows' worth of elements.
    u, _ = check_degrees(s.world_size, ulysses_degree)
    return volume.saved_bytes(s, s.kv_heads * kv_replication(s.heads, s.kv_heads, u))


# ---------------------------------------------------------------- registry entry


def default_ulysses_degree(world_size: int, heads: int, kv_heads: int) -> int:
    """USP's Ulysses degree when none is given: the largest divisor u of G with
    u <= min(8, G/2) (at most one 8-GPU node of all-to-all, at least a 2-way
    ring) for which the heads split (``kv_replication``); 1 if none."""
    best = 1
    for u in range(1, min(8, world_size // 2) + 1):
        if world_size % u == 0:
            try:
                kv_replication(heads, kv_heads, u)
            except ValueError:
                continue
            best = u
    return best


def _degree(s: AttnShape, ulysses_degree=None) -> int:
    return default_ulysses_degree(s.world_size, s.heads, s.kv_heads) if ulysses_degree is None else ulysses_degree


def _usp_fn(q, k, v, *, group=None, ulysses_degree=None, **kw):
    if ulysses_degree is None:  # q, k that are not 4-D tensors are left to usp_attn_func's checks
        four_d = all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (q, k))
        ulysses_degree = default_ulysses_degree(comm.world(group)[1], q.shape[2], k.shape[2]) if four_d else 1
    return usp_attn_func(q, k, v, group=group, ulysses_degree=ulysses_degree, **kw)


def _check(s: AttnShape, ulysses_degree=None, **_) -> None:
    u, _r = check_degrees(s.world_size, _degree(s, ulysses_degree))
    kv_replication(s.heads, s.kv_heads, u)


METHODS = (Method(
    name="usp", level="op", fn=_usp_fn,
    comm_bytes=lambda s, ulysses_degree=None, backward="auto", **_: usp_comm_bytes(
        s, _degree(s, ulysses_degree), backward),
    memory_bytes=lambda s, ulysses_degree=None, **_: usp_memory_bytes(s, _degree(s, ulysses_degree)),
    check=_check,
    description="USP / Burst-USP: Ulysses all-to-all inside groups of ulysses_degree ranks, Burst ring across them",
    travels="Ulysses all-to-alls (a2a_*) within u ranks + Burst ring bytes over G/u ranks",
),)
