"""Closed-form communication volume of the ring schemes, in bytes sent per rank.

Notation as in PAPER.md: B batch, N global sequence, G ranks, Z query heads,
Zkv key/value heads, d head dim, e bytes per input element, f bytes per
element of the travelling gradient accumulators (4: fp32 by default).
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
"""
from __future__ import annotations

FP32 = 4


def stats_size(elem_size: int) -> int:
    """Bytes per lse/delta element: fp64 (8) for fp64 inputs, fp32 (4) otherwise."""
    return 8 if elem_size == 8 else FP32


def _blocks(batch: int, seqlen: int, world_size: int) -> int:
    """Rows of all the blocks one rank sends of one tensor: (G-1) * B * N/G."""
    if seqlen % world_size:
        raise ValueError(f"seqlen={seqlen} must be divisible by world_size={world_size}")
    return (world_size - 1) * batch * (seqlen // world_size)


def forward_bytes(batch, seqlen, heads, kv_heads, head_dim, world_size, elem_size) -> dict[str, int]:
    rows = _blocks(batch, seqlen, world_size)
    kv = rows * kv_heads * head_dim * elem_size
    return {"k": kv, "v": kv}


def burst_backward_bytes(batch, seqlen, heads, kv_heads, head_dim, world_size, elem_size,
                         grad_elem_size=FP32) -> dict[str, int]:
    rows = _blocks(batch, seqlen, world_size)
    qd = rows * heads * head_dim
    return {
        "q": qd * elem_size,
        "dout": qd * elem_size,
        "lse": rows * heads * stats_size(elem_size),
        "delta": rows * heads * stats_size(elem_size),
        "dq": qd * grad_elem_size,
    }


def ring_backward_bytes(batch, seqlen, heads, kv_heads, head_dim, world_size, elem_size,
                        grad_elem_size=FP32) -> dict[str, int]:
    rows = _blocks(batch, seqlen, world_size)
    kv = rows * kv_heads * head_dim
    return {"k": kv * elem_size, "v": kv * elem_size,
            "dk": kv * grad_elem_size, "dv": kv * grad_elem_size}


BACKWARD_BYTES = {"burst": burst_backward_bytes, "ring": ring_backward_bytes}


def expected_bytes(batch, seqlen, heads, kv_heads, head_dim, world_size, elem_size,
                   backward="burst", grad_elem_size=FP32) -> dict[tuple[str, str], int]:
    """``{(phase, kind): bytes}`` one rank sends for one forward + backward."""
    args = (batch, seqlen, heads, kv_heads, head_dim, world_size, elem_size)
    out = {("forward", k): v for k, v in forward_bytes(*args).items()}
    out.update({("backward", k): v
                for k, v in BACKWARD_BYTES[backward](*args, grad_elem_size=grad_elem_size).items()})
    return {k: v for k, v in out.items() if v}


def cheaper_backward(batch, seqlen, heads, kv_heads, head_dim, world_size, elem_size,
                     grad_elem_size=FP32) -> str:
    """The backward scheme that sends fewer bytes; ties go to "burst".

    Per token: burst moves Z*(d*(2e+f) + 8) bytes, ring moves Zkv*d*(2e+2f).
    For MHA burst always wins; with GQA (Z >= about 2*Zkv) ring wins.
    """
    args = (batch, seqlen, heads, kv_heads, head_dim, world_size, elem_size)
    b = sum(burst_backward_bytes(*args, grad_elem_size=grad_elem_size).values())
    r = sum(ring_backward_bytes(*args, grad_elem_size=grad_elem_size).values())
    if b == r == 0:  # G == 1: decide by the per-token cost so the choice is stable
        b = heads * (head_dim * (2 * elem_size + grad_elem_size) + 2 * stats_size(elem_size))
        r = kv_heads * head_dim * (2 * elem_size + 2 * grad_elem_size)
    return "burst" if b <= r else "ring"
