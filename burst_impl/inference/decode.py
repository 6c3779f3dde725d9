"""Context-parallel decode over a sharded KV cache (docs/inference.md, "Decode").

Every rank holds the new tokens' q, k, v (a replicated model computes them on every rank). The
new keys and values go to the ranks the cache's placement names; then each rank attends the q new
queries of every sequence over its own shard (q >= 1: speculative or multi-token decode, causal
among the new tokens through their positions), and the G partial (O, lse) merge by log-sum-exp:

* ``merge="all_gather"``: every rank gathers all partials and merges them: the full output on
  every rank, for a replicated model (vLLM's decode context parallelism);
* ``merge="heads"``: an all-to-all sends rank j the partials of its Z/G query heads, which it
  merges (a reduce-scatter whose reduction is the lse merge): rank j keeps heads
  [j Z/G, (j+1) Z/G), for an output projection that is then tensor-parallel (Helix's layout,
  SGLang's all-to-all backend).

Partial outputs travel in q's dtype, their lse in the statistics dtype (fp32; fp64 for fp64).
Bytes per rank: ``bytes.decode_bytes``.
"""
from __future__ import annotations

import torch

from .. import comm
from ..collectives import all_gather_, all_to_all_
from ..kernels import FLOAT_DTYPES, default_scale
from .agree import agree
from .kv_cache import ShardedKVCache, cache_state, check_cache
from .partial import check_attention_args, decode_all_live, decode_mask, merge_all, partial_attention

Tensor = torch.Tensor
MERGES = ("all_gather", "heads")


def _check(q, k_new, v_new, cache: ShardedKVCache, layer, merge, window, positions, group, softmax_scale,
           backend) -> None:
    check_cache(cache, layer, group)
    if merge not in MERGES:
        raise ValueError(f"merge={merge!r} is unknown; choose one of {MERGES}")
    decode_mask(window)
    for name, t in (("q", q), ("k_new", k_new), ("v_new", v_new)):
        if not isinstance(t, Tensor) or t.dim() != 4 or t.dtype not in FLOAT_DTYPES:
            raise ValueError(f"{name} must be a 4-D floating tensor (batch, new tokens, heads, head_dim), got "
                             f"{getattr(t, 'shape', type(t).__name__)}")
    b, n, z, d = q.shape
    want = (cache.batch, n, cache.kv_heads, cache.head_dim)
    if b != cache.batch or d != cache.head_dim or n < 1:
        raise ValueError(f"q.shape={tuple(q.shape)} must be (cache.batch={cache.batch}, q >= 1, heads, "
                         f"cache.head_dim={cache.head_dim})")
    if tuple(k_new.shape) != want or tuple(v_new.shape) != want:
        raise ValueError(f"k_new.shape={tuple(k_new.shape)} and v_new.shape={tuple(v_new.shape)} must be {want} "
                         "(batch, the new tokens of q, cache.kv_heads, cache.head_dim)")
    if z % cache.kv_heads:
        raise ValueError(f"query heads q.shape[2]={z} must be a multiple of cache.kv_heads={cache.kv_heads}")
    if merge == "heads" and z % cache.world_size:
        raise ValueError(f"merge='heads' splits the query heads q.shape[2]={z} over the {cache.world_size} ranks: "
                         "they must divide evenly (or use merge='all_gather')")
    check_attention_args(q, softmax_scale, backend)
    if positions is not None:
        check_positions(positions, cache.lengths(layer), n)


def check_positions(positions: Tensor, lengths: list[int], n: int) -> None:
    """The new tokens must continue each sequence: positions[b] == lengths[b] + 0..n-1 (a gap would leave
    positions no rank holds; an overlap would cache a position twice)."""
    if not isinstance(positions, Tensor) or tuple(positions.shape) != (len(lengths), n):
        raise ValueError(f"positions shape {tuple(getattr(positions, 'shape', ()))} must be (batch, q) = "
                         f"({len(lengths)}, {n})")
    for b, length in enumerate(lengths):
        got = positions[b].tolist()
        if got != list(range(length, length + n)):
            where = "past the end of" if got[0] > length else "inside"
            raise ValueError(f"positions[{b}]={got} lie {where} the cache: sequence {b} holds {length} tokens, "
                             f"so its new tokens are at positions {length}..{length + n - 1}")


def attend_new_tokens(q: Tensor, k_new: Tensor, v_new: Tensor, cache: ShardedKVCache, layer: int,
                      window: int | None, scale: float, backend: str | None) -> tuple[Tensor, Tensor]:
    """Append each sequence's new tokens that this rank owns (``ShardedKVCache.owners``) to ``cache`` at
    ``layer`` and attend the new queries over the rank's shard -> (out (B, q, Z, d), lse (B, Z, q)) in the
    statistics dtype. Shared with TP decode, whose head-sharded cache is a one-rank cache (every owner 0)."""
    mask = decode_mask(window)
    outs, lses = [], []
    for b in range(cache.batch):
        owners = cache.owners(layer, b, q.shape[1])
        pos = cache.append(layer, b, k_new[b], v_new[b], owners)
        s = cache.shard(layer, b)
        o, lse = partial_attention(q[b], pos, s.k, s.v, s.pos, mask, scale, backend,
                                   all_live=decode_all_live(window, owners, cache.rank))
        outs.append(o)
        lses.append(lse)
    return torch.stack(outs), torch.stack(lses)


def decode(q: Tensor, k_new: Tensor, v_new: Tensor, cache: ShardedKVCache, layer: int, *,
           merge: str = "all_gather", window: int | None = None, softmax_scale: float | None = None,
           positions: Tensor | None = None, group=None, backend: str | None = None) -> tuple[Tensor, Tensor]:
    """Append the new tokens to ``cache`` at ``layer`` and attend them over the whole sequence.

    q (B, q, Z, d), k_new / v_new (B, q, Zkv, d): the new tokens of every sequence, the same on every
    rank; ``positions`` (B, q), optional, checked: where they sit (each sequence's cached length
    onward; RoPE them there). ``window``: keys q - window .. q only (None: causal).
    Returns (out, lse) in (q's dtype, statistics dtype): "all_gather" (B, q, Z, d) and (B, Z, q);
    "heads" this rank's heads, (B, q, Z/G, d) and (B, Z/G, q). Bad input, or ranks that disagree
    (their caches, layer, window, merge, shapes): ValueError on every rank before any byte."""
    agree(group, lambda: _check(q, k_new, v_new, cache, layer, merge, window, positions, group, softmax_scale,
                                 backend),
          dict(op="decode", layer=layer, merge=merge, window=window, scale=softmax_scale,
               shape=tuple(getattr(q, "shape", ())), dtype=getattr(q, "dtype", None), **cache_state(cache, layer)))
    out, lse = attend_new_tokens(q, k_new, v_new, cache, layer, window, default_scale(q.shape[-1], softmax_scale),
                                 backend)
    out = out.to(q.dtype)                                               # (B, q, Z, d), (B, Z, q)
    if cache.world_size == 1:
        return out, lse
    if merge == "all_gather":
        outs = all_gather_(out.unsqueeze(0), 0, group, "forward", "out")
        lses = all_gather_(lse.unsqueeze(0), 0, group, "forward", "lse")
    else:   # piece j (heads of rank j) to rank j; the G pieces received stack on a new leading dim
        outs = all_to_all_(out.unsqueeze(0), 3, 0, group, "forward", "out")
        lses = all_to_all_(lse.unsqueeze(0), 2, 0, group, "forward", "lse")
    out, lse = merge_all(outs, lses)
    comm.note("decode.merge", merge)
    return out.to(q.dtype), lse
