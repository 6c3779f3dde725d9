"""Tensor-parallel decode (Megatron TP): the baseline that context-parallel decode is measured against.

Rank r of G keeps query heads [r Z/G, (r+1) Z/G) and the KV heads they read, over every token of
every sequence: a head-sharded cache (``ShardedKVCache`` of one "rank", holding the local KV heads).
With Zkv >= G each rank keeps Zkv/G KV heads (Zkv divisible by G); with G > Zkv each KV head is
replicated on G/Zkv ranks (G divisible by Zkv), so a rank's cache holds 1/Zkv of the KV instead of
1/G: the capacity that context parallelism wins back. Attention itself sends nothing; the output
projection's all-reduce (2 (G-1)/G B q H e bytes per rank, H = Z d) belongs to the model
(``baselines.tensor_parallel``).
"""
from __future__ import annotations

import torch

from burst_impl import comm
from burst_impl.inference import ShardedKVCache
from burst_impl.inference.decode import attend_new_tokens
from burst_impl.inference.partial import check_attention_args, decode_mask
from burst_impl.inference.agree import agree
from burst_impl.kernels import default_scale

Tensor = torch.Tensor


def tp_heads(heads: int, kv_heads: int, world_size: int, rank: int) -> tuple[slice, slice]:
    """(query heads, KV heads) of ``rank``: ValueError naming the rule when the heads do not split."""
    if heads % world_size:
        raise ValueError(f"heads={heads} must be divisible by the tensor-parallel size {world_size}")
    if kv_heads == 0 or heads % kv_heads:
        raise ValueError(f"heads={heads} must be a multiple of kv_heads={kv_heads}")
    if kv_heads >= world_size:
        if kv_heads % world_size:
            raise ValueError(f"kv_heads={kv_heads} must be divisible by the tensor-parallel size {world_size} "
                             "(or smaller than it and dividing it: then each KV head is replicated)")
        per = kv_heads // world_size
        kv = slice(rank * per, (rank + 1) * per)
    else:
        if world_size % kv_heads:
            raise ValueError(f"tensor-parallel size {world_size} must be a multiple of kv_heads={kv_heads} "
                             "to replicate each KV head on the same number of ranks")
        head = rank // (world_size // kv_heads)
        kv = slice(head, head + 1)
    per_q = heads // world_size
    return slice(rank * per_q, (rank + 1) * per_q), kv


def tp_cache(n_layers: int, batch: int, heads: int, kv_heads: int, head_dim: int, *, group=None,
             dtype=torch.float32, device="cpu") -> ShardedKVCache:
    """This rank's head-sharded cache (every token, the KV heads ``tp_heads`` gives it)."""
    rank, size = comm.world(group)
    kv = tp_heads(heads, kv_heads, size, rank)[1]
    return ShardedKVCache.empty(n_layers, batch, kv.stop - kv.start, head_dim, dtype=dtype, device=device,
                                rank=0, world_size=1)


def _check(q, k_new, v_new, cache, layer, window, softmax_scale, backend) -> None:
    if not isinstance(cache, ShardedKVCache) or cache.world_size != 1:
        raise ValueError("cache must be the head-sharded ShardedKVCache of tp_cache (one shard per rank)")
    cache.check_layer(layer)
    if not all(isinstance(t, Tensor) for t in (q, k_new, v_new)):
        raise ValueError("q, k_new, v_new must be tensors (batch, new tokens, this rank's heads, head_dim)")
    want = (cache.batch, q.shape[1], cache.kv_heads, cache.head_dim)
    if q.dim() != 4 or q.shape[0] != cache.batch or tuple(k_new.shape) != want or k_new.shape != v_new.shape:
        raise ValueError(f"q.shape={tuple(q.shape)}, k_new.shape={tuple(k_new.shape)}: this rank's heads of the "
                         f"new tokens, k_new and v_new {want}")
    decode_mask(window)
    check_attention_args(q, softmax_scale, backend)


def tp_decode(q: Tensor, k_new: Tensor, v_new: Tensor, cache: ShardedKVCache, layer: int, *,
              window: int | None = None, softmax_scale: float | None = None, group=None,
              backend: str | None = None) -> tuple[Tensor, Tensor]:
    """q (B, q, Z/G, d) and k_new / v_new (B, q, local KV heads, d): this rank's heads of the new tokens.
    Appends them to the head-sharded cache and returns (out (B, q, Z/G, d), lse (B, Z/G, q)) of the
    rank's heads. The ranks agree on layer, window and their caches' lengths before attending."""
    agree(group, lambda: _check(q, k_new, v_new, cache, layer, window, softmax_scale, backend),
          dict(op="tp_decode", layer=layer, window=window, shape=tuple(getattr(q, "shape", ())),
               lengths=cache.lengths(layer) if isinstance(cache, ShardedKVCache) and
               layer in range(cache.n_layers) else None))
    out, lse = attend_new_tokens(q, k_new, v_new, cache, layer, window, default_scale(q.shape[-1], softmax_scale),
                                 backend)
    return out.to(q.dtype), lse
