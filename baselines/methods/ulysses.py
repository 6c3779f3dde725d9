"""DeepSpeed-Ulysses sequence parallelism (docs/papers.md §1, "Communication volume per layer").

Each rank holds a sequence shard (B, N/G, Z, d) of q and (B, N/G, Zkv, d) of
k, v. An all-to-all turns sequence shards into head shards (B, N, Z/G, d):
every rank then runs ordinary attention over the whole sequence for its Z/G
heads with the shared local kernels, and a second all-to-all turns the output
back into a sequence shard. Backward mirrors it: dout goes through the
transposed all-to-all, dq, dk, dv come back through theirs.

Grouped-query attention. The query heads of one rank must find their key/value
head on the same rank. With Zkv divisible by G, k and v are split like q
(rank r gets kv heads r*Zkv/G...). With Zkv < G and G divisible by Zkv, each
kv head is replicated G/Zkv times *before* the all-to-all, so rank r receives
exactly kv head r*Zkv/G, the one its Z/G query heads use; the replicas' bytes
really travel and are counted (k, v each move B*N/G*G*d elements per rank
instead of B*N/G*Zkv*d), and autograd sums the replicas' gradients. Any other
Zkv, or Z not divisible by G, is a ValueError before any communication.

Layouts. The all-to-all gathers the G shards in rank order. For ``zigzag``
that is chunk order (0, 2G-1, 1, 2G-2, ...), so the gathered tokens are put
back into position order by a local permutation (``burst_impl.reorder``) before
attention, and permuted back after; no extra bytes travel.

``ulysses_core`` is shared with USP (``baselines.usp``), where the all-to-all
runs inside a sub-group and attention over the gathered sequence is a ring.
"""
from __future__ import annotations

from typing import Callable

import torch

from burst_impl import comm, volume
from burst_impl.attention import validate_call
from burst_impl.layout import LAYOUT_NAMES, lengths
from burst_impl.nodes import Nodes, formula_nodes
from burst_impl.shape import AttnShape

from burst_impl import reorder
from burst_impl.collectives import all_to_all
from burst_impl.local import local_attn
from burst_impl.method import Method, Schedule

ORDER = 30
Tensor = torch.Tensor


def kv_replication(heads: int, kv_heads: int, degree: int) -> int:
    """How many copies of each kv head enter the all-to-all over ``degree`` ranks.

    ValueError (naming the rule) when heads cannot be split over ``degree``.
    """
    if heads % degree:
        raise ValueError(f"heads={heads} must be divisible by the Ulysses degree {degree} "
                         "(each rank takes heads/degree query heads)")
    if kv_heads % degree == 0:
        return 1
    if degree % kv_heads == 0:
        return degree // kv_heads
    raise ValueError(f"kv_heads={kv_heads} must be divisible by the Ulysses degree {degree}, "
                     f"or divide it (then each kv head is replicated degree/kv_heads times)")


def check_ulysses(q: Tensor, k: Tensor, v: Tensor, layout, degree: int, world_size: int,
                  softmax_scale, backend: str | None = None, group=None, causal: bool = False, mask=None, *,
                  method: str = "ulysses", options: dict | None = None, seqlen: int | None = None,
                  checks: tuple = ()):
    """All checks before any communication (``validate_call``: the ranks agree, N) -> (kv replication
    factor, resolved mask, resolved layout, N). The head rule (``kv_replication``) is checked before
    the agreement, so that a rank with other heads is named by it rather than crashing the all-to-all."""
    call = validate_call(q, k, v, layout=layout, softmax_scale=softmax_scale, backend=backend, group=group,
                         causal=causal, mask=mask, method=method, options=options, seqlen=seqlen,
                         checks=(*checks, lambda: kv_replication(q.shape[2], k.shape[2], degree)))
    return kv_replication(q.shape[2], k.shape[2], degree), call.mask, call.layout, call.seqlen


def ulysses_core(q: Tensor, k: Tensor, v: Tensor, *, rep: int, a2a_group, members: tuple[int, ...],
                 world_size: int, layout, inner_rank: int, inner_size: int,
                 inner: Callable[[Tensor, Tensor, Tensor], Tensor], prefix: str = "", inner_layout=None,
                 nodes: Nodes | None = None, seqlen: int | None = None) -> Tensor:
    """Sequence shard -> head shard, ``inner`` attention, head shard -> sequence shard.

    q (B, S, Z, d), k/v (B, S, Zkv, d) with S = N/world_size; ``members`` are
    the sequence-group ranks of the all-to-all group in its rank order;
    the gathered sequence is reordered to the ``inner_layout`` shard of
    ``inner_rank`` of ``inner_size`` (the ring level; for pure Ulysses, inner
    size 1: position order, where any mask applies as is).
    ``nodes``: the node map of ``a2a_group`` (link classes of the counted bytes). ``seqlen``: the
    global N (default seq_local x world_size); where the members' shards differ in length the
    all-to-alls take split sizes along the sequence (``layout.lengths``).
    """
    seqlen = q.shape[1] * world_size if seqlen is None else seqlen
    perm = reorder.gather_perm(layout, world_size, seqlen, members, inner_rank, inner_size, inner_layout)
    sizes = [lengths(layout, world_size, seqlen)[m] for m in members]   # S_j of each member j
    sizes = None if len(set(sizes)) == 1 else sizes
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)  # (B, S, Zkv*rep, d)

    def to_heads(x, name):  # (B, S, z, d) -> (B, sum S_j, z/u, d), tokens in inner-layout order
        y = all_to_all(x, 2, 1, a2a_group, kind=prefix + name, grad_kind=prefix + "d" + name, nodes=nodes,
                       gather_sizes=sizes)
        return reorder.apply(y, perm)

    qh, kh, vh = to_heads(q, "q"), to_heads(k, "k"), to_heads(v, "v")
    oh = inner(qh, kh, vh)                                   # (B, sum S_j, Z/u, d)
    oh = reorder.apply(oh, None if perm is None else reorder.inverse(perm))
    return all_to_all(oh, 1, 2, a2a_group, kind=prefix + "out", grad_kind=prefix + "dout",
                      nodes=nodes, scatter_sizes=sizes)  # (B, S, Z, d)


def ulysses_attn_func(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False, mask=None,
                      softmax_scale: float | None = None, group=None, layout="contiguous",
                      backend: str | None = None, node_size: int | None = None, seqlen: int | None = None) -> Tensor:
    """DeepSpeed-Ulysses on local sequence shards (B, N/G, Z, d) -> (B, N/G, Z, d).

    Any mask (``burst_impl.masks``): after the all-to-all every rank holds the whole sequence in
    position order for its heads, so the mask applies as over a single device (mask-agnostic).
    ``node_size`` (ranks per node; None: ``LOCAL_WORLD_SIZE``, else one node) sets the
    link class of the counted all-to-all pieces."""
    rank, G = comm.world(group)
    rep, the_mask, layout, n = check_ulysses(q, k, v, layout, G, G, softmax_scale, backend, group, causal, mask,
                                             options={"node_size": node_size}, seqlen=seqlen)
    nodes = Nodes.of(group, node_size)

    def inner(qh, kh, vh):
        return local_attn(qh, kh, vh, mask=the_mask, softmax_scale=softmax_scale, backend=backend)

    return ulysses_core(q, k, v, rep=rep, a2a_group=group, members=tuple(range(G)), world_size=G,
                        layout=layout, inner_rank=0, inner_size=1, inner=inner, nodes=nodes, seqlen=n)


# ---------------------------------------------------------------- closed forms


def a2a_bytes(s: AttnShape, degree: int, prefix: str = "", rank: int = 0) -> dict[tuple[str, str], int]:
    """Bytes rank ``rank`` sends in the four forward and four backward all-to-alls over ``degree`` ranks
    (its group: ranks ``degree * (rank // degree)`` ..., as in USP; all G for Ulysses): ``a2a_link_bytes``
    summed over link classes. Even shards: (degree-1)/degree of the local buffer, B*(N/G)*z*d elements
    with z = Z for q/out and z = Zkv*rep for k/v."""
    out: dict[tuple[str, str], int] = {}
    for (phase, kind, _), b in a2a_link_bytes(s, degree, prefix, rank, None).items():
        out[(phase, kind)] = out.get((phase, kind), 0) + b
    return out


def a2a_link_bytes(s: AttnShape, degree: int, prefix: str, rank: int, nodes: Nodes | None
                   ) -> dict[tuple[str, str, str], int]:
    """``{(phase, kind, link): bytes}`` of rank ``rank``'s all-to-alls (S_j tokens on member j of its
    group; ``nodes``: the group's node map, None: all "intra"). q, k, v forward and dout backward scatter
    heads: a part of S_rank*z/degree rows to each other member; out forward and dq, dk, dv backward scatter
    the sequence: S_j*z/degree rows to member j."""
    if degree == 1:
        return {}
    zkv = s.kv_heads * kv_replication(s.heads, s.kv_heads, degree)
    base = degree * (rank // degree)
    members = range(base, base + degree)
    me = rank - base
    out: dict[tuple[str, str, str], int] = {}
    for phase, names in (("forward", ("q", "k", "v", "out")), ("backward", ("dq", "dk", "dv", "dout"))):
        for n in names:
            z = zkv if n.lstrip("d") in ("k", "v") else s.heads
            per_row = s.batch * z // degree * s.head_dim * s.elem_size
            heads_side = n in ("q", "k", "v", "dout")
            for j, m in enumerate(members):
                if j == me:
                    continue
                link = "intra" if nodes is None or nodes.node[j] == nodes.node[me] else "inter"
                key = (phase, prefix + n, link)
                out[key] = out.get(key, 0) + per_row * s.lengths[rank if heads_side else m]
    return {k: v for k, v in out.items() if v}


def ulysses_comm_bytes(s: AttnShape, rank: int = 0, **_) -> dict[tuple[str, str], int]:
    return a2a_bytes(s, s.world_size, rank=rank)


def ulysses_link_bytes(s: AttnShape, rank: int, node_size=None, **_) -> dict[tuple[str, str, str], int]:
    return a2a_link_bytes(s, s.world_size, "", rank, formula_nodes(s.world_size, node_size))


def ulysses_memory_bytes(s: AttnShape, **_) -> int:
    # Saved for backward per rank: head-sharded q, out (Z/G heads) and k, v
    # (Zkv*rep/G heads) over all N tokens: the ring family's count with Zkv*rep kv heads.
    return volume.saved_bytes(s, s.kv_heads * kv_replication(s.heads, s.kv_heads, s.world_size))


def _check(s: AttnShape, **_) -> None:
    kv_replication(s.heads, s.kv_heads, s.world_size)


METHODS = (Method(
    name="ulysses", colour=8, marker="v", layouts=LAYOUT_NAMES, level="op", masks=True, fn=ulysses_attn_func,
    comm_bytes=ulysses_comm_bytes,
    memory_bytes=ulysses_memory_bytes, check=_check, link_bytes=ulysses_link_bytes,
    fresh_output=lambda s, **_: True, schedule=Schedule("ulysses"),
    description="DeepSpeed-Ulysses: all-to-all sequence->heads, local attention over N, all-to-all back",
    travels="fwd: all-to-all of Q, K, V, O; bwd: all-to-all of dO, dQ, dK, dV",
    external="DeepSpeed DistributedAttention (deepspeed.sequence.layer)",
),)
