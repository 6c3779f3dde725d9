"""RingAttention as the BurstAttention paper measured it: Li et al. 2021 ring self-attention.

Each rank materialises its N/G x N rows of scores and probabilities, which is
the point of this baseline: its memory is O(B Z N^2 / G) and it shows up in
measurements.

Forward (two rings):
  1. K travels G-1 hops; at each step S[:, :, :, cols_j] = Q_i K_j^T * scale
     fills the (B, Z, N/G, N) score rows (fp32), then the mask (``burst_impl.masks``
     over the global token positions of ``layout``; a row with no live key
     gets P = 0) and a softmax give P, kept for backward
     in the input dtype.
  2. V travels G-1 hops; O_i = sum_j P[..., cols_j] V_j.
Backward (as Li et al. / ColossalAI's RingQK, RingAV):
  1. V travels again: dP[..., cols_j] = dO_i V_j^T, and this rank's share of
     every dV_j, P[..., cols_j]^T dO_i, goes into a full-length (B, N, Zkv, d)
     buffer;
  2. dS = P * (dP - rowsum(dP * P));
  3. K travels again: dQ_i += dS[..., cols_j] K_j * scale, and this rank's
     share of every dK_j, dS[..., cols_j]^T Q_i * scale, into a second buffer;
  4. the full-length dK and dV buffers are all-reduced (fp32 by default) and
     each rank keeps its own rows.
Per rank: forward K, V (G-1)/G*B*N*Zkv*d each; backward K, V the same plus two
all-reduces of B*N*Zkv*d (2(G-1)/G of it each): 6 (G-1)/G BNZd elements for
MHA, (G-1)/G times the paper's 6BZNd.
"""
from __future__ import annotations

import torch

from burst_impl import comm, volume
from burst_impl.attention import circulate, validate_call
from burst_impl.nodes import Nodes, formula_nodes
from burst_impl.heads import expand_kv, fold_kv
from burst_impl.layout import LAYOUT_NAMES, lengths, offsets, positions
from burst_impl.masks import Full
from burst_impl.kernels import default_scale, stats_dtype

from burst_impl.collectives import all_reduce_
from burst_impl.method import Method, Schedule, no_overlap

ORDER = 20
Tensor = torch.Tensor


def _heads(x: Tensor, z: int, dtype=torch.float32) -> Tensor:
    """(B, S, Zkv, d) -> (B, S, Z, d) in ``dtype`` (fp32, fp64 for fp64 inputs), repeating each kv head."""
    return expand_kv(x.to(dtype), z)


def _masked_out(mask, layout, rank, G, n, device) -> Tensor:
    """(S, N) True where the mask hides the key from the query (columns in owner-block order)."""
    qpos = positions(layout, rank, G, n)
    kpos = torch.cat([positions(layout, j, G, n) for j in range(G)])  # column order: owner blocks
    return (~mask.allowed(qpos, kpos)).to(device)


class _RingSelfAttn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, scale, group, layout, grad_dtype, nodes, overlap, seqlen):
        ring = comm.Ring(group, nodes=nodes, overlap=overlap)
        b, s, z, d = q.shape
        G, acc = ring.size, stats_dtype(q.dtype)          # fp32, fp64 for fp64 inputs
        lens, offs = lengths(layout, G, seqlen), offsets(layout, G, seqlen)   # owner j: columns offs[j]..offs[j+1]
        kv_shapes = comm.seq_shapes([k], (1,), lens)
        qf = q.to(acc)
        scores = torch.empty(b, z, s, seqlen, dtype=acc, device=q.device)  # (B, Z, S, N)

        def qk(step, owner, blk):
            scores[..., offs[owner]:offs[owner + 1]] = torch.einsum("bqhd,bkhd->bhqk", qf,
                                                                    _heads(blk[0], z, acc)) * scale

        circulate(ring, [k], "forward", ("k",), qk, shapes=kv_shapes)
        if not isinstance(mask, Full):
            hidden = _masked_out(mask, layout, ring.rank, G, seqlen, q.device)
            scores.masked_fill_(hidden, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        if not isinstance(mask, Full):
            probs.masked_fill_(hidden.all(1).view(1, 1, s, 1), 0.0)   # a row with no live key: 0, not NaN
        probs = probs.to(q.dtype)  # (B, Z, S, N), kept for backward
        scores = None  # free the scores before the V ring (the closure above no longer runs)
        out = torch.zeros(b, s, z, d, dtype=acc, device=q.device)

        def pv(step, owner, blk):
            out.add_(torch.einsum("bhqk,bkhd->bqhd", probs[..., offs[owner]:offs[owner + 1]].to(acc),
                                  _heads(blk[0], z, acc)))

        circulate(ring, [v], "forward", ("v",), pv, shapes=kv_shapes)
        ctx.save_for_backward(q, k, v, probs)
        ctx.cfg = (scale, group, grad_dtype, nodes, overlap, layout, seqlen)
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, probs = ctx.saved_tensors
        scale, group, grad_dtype, nodes, overlap, layout, seqlen = ctx.cfg
        ring = comm.Ring(group, nodes=nodes, overlap=overlap)
        b, s, z, d = q.shape
        zkv, G, acc = k.shape[2], ring.size, stats_dtype(q.dtype)
        lens, offs = lengths(layout, G, seqlen), offsets(layout, G, seqlen)
        kv_shapes = comm.seq_shapes([k], (1,), lens)
        do = dout.to(acc)
        dp = torch.empty(b, z, s, seqlen, dtype=acc, device=q.device)            # (B, Z, S, N)
        dv_all = torch.zeros(b, seqlen, zkv, d, dtype=grad_dtype, device=q.device)  # every rank's dV share
        dk_all = torch.zeros_like(dv_all)

        def with_v(step, owner, blk):
            cols = slice(offs[owner], offs[owner + 1])
            dp[..., cols] = torch.einsum("bqhd,bkhd->bhqk", do, _heads(blk[0], z, acc))
            dv_all[:, cols] = fold_kv(torch.einsum("bhqk,bqhd->bkhd", probs[..., cols].to(acc), do), zkv).to(grad_dtype)

        circulate(ring, [v], "backward", ("v",), with_v, shapes=kv_shapes)
        p = probs.to(acc)
        ds = p * (dp - (dp * p).sum(-1, keepdim=True))  # softmax backward, (B, Z, S, N)
        dp = p = None  # free before the K ring
        qf = q.to(acc)
        dq = torch.zeros(b, s, z, d, dtype=acc, device=q.device)

        def with_k(step, owner, blk):
            cols = slice(offs[owner], offs[owner + 1])
            dq.add_(torch.einsum("bhqk,bkhd->bqhd", ds[..., cols], _heads(blk[0], z, acc)) * scale)
            dk_all[:, cols] = fold_kv(torch.einsum("bhqk,bqhd->bkhd", ds[..., cols], qf) * scale, zkv).to(grad_dtype)

        circulate(ring, [k], "backward", ("k",), with_k, shapes=kv_shapes)
        own = slice(offs[ring.rank], offs[ring.rank + 1])
        dk = all_reduce_(dk_all, group, "backward", "dk", nodes)[:, own]
        dv = all_reduce_(dv_all, group, "backward", "dv", nodes)[:, own]
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), *([None] * 8)


def ring_rsa_attn_func(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False, mask=None,
                       softmax_scale: float | None = None, group=None, layout="contiguous",
                       grad_comm_dtype: torch.dtype | None = None, backend: str | None = None,
                       node_size: int | None = None, overlap: bool = True, seqlen: int | None = None) -> Tensor:
    """Ring self-attention on local shards: q (B, N/G, Z, d), k/v (B, N/G, Zkv, d) -> (B, N/G, Z, d).

    ``backend`` is accepted for a uniform signature and must be None or
    "reference": this method materialises the scores by design (no flash kernel).
    ``node_size`` (ranks per node; None: ``LOCAL_WORLD_SIZE``) sets the link class of
    the counted sends; ``overlap=False`` waits for each ring transfer before computing.
    """
    def check_own():   # before the agreement, so a rank failing them is named on every rank
        if backend not in (None, "reference"):
            raise ValueError(f"backend={backend!r}: ring_rsa materialises its scores with plain matmuls; "
                             "pass None or 'reference'")
        if not isinstance(overlap, bool):
            raise ValueError(f"overlap={overlap!r} must be True or False")

    call = validate_call(q, k, v, layout=layout, softmax_scale=softmax_scale, grad_comm_dtype=grad_comm_dtype,
                         group=group, causal=causal, mask=mask, method="ring_rsa",
                         options=dict(node_size=node_size, overlap=overlap), seqlen=seqlen, checks=(check_own,))
    nodes = Nodes.of(group, node_size)
    # the all-reduced dK, dV: fp32 by default, fp64 for fp64 inputs (end to end)
    grad_dtype = grad_comm_dtype if grad_comm_dtype is not None else stats_dtype(q.dtype)
    return _RingSelfAttn.apply(q, k, v, call.mask, default_scale(q.shape[-1], softmax_scale), group, call.layout,
                               grad_dtype, nodes, overlap, call.seqlen)


# ---------------------------------------------------------------- closed forms


def ring_rsa_comm_bytes(s, grad_elem_size: int | None = None, rank: int = 0, **_) -> dict[tuple[str, str], int]:
    """Bytes of ``rank``; ``grad_elem_size`` of the all-reduced dK, dV (None: 4, 8 for fp64 inputs)."""
    G = s.world_size
    f = grad_elem_size if grad_elem_size is not None else volume.stats_size(s.elem_size)
    kv = s.batch * s.seqlen * s.kv_heads * s.head_dim          # one full-length K (elements)
    # every block but rank+1's (the flat ring): G-1 blocks of N/G rows with even shards
    hop = (kv - s.rank_rows((rank + 1) % G) * s.kv_heads * s.head_dim) * s.elem_size if G > 1 else 0
    ar = 2 * kv * f * (G - 1) // G                             # all-reduce of a full-length buffer
    out = {("forward", "k"): hop, ("forward", "v"): hop, ("backward", "k"): hop, ("backward", "v"): hop,
           ("backward", "dk"): ar, ("backward", "dv"): ar}
    return {k: v for k, v in out.items() if v}


def ring_rsa_link_bytes(s, rank: int, node_size=None, **_) -> dict:
    """Everything on the rank's flat-ring link: the K, V rings and the ring all-reduces."""
    return volume.split_by_link(ring_rsa_comm_bytes(s, rank=rank), volume.ring_hops(
        formula_nodes(s.world_size, node_size), rank))


def ring_rsa_memory_bytes(s, **_) -> int:
    # Kept for backward: P (B, Z, N/G, N) in the input dtype plus the inputs q, k, v.
    rows = s.batch * s.local_seqlen
    return rows * (s.heads * s.seqlen + (s.heads + 2 * s.kv_heads) * s.head_dim) * s.elem_size


RING_RSA = Method(
    name="ring_rsa", colour=6, marker="^", layouts=LAYOUT_NAMES, level="op", masks=True, fn=ring_rsa_attn_func,
    comm_bytes=ring_rsa_comm_bytes, memory_bytes=ring_rsa_memory_bytes, link_bytes=ring_rsa_link_bytes,
    kernel="matmul (materialised scores)", schedule=Schedule("ring_rsa"),
    description="RingAttention as in the BurstAttention paper: Li et al. 2021 ring self-attention, "
                "materialises the (B, Z, N/G, N) scores",
    travels="fwd: K ring then V ring; bwd: V ring, K ring, all-reduce of full-length dK, dV (fp32)",
)

METHODS = (RING_RSA, no_overlap(RING_RSA))
