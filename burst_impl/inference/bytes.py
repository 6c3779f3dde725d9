"""Closed forms of the bytes one rank sends in each inference operator (docs/inference.md).

Keyed as ``comm.CommCounts`` is, ``(phase, kind) -> bytes``, with the collectives' conventions of
``burst_impl/comm.py`` (all-gather of n bytes: n (G-1); all-to-all: the pieces for the other
ranks). B sequences, q new tokens, Z query heads of dimension d, Zkv kv heads; ``e_out``: bytes
of an element of q's dtype (partial outputs travel in it), ``e_lse``: of the statistics dtype.
Nothing is sent when G = 1.
"""
from __future__ import annotations


def decode_bytes(merge: str, world_size: int, batch: int, new_tokens: int, heads: int, head_dim: int,
                 e_out: int, e_lse: int) -> dict[tuple[str, str], int]:
    """``decode``: all-gather: (G-1) B q Z (d e_out + e_lse); heads: (G-1) B q (Z/G) (d e_out + e_lse)."""
    g = world_size
    if g == 1:
        return {}
    rows = batch * new_tokens * (heads if merge == "all_gather" else heads // g) * (g - 1)
    return {("forward", "out"): rows * head_dim * e_out, ("forward", "lse"): rows * e_lse}


def _ring_sends(rank: int, lengths: list[int]) -> int:
    """Tokens a rank forwards on a flat ring pass: at hop s < G-1 the block of rank (rank - s) mod G."""
    g = len(lengths)
    return sum(lengths[(rank - s) % g] for s in range(g - 1))


def prefill_bytes(rank: int, lengths: list[int], batch: int, kv_heads: int, head_dim: int,
                  e_kv: int) -> dict[tuple[str, str], int]:
    """``prefill`` (pass-KV, flat ring): each of K and V, sum over the G-1 hops of the forwarded shard's
    tokens x B Zkv d e_kv (``lengths``: every rank's shard length)."""
    if len(lengths) == 1:
        return {}
    per = _ring_sends(rank, lengths) * batch * kv_heads * head_dim * e_kv
    return {("forward", "k"): per, ("forward", "v"): per}


def continue_bytes(rank: int, counts: list[int], batch: int, heads: int, head_dim: int, e_out: int,
                   e_lse: int) -> dict[tuple[str, str], int]:
    """``prefill_continue`` (pass-Q): the query ring, sum over the G-1 hops of the forwarded block's tokens
    x B Z d e_out; then every other rank's partial of its C_j tokens: C_j B Z (d e_out + e_lse)."""
    if len(counts) == 1:
        return {}
    others = sum(counts) - counts[rank]
    return {("forward", "q"): _ring_sends(rank, counts) * batch * heads * head_dim * e_out,
            ("forward", "out"): others * batch * heads * head_dim * e_out,
            ("forward", "lse"): others * batch * heads * e_lse}
