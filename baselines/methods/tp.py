"""Megatron-LM tensor parallelism for the attention layer (docs/papers.md §3, "TP V1 / V3").

TP splits weights, not the sequence: rank r owns query heads
[r*Z/G, (r+1)*Z/G) (columns of W_q), the kv heads they use (columns of W_k,
W_v) and the matching rows of W_o, and computes attention of its heads over
the whole sequence with the shared local kernels.

* ``tp_v1`` (Megatron V1): the input X (B, N, H) is replicated. "f" before
  the column-parallel QKV projection is the identity forward and an
  all-reduce of dX backward; "g" after the row-parallel output projection is
  an all-reduce of the partial outputs forward and the identity backward.
* ``tp_v3`` (Megatron V3, sequence parallel): the input is a sequence shard
  (B, N/G, H) of ``layout``. An all-gather builds X before the projection
  (backward: reduce-scatter of dX) and a reduce-scatter of the partial outputs
  returns a sequence shard (backward: all-gather of dY). For zigzag the
  gathered tokens are permuted into position order locally (no bytes).

GQA: with Zkv divisible by G each rank owns Zkv/G kv heads; with G divisible
by Zkv a rank's query heads all use kv head r*Zkv/G, so that head's W_k, W_v
columns are replicated on G/Zkv ranks (as Megatron does when there are fewer
query groups than ranks); otherwise ValueError.

Bytes per rank (H = Z*d, e bytes per element), forward and backward each:
V1: all-reduce of B*N*H: 2 (G-1)/G BNH e. V3: all-gather of B*N/G*H plus
reduce-scatter of B*N*H: 2 (G-1)/G BNH e. Same volume; V3 keeps N/G tokens
of activations outside attention instead of N.
"""
from __future__ import annotations

import torch

from burst_impl import comm, masks, volume
from burst_impl.layout import LAYOUTS, check_even, check_layout
from burst_impl.nodes import Nodes, formula_nodes
from burst_impl.shape import AttnShape

from burst_impl import reorder
from burst_impl.collectives import all_gather, all_reduce_backward, all_reduce_forward, reduce_scatter
from burst_impl.local import local_attn
from burst_impl.method import Method, Schedule

ORDER = 50

Tensor = torch.Tensor


def tp_heads(heads: int, kv_heads: int, world_size: int, rank: int) -> tuple[list[int], list[int]]:
    """(query heads, kv heads) owned by ``rank``; ValueError naming the rule."""
    G = world_size
    if heads % G:
        raise ValueError(f"heads={heads} must be divisible by the tensor-parallel size {G}")
    if heads % kv_heads:
        raise ValueError(f"heads={heads} must be a multiple of kv_heads={kv_heads}")
    zq = heads // G
    qh = list(range(rank * zq, (rank + 1) * zq))
    if kv_heads % G == 0:
        zk = kv_heads // G
        return qh, list(range(rank * zk, (rank + 1) * zk))
    if G % kv_heads == 0:
        return qh, [rank * kv_heads // G]
    raise ValueError(f"kv_heads={kv_heads} must be divisible by the tensor-parallel size {G} or divide it")


def head_columns(head_ids: list[int], head_dim: int) -> torch.Tensor:
    """Indices of the projection columns (or W_o rows) of ``head_ids``."""
    return torch.cat([torch.arange(h * head_dim, (h + 1) * head_dim) for h in head_ids])


def _attend(x, wq, wk, wv, wo, head_dim, causal, softmax_scale, backend, mask=None):
    """x (B, N, H) in position order -> partial y (B, N, H) from this rank's heads (before the reduction)."""
    b, n, _ = x.shape
    q = (x @ wq).view(b, n, -1, head_dim)     # (B, N, Z/G, d)
    k = (x @ wk).view(b, n, -1, head_dim)     # (B, N, Zkv/G, d)
    v = (x @ wv).view(b, n, -1, head_dim)
    o = local_attn(q, k, v, causal=causal, softmax_scale=softmax_scale, backend=backend, mask=mask)
    return o.reshape(b, n, -1) @ wo           # (B, N, H), partial sum over heads


def tp_v1_forward(x: Tensor, wq: Tensor, wk: Tensor, wv: Tensor, wo: Tensor, *, head_dim: int,
                  causal: bool = False, softmax_scale: float | None = None, group=None,
                  layout: str = "contiguous", backend: str | None = None, mask=None,
                  node_size: int | None = None) -> Tensor:
    """Megatron V1 attention layer: x (B, N, H) replicated -> y (B, N, H) replicated.

    ``wq`` (H, Z/G*d), ``wk``/``wv`` (H, Zkv'/G*d), ``wo`` (Z/G*d, H): this rank's slices.
    ``layout`` is accepted for a uniform signature; the sequence is not split.
    ``node_size`` (ranks per node; None: ``LOCAL_WORLD_SIZE``) sets the link class of the counted bytes.
    """
    check_layout(layout)
    masks.resolve(causal, mask, x.shape[1])   # ValueError before any communication
    nodes = Nodes.of(group, node_size)
    x = all_reduce_backward(x, group, grad_kind="dx", nodes=nodes)
    y = _attend(x, wq, wk, wv, wo, head_dim, causal, softmax_scale, backend, mask)
    return all_reduce_forward(y, group, kind="out", nodes=nodes)


def tp_v3_forward(x: Tensor, wq: Tensor, wk: Tensor, wv: Tensor, wo: Tensor, *, head_dim: int,
                  causal: bool = False, softmax_scale: float | None = None, group=None,
                  layout: str = "contiguous", backend: str | None = None, mask=None,
                  node_size: int | None = None) -> Tensor:
    """Megatron V3 (sequence-parallel) attention layer: x (B, N/G, H) ``layout`` shard -> y (B, N/G, H)."""
    _, G = comm.world(group)
    n = x.shape[1] * G
    check_even(n, layout, G, who="tp_v3", name="global seqlen (x.shape[1]*G)")
    masks.resolve(causal, mask, n)            # ValueError before any communication
    nodes = Nodes.of(group, node_size)
    perm = reorder.gather_perm(layout, G, n, tuple(range(G)), 0, 1)
    xg = reorder.apply(all_gather(x, 1, group, kind="x", grad_kind="dx", nodes=nodes), perm)   # (B, N, H) in order
    y = _attend(xg, wq, wk, wv, wo, head_dim, causal, softmax_scale, backend, mask)
    y = reorder.apply(y, None if perm is None else reorder.inverse(perm))          # rank-shard order
    return reduce_scatter(y, 1, group, kind="out", grad_kind="dout", nodes=nodes)  # (B, N/G, H)


# ---------------------------------------------------------------- closed forms


def tp_region_bytes(full: int, world_size: int, version: str) -> dict[tuple[str, str], int]:
    """Bytes one rank sends around one TP region (f/g for V1, all-gather/reduce-scatter for V3)
    whose full activation (B, N, H) is ``full`` bytes, for one forward + backward."""
    G = world_size
    if G == 1:
        return {}
    if version == "v1":
        ar = 2 * full * (G - 1) // G
        return {("forward", "out"): ar, ("backward", "dx"): ar}
    part = full * (G - 1) // G
    return {("forward", "x"): part, ("forward", "out"): part, ("backward", "dx"): part,
            ("backward", "dout"): part}


def tp_comm_bytes(s: AttnShape, version: str) -> dict[tuple[str, str], int]:
    full = s.batch * s.seqlen * s.heads * s.head_dim * s.elem_size   # B*N*H*e, H = Z*d
    return tp_region_bytes(full, s.world_size, version)


def tp_link_bytes(s: AttnShape, rank: int, node_size, version: str) -> dict[tuple[str, str, str], int]:
    """Ring collectives over the group: all of a rank's bytes on its hop to the next rank."""
    return volume.split_by_link(tp_comm_bytes(s, version), volume.ring_hops(formula_nodes(s.world_size, node_size),
                                                                             rank))


def tp_memory_bytes(s: AttnShape, version: str) -> int:
    """Activation bytes per rank kept for backward by one attention layer (a model).

    The (gathered) input X (B, N, H) kept for the weight gradients, this
    rank's q, k, v, attention output (before and after reshaping, counted
    once) over all N tokens, and lse (fp32). The paper's Table 1 adds BZN^2/G
    for TP without FlashAttention; our local kernels never materialise scores.
    """
    _, kv = tp_heads(s.heads, s.kv_heads, s.world_size, 0)
    zq = s.heads // s.world_size
    n = s.batch * s.seqlen
    return n * (s.heads * s.head_dim + (2 * zq + 2 * len(kv)) * s.head_dim) * s.elem_size + n * zq * 4


def _check(s: AttnShape, **_) -> None:
    tp_heads(s.heads, s.kv_heads, s.world_size, 0)
    check_even(s.seqlen, s.layout, s.world_size, who="tensor parallelism")


METHODS = (
    Method(
        name="tp_v1", colour=16, marker="*", layouts=LAYOUTS, level="layer", masks=True, fn=tp_v1_forward,
        comm_bytes=lambda s, **_: tp_comm_bytes(s, "v1"), memory_bytes=lambda s, **_: tp_memory_bytes(s, "v1"),
        link_bytes=lambda s, rank, node_size, **_: tp_link_bytes(s, rank, node_size, "v1"),
        check=_check, layer_input="replicated", tp_version="v1", schedule=Schedule("tp", {"version": "v1"}),
        description="Megatron TP V1 attention layer: column-parallel QKV, row-parallel output, all-reduce",
        travels="fwd: all-reduce of the layer output (B, N, H); bwd: all-reduce of dX",
    ),
    Method(
        name="tp_v3", colour=12, marker="p", layouts=LAYOUTS, level="layer", masks=True, fn=tp_v3_forward,
        comm_bytes=lambda s, **_: tp_comm_bytes(s, "v3"), memory_bytes=lambda s, **_: tp_memory_bytes(s, "v3"),
        link_bytes=lambda s, rank, node_size, **_: tp_link_bytes(s, rank, node_size, "v3"),
        check=_check, tp_version="v3", schedule=Schedule("tp", {"version": "v3"}),
        description="Megatron TP V3 (sequence parallel) attention layer: all-gather before, reduce-scatter after",
        travels="fwd: all-gather of X, reduce-scatter of the output; bwd: reduce-scatter of dX, all-gather of dY",
    ),
)

