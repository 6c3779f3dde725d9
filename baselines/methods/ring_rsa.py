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
from burst_impl.attention import check_inputs, circulate
from burst_impl.nodes import Nodes, formula_nodes
from burst_impl.heads import expand_kv, fold_kv
from burst_impl.layout import LAYOUT_NAMES, positions
from burst_impl.masks import Full
from burst_impl.kernels import default_scale

from burst_impl.collectives import all_reduce_
from burst_impl.method import Method, Schedule, no_overlap

ORDER = 20
Tensor = torch.Tensor


def _heads(x: Tensor, z: int) -> Tensor:
    """(B, S, Zkv, d) -> (B, S, Z, d) fp32, repeating each kv head for its query heads."""
    return expand_kv(x.float(), z)


def _masked_out(mask, layout, rank, G, s, device) -> Tensor:
    """(S, N) True where the mask hides the key from the query (columns in owner-block order)."""
    n = s * G
    qpos = positions(layout, rank, G, n)
    kpos = torch.cat([positions(layout, j, G, n) for j in range(G)])  # column order: owner blocks
    return (~mask.allowed(qpos, kpos)).to(device)


class _RingSelfAttn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, scale, group, layout, grad_dtype, nodes, overlap):
        ring = comm.Ring(group, nodes=nodes, overlap=overlap)
        b, s, z, d = q.shape
        G = ring.size
        qf = q.float()
        scores = torch.empty(b, z, s, G * s, dtype=torch.float32, device=q.device)  # (B, Z, N/G, N)

        def qk(step, owner, blk):
            scores[..., owner * s:(owner + 1) * s] = torch.einsum("bqhd,bkhd->bhqk", qf, _heads(blk[0], z)) * scale

        circulate(ring, [k], "forward", ("k",), qk)
        if not isinstance(mask, Full):
            hidden = _masked_out(mask, layout, ring.rank, G, s, q.device)
            scores.masked_fill_(hidden, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        if not isinstance(mask, Full):
            probs.masked_fill_(hidden.all(1).view(1, 1, s, 1), 0.0)   # a row with no live key: 0, not NaN
        probs = probs.to(q.dtype)  # (B, Z, N/G, N), kept for backward
        scores = None  # free the fp32 scores before the V ring (the closure above no longer runs)
        out = torch.zeros(b, s, z, d, dtype=torch.float32, device=q.device)

        def pv(step, owner, blk):
            out.add_(torch.einsum("bhqk,bkhd->bqhd", probs[..., owner * s:(owner + 1) * s].float(),
                                  _heads(blk[0], z)))

        circulate(ring, [v], "forward", ("v",), pv)
        ctx.save_for_backward(q, k, v, probs)
        ctx.cfg = (scale, group, grad_dtype, nodes, overlap)
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, probs = ctx.saved_tensors
        scale, group, grad_dtype, nodes, overlap = ctx.cfg
        ring = comm.Ring(group, nodes=nodes, overlap=overlap)
        b, s, z, d = q.shape
        zkv, G = k.shape[2], ring.size
        do = dout.float()
        dp = torch.empty(b, z, s, G * s, dtype=torch.float32, device=q.device)   # (B, Z, N/G, N)
        dv_all = torch.zeros(b, G * s, zkv, d, dtype=grad_dtype, device=q.device)  # every rank's dV share
        dk_all = torch.zeros_like(dv_all)

        def with_v(step, owner, blk):
            cols = slice(owner * s, (owner + 1) * s)
            dp[..., cols] = torch.einsum("bqhd,bkhd->bhqk", do, _heads(blk[0], z))
            dv_all[:, cols] = fold_kv(torch.einsum("bhqk,bqhd->bkhd", probs[..., cols].float(), do), zkv).to(grad_dtype)

        circulate(ring, [v], "backward", ("v",), with_v)
        p = probs.float()
        ds = p * (dp - (dp * p).sum(-1, keepdim=True))  # softmax backward, (B, Z, N/G, N)
        dp = p = None  # free before the K ring
        qf = q.float()
        dq = torch.zeros(b, s, z, d, dtype=torch.float32, device=q.device)

        def with_k(step, owner, blk):
            cols = slice(owner * s, (owner + 1) * s)
            dq.add_(torch.einsum("bhqk,bkhd->bqhd", ds[..., cols], _heads(blk[0], z)) * scale)
            dk_all[:, cols] = fold_kv(torch.einsum("bhqk,bqhd->bkhd", ds[..., cols], qf) * scale, zkv).to(grad_dtype)

        circulate(ring, [k], "backward", ("k",), with_k)
        own = slice(ring.rank * s, (ring.rank + 1) * s)
        dk = all_reduce_(dk_all, group, "backward", "dk", nodes)[:, own]
        dv = all_reduce_(dv_all, group, "backward", "dv", nodes)[:, own]
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), *([None] * 7)


def ring_rsa_attn_func(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False, mask=None,
                       softmax_scale: float | None = None, group=None, layout="contiguous",
                       grad_comm_dtype: torch.dtype = torch.float32, backend: str | None = None,
                       node_size: int | None = None, overlap: bool = True) -> Tensor:
    """Ring self-attention on local shards: q (B, N/G, Z, d), k/v (B, N/G, Zkv, d) -> (B, N/G, Z, d).

    ``backend`` is accepted for a uniform signature and must be None or
    "reference": this method materialises the scores by design (no flash kernel).
    ``node_size`` (ranks per node; None: ``LOCAL_WORLD_SIZE``) sets the link class of
    the counted sends; ``overlap=False`` waits for each ring transfer before computing.
    """
    if backend not in (None, "reference"):
        raise ValueError(f"backend={backend!r}: ring_rsa materialises its scores with plain matmuls; "
                         "pass None or 'reference'")
    the_mask, layout = check_inputs(q, k, v, layout=layout, softmax_scale=softmax_scale,
                                    grad_comm_dtype=grad_comm_dtype, group=group, causal=causal, mask=mask)
    if not isinstance(overlap, bool):
        raise ValueError(f"overlap={overlap!r} must be True or False")
    nodes = Nodes.of(group, node_size)
    return _RingSelfAttn.apply(q, k, v, the_mask, default_scale(q.shape[-1], softmax_scale), group, layout,
                               grad_comm_dtype, nodes, overlap)


# ---------------------------------------------------------------- closed forms


def ring_rsa_comm_bytes(s, grad_elem_size: int = 4, **_) -> dict[tuple[str, str], int]:
    G = s.world_size
    kv = s.batch * s.seqlen * s.kv_heads * s.head_dim          # one full-length K (elements)
    hop = kv // G * (G - 1) * s.elem_size                      # G-1 blocks of N/G rows
    ar = 2 * kv * grad_elem_size * (G - 1) // G                # all-reduce of a full-length buffer
    out = {("forward", "k"): hop, ("forward", "v"): hop, ("backward", "k"): hop, ("backward", "v"): hop,
           ("backward", "dk"): ar, ("backward", "dv"): ar}
    return {k: v for k, v in out.items() if v}


def ring_rsa_link_bytes(s, rank: int, node_size=None, **_) -> dict:
    """Everything on the rank's flat-ring link: the K, V rings and the ring all-reduces."""
    return volume.split_by_link(ring_rsa_comm_bytes(s), volume.ring_hops(formula_nodes(s.world_size, node_size),
                                                                         rank))


def ring_rsa_memory_bytes(s, **_) -> int:
    # Kept for backward: P (B, Z, N/G, N) in the input dtype plus the inputs q, k, v.
    rows = s.batch * s.local_seqlen
    return rows * (s.heads * s.seqlen + (s.heads + 2 * s.kv_heads) * s.head_dim) * s.elem_size


RING_RSA = Method(
    name="ring_rsa", layouts=LAYOUT_NAMES, level="op", masks=True, fn=ring_rsa_attn_func,
    comm_bytes=ring_rsa_comm_bytes, memory_bytes=ring_rsa_memory_bytes, link_bytes=ring_rsa_link_bytes,
    kernel="matmul (materialised scores)", schedule=Schedule("ring_rsa"),
    description="RingAttention as in the BurstAttention paper: Li et al. 2021 ring self-attention, "
                "materialises the (B, Z, N/G, N) scores",
    travels="fwd: K ring then V ring; bwd: V ring, K ring, all-reduce of full-length dK, dV (fp32)",
)

METHODS = (RING_RSA, no_overlap(RING_RSA))
