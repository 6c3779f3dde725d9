"""Closed forms of the ring family: bytes sent per rank, and activation bytes kept per rank.

Every function takes the problem shape (``burst_impl.shape.AttnShape``).

Notation as in docs/papers.md: B batch, N global sequence, G ranks, Z query heads,
Zkv key/value heads, d head dim, e bytes per input element, f bytes per
element of the travelling gradient accumulators (4: fp32 by default; 8 for fp64
inputs, whose accumulators are fp64: ``grad_elem_size=None``).
Every rank sends G-1 blocks of each circulating tensor (the block it owns
never travels back to it), each block B*(N/G) rows, so the per-rank volume
of a tensor with w values per token is (G-1)/G * B*N*w elements.

Forward (K, V circulate), both schemes:
    k, v:   (G-1)/G * B*N*Zkv*d       elements each, e bytes
Burst backward (query side circulates; K, V, dK, dV stay):
    q, dout:(G-1)/G * B*N*Z*d         elements each, e bytes
    lse, delta: (G-1)/G * B*N*Z       elements each, 4 bytes (fp32; 8 for fp64 inputs)
    dq:     (G-1)/G * B*N*Z*d         elements, f bytes. The accumulator starts on
            the rank after the owner (the owner's own block stays home), makes
            G-2 hops and one final hop home: G-1 sends per rank in all.
Ring backward (key/value side circulates; Q, dO, lse, delta, dQ stay):
    k, v:   (G-1)/G * B*N*Zkv*d       elements each, e bytes
    dk, dv: (G-1)/G * B*N*Zkv*d       elements each, f bytes (same hop pattern as dq)

Per rank, over the whole ring, these are (G-1)/G times the paper's figures
(a factor the paper rounds away): forward 2BZNd; Burst backward 3BZNd + 2BZN
(with f = e); blockwise ring backward 4BZNd (MHA, f = e).

Per link class (``expected_link_bytes``; E nodes of I ranks, node-major).
Every circulating tensor and accumulator makes G-1 sends per rank, split as
``ring_hops`` says:
    flat ring:   all G-1 on the link to the next rank: inter-node for the rank at
                 local index I-1 of each node (when E > 1), intra-node for the others;
    double ring: E*(I-1) intra-node and E-1 inter-node, on every rank
                 (``burst_impl.topology``; E = 1 or I = 1 is the flat ring).

Uneven shards (N not split evenly by the layout; ``AttnShape.lengths``).
Blocks are as long as their owner's shard, so a rank's bytes depend on
which blocks it sends (``ring_sends``): on the flat ring it sends every
block but that of rank+1 (the one it receives last) and the accumulator
of every block but its own. Rows sent per rank:
    circulating tensors: B * (N - S_{rank+1});   accumulators: B * (N - S_rank)
(the double ring: the sum over its schedule's sends, per link class). With
even shards both are (G-1)*B*N/G and every function gives what it gave before.
"""
from __future__ import annotations

from .nodes import Nodes, formula_nodes, ring_links
from .shape import AttnShape
from .topology import DoubleRingSchedule

FP32 = 4


def stats_size(elem_size: int) -> int:
    """Bytes per lse/delta element: fp64 (8) for fp64 inputs, fp32 (4) otherwise."""
    return 8 if elem_size == 8 else FP32


def _table(s: AttnShape, what: str, rows: int, acc_rows: int, grad_elem_size: int | None = None) -> dict[str, int]:
    """Bytes by kind of the forward ("forward") or a backward ("burst", "ring") when the circulating
    blocks one rank sends hold ``rows`` rows in all and the accumulators it sends ``acc_rows``."""
    kv, qd = s.kv_heads * s.head_dim, s.heads * s.head_dim
    grad_elem_size = stats_size(s.elem_size) if grad_elem_size is None else grad_elem_size
    if what == "forward":
        return {"k": rows * kv * s.elem_size, "v": rows * kv * s.elem_size}
    if what == "burst":
        return {"q": rows * qd * s.elem_size, "dout": rows * qd * s.elem_size,
                "lse": rows * s.heads * stats_size(s.elem_size), "delta": rows * s.heads * stats_size(s.elem_size),
                "dq": acc_rows * qd * grad_elem_size}
    return {"k": rows * kv * s.elem_size, "v": rows * kv * s.elem_size, "dk": acc_rows * kv * grad_elem_size,
            "dv": acc_rows * kv * grad_elem_size}


def expected_bytes(s: AttnShape, backward: str = "burst", grad_elem_size: int | None = None, *, rank: int = 0,
                   topology: str = "flat", node_size: int | Nodes | None = None,
                   lengths: tuple[int, ...] | None = None) -> dict[tuple[str, str], int]:
    """``{(phase, kind): bytes}`` rank ``rank`` sends for one forward + backward (every rank the same
    with even shards). ``lengths``: the ranks' shard lengths (default ``s.lengths``)."""
    links = expected_link_bytes(s, backward, grad_elem_size, topology=topology, node_size=node_size,
                                rank=rank, lengths=lengths)
    out: dict[tuple[str, str], int] = {}
    for (phase, kind, _), b in links.items():
        out[(phase, kind)] = out.get((phase, kind), 0) + b
    return out


def ring_sends(nodes: Nodes, rank: int, topology: str = "flat") -> tuple[list, list]:
    """(circulating sends, accumulator sends) of ``rank`` in one pass: lists of (block owner, link class),
    from the transport's schedule (``comm.Ring``, ``topology.DoubleRingSchedule``); G-1 of each."""
    G = nodes.size
    if G == 1:
        return [], []
    grid = nodes.grid() if topology == "double" else None
    if topology == "double" and grid is None:
        raise ValueError(f"topology='double' on {nodes.describe()}: the group must split into equal nodes "
                         "of consecutive ranks")
    if grid is None or grid[0] < 2 or grid[1] < 2:
        link = ring_links(nodes, rank)
        return [((rank - t) % G, link) for t in range(G - 1)], [((rank - t) % G, link) for t in range(1, G)]
    E, I = grid
    plan = DoubleRingSchedule(E, I, rank)
    bundle = [(plan.owner(t), ch) for t in range(G) for ch in plan.bundle_posts(t)]
    acc = [(plan.owner(t), plan.acc_route(t).then) for t in range(1, G) if plan.acc_route(t).then in ("intra", "inter")]
    acc.append((plan.node * I + (plan.local + 1) % I, "intra"))   # acc_finish: the last intra hop, home
    return bundle, acc


def cheaper_backward(s: AttnShape, grad_elem_size: int | None = None) -> str:
    """The backward scheme that sends fewer bytes; ties go to "burst".

    Per token: burst moves Z*(d*(2e+f) + 8) bytes, ring moves Zkv*d*(2e+2f).
    For MHA burst always wins; with GQA (Z >= about 2*Zkv) ring wins.
    """
    e = s.elem_size
    grad_elem_size = stats_size(e) if grad_elem_size is None else grad_elem_size
    b = s.heads * (s.head_dim * (2 * e + grad_elem_size) + 2 * stats_size(e))
    r = s.kv_heads * s.head_dim * (2 * e + 2 * grad_elem_size)
    return "burst" if b <= r else "ring"


def saved_bytes(s: AttnShape, kv_heads: int | None = None) -> int:
    """Activation bytes one rank keeps for backward in the ring family (a model, docs/papers.md §1, Table 1).

    q and out (Z heads) and k, v (``kv_heads``, default Z_kv: Ulysses/USP pass
    their replicated count) in the input dtype, over B*N/G rows' worth of
    elements, plus lse (fp32): about 4BZNd/G + 4BZN/G bytes for MHA. Ulysses
    keeps head shards over all N tokens: the same element count.
    """
    zkv = s.kv_heads if kv_heads is None else kv_heads
    return s.rows * ((2 * s.heads + 2 * zkv) * s.head_dim * s.elem_size + 4 * s.heads)


# ---------------------------------------------------------------- per link class


def ring_hops(nodes: Nodes, rank: int, topology: str = "flat") -> dict[str, int]:
    """``{link class: sends}``: how ``rank``'s G-1 sends of one circulating tensor (or accumulator)
    split over link classes, for a pass over a group on ``nodes`` (``burst_impl.topology``)."""
    G = nodes.size
    if G == 1:
        return {}
    if topology == "double":
        grid = nodes.grid()
        if grid is None:
            raise ValueError(f"topology='double' on {nodes.describe()}: the group must split into equal nodes "
                             "of consecutive ranks")
        E, I = grid
        if E >= 2 and I >= 2:
            return {"intra": E * (I - 1), "inter": E - 1}
    return {ring_links(nodes, rank): G - 1}


def split_by_link(table: dict[tuple[str, str], int], hops: dict[str, int]) -> dict[tuple[str, str, str], int]:
    """``{(phase, kind, link): bytes}``: each entry of ``table`` (bytes of G-1 equal sends) spread
    over the link classes of ``hops`` (``ring_hops``)."""
    total = sum(hops.values())
    out: dict[tuple[str, str, str], int] = {}
    for (phase, kind), b in table.items():
        for link, h in hops.items():
            if b and h:
                out[(phase, kind, link)] = out.get((phase, kind, link), 0) + b * h // total
    return out


def expected_link_bytes(s: AttnShape, backward: str = "burst", grad_elem_size: int | None = None, *,
                        topology: str = "flat", node_size: int | Nodes | None = None, rank: int = 0,
                        lengths: tuple[int, ...] | None = None) -> dict[tuple[str, str, str], int]:
    """``{(phase, kind, link): bytes}`` rank ``rank`` sends for one forward + backward on a ring of
    ``topology`` over ``node_size`` ranks per node (None: ``LOCAL_WORLD_SIZE``, else one node).
    ``lengths``: the ranks' shard lengths (default ``s.lengths``): each block sent is as long as its
    owner's shard (``ring_sends``); with even shards every send is B*N/G rows."""
    nodes = formula_nodes(s.world_size, node_size)
    lens = s.lengths if lengths is None else lengths
    bundle, acc = ring_sends(nodes, rank, topology)
    out: dict[tuple[str, str, str], int] = {}
    for link in sorted({ln for _, ln in bundle + acc}):
        rows = s.batch * sum(lens[o] for o, ln in bundle if ln == link)
        acc_rows = s.batch * sum(lens[o] for o, ln in acc if ln == link)
        for phase, what in (("forward", "forward"), ("backward", backward)):
            for kind, b in _table(s, what, rows, acc_rows, grad_elem_size).items():
                if b:
                    out[(phase, kind, link)] = b
    return out
