"""Prefill into a sharded KV cache (docs/inference.md, "Prefill").

* ``prefill``: a prompt into empty sequences of the cache, pass-KV: the Burst ring forward
  (``burst_attn_func``, causal, K/V circulate), after which each rank keeps its layout shard
  of K and V with their global positions.
* ``prefill_continue``: a continuation of C tokens over a cached prefix, pass-Q (Meta's
  context-parallel inference, arXiv 2411.01783): the new tokens are placed by the cache's
  placement and each rank holds the q, k, v of its own; K/V stay in the caches while the query
  blocks circulate on the ring (G-1 hops), each rank computing every block's partial (O, lse)
  over its shard; an all-to-all returns each partial to the block's owner, which merges them by
  log-sum-exp. Pass-Q sends fewer bytes than pass-KV when the cached prefix is long against C.

Bytes per rank: ``bytes.prefill_bytes`` and ``bytes.continue_bytes``.
"""
from __future__ import annotations

import torch

from .. import comm, layout as layouts, masks
from ..attention import burst_attn_func
from ..balance import resolve_layout
from ..collectives import all_to_all_
from ..kernels import FLOAT_DTYPES, default_scale
from .agree import agree
from .kv_cache import ShardedKVCache, cache_state, check_cache
from .partial import check_attention_args, decode_mask, merge_all, partial_attention

Tensor = torch.Tensor


def _check_batch(q, k, v, cache: ShardedKVCache, layer: int, seqs: list[int], group) -> None:
    check_cache(cache, layer, group)
    if len(set(seqs)) != len(seqs) or any(not isinstance(b, int) or not 0 <= b < cache.batch for b in seqs):
        raise ValueError(f"seqs={seqs} must be distinct sequence indices in [0, cache.batch={cache.batch})")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor) or t.dim() != 4 or t.dtype not in FLOAT_DTYPES:
            raise ValueError(f"{name} must be a 4-D floating tensor (len(seqs), local tokens, heads, head_dim)")
    want = (len(seqs), q.shape[1], cache.kv_heads, cache.head_dim)
    if q.shape[0] != len(seqs) or q.shape[3] != cache.head_dim or tuple(k.shape) != want or k.shape != v.shape:
        raise ValueError(f"q.shape={tuple(q.shape)}, k.shape={tuple(k.shape)}, v.shape={tuple(v.shape)}: k and v "
                         f"must be {want} (len(seqs), q's tokens, cache.kv_heads, cache.head_dim), q alike with "
                         "its own heads")
    if q.shape[2] % cache.kv_heads:
        raise ValueError(f"query heads q.shape[2]={q.shape[2]} must be a multiple of cache.kv_heads={cache.kv_heads}")


def _tokens(t) -> int:
    return t.shape[1] if isinstance(t, Tensor) and t.dim() >= 2 else -1


def prefill(q: Tensor, k: Tensor, v: Tensor, cache: ShardedKVCache, layer: int, *, seqs=None,
            layout="contiguous", window: int | None = None, softmax_scale: float | None = None, group=None,
            backend: str | None = None, topology: str = "flat", node_size: int | None = None
            ) -> tuple[Tensor, Tensor]:
    """Causal attention of prompts sharded by ``layout`` (q (len(seqs), N/G, Z, d), k/v (.., Zkv, d): this
    rank's ``layout.shard``, RoPE'd at the shard's global positions) -> (out, lse) of the local rows, as
    ``burst_attn_func(..., causal=True, return_lse=True)`` gives them; the local K/V shard goes into the
    empty sequences ``seqs`` (default: all) of ``cache`` at ``layer``."""
    seqs = list(range(cache.batch)) if seqs is None and isinstance(cache, ShardedKVCache) else list(seqs or [])

    def checks():
        _check_batch(q, k, v, cache, layer, seqs, group)
        decode_mask(window)
        filled = [b for b in seqs if cache.layers[layer][b].length]
        if filled:
            raise ValueError(f"seqs={seqs}: sequence(s) {filled} already hold tokens at layer {layer}; prefill "
                             "fills empty sequences (prefill_continue extends cached ones)")
    rows = agree(group, checks, dict(op="prefill", layer=layer, seqs=seqs, window=window, layout=str(layout),
                                     **cache_state(cache, layer, seqs)), dict(seq_local=_tokens(q)))
    rank, size = comm.world(group)
    n = sum(r["seq_local"] for r in rows) if len(rows) == size else q.shape[1] * size
    mask = decode_mask(window) if window is not None else None
    out, lse = burst_attn_func(q, k, v, causal=True, mask=mask, softmax_scale=softmax_scale, group=group,
                               layout=layout, backend=backend, return_lse=True, topology=topology,
                               node_size=node_size, seqlen=n)
    resolved = resolve_layout(layout, masks.resolve(True, mask, n), n, size)
    pos, lens = layouts.positions(resolved, rank, size, n), list(layouts.lengths(resolved, size, n))
    for i, b in enumerate(seqs):
        cache.write(layer, b, k[i], v[i], pos, lens)
    return out, lse


def continuation_owners(cache: ShardedKVCache, layer: int, seq: int, count: int) -> list[int]:
    """The rank of each of the next ``count`` tokens of ``seq``: rank r passes ``prefill_continue`` the
    tokens i with owners[i] == r, in order."""
    return cache.owners(layer, seq, count)


def prefill_continue(q: Tensor, k: Tensor, v: Tensor, cache: ShardedKVCache, layer: int, *, seqs=None,
                     window: int | None = None, softmax_scale: float | None = None, group=None,
                     backend: str | None = None, overlap: bool = True) -> tuple[Tensor, Tensor]:
    """Pass-Q prefill of a continuation: q (len(seqs), C_r, Z, d), k/v (.., Zkv, d) are this rank's C_r of
    the C new tokens (``continuation_owners``) of sequences ``seqs`` (default: all), which must hold the
    same shard lengths at ``layer``. Returns (out (len(seqs), C_r, Z, d), lse (len(seqs), Z, C_r)) of this
    rank's tokens; their K/V join this rank's shard. Needs the agreement check on (it gives C)."""
    seqs = list(range(cache.batch)) if seqs is None and isinstance(cache, ShardedKVCache) else list(seqs or [])
    _, size = comm.world(group)

    def checks():
        _check_batch(q, k, v, cache, layer, seqs, group)
        decode_mask(window)
        check_attention_args(q, softmax_scale, backend)
        if len({tuple(cache.layers[layer][b].shard_lens) for b in seqs}) > 1:
            raise ValueError(f"seqs={seqs}: their shards at layer {layer} differ in length "
                             f"({[cache.layers[layer][b].shard_lens for b in seqs]}); continue them in separate calls")
        if size > 1 and not comm.shape_check_enabled():
            raise ValueError("prefill_continue learns every rank's token count from the agreement check: call it "
                             "with comm.check_shapes on")
    rows = agree(group, checks, dict(op="prefill_continue", layer=layer, seqs=seqs, window=window,
                                     scale=softmax_scale, heads=tuple(getattr(q, "shape", ()))[2:],
                                     **cache_state(cache, layer, seqs)),
                 dict(tokens=_tokens(q)))
    counts = [r["tokens"] for r in rows]
    owners = cache.owners(layer, seqs[0], sum(counts))
    expected = [owners.count(r) for r in range(size)]
    if counts != expected or min(counts) < 1:
        raise ValueError(f"q.shape[1]: the ranks hold {counts} new tokens, but the cache's placement "
                         f"{cache.placement!r} puts the {sum(counts)} tokens on the ranks as {expected}; each rank "
                         "must pass its own (continuation_owners), at least one each (use decode for fewer tokens)")
    start = cache.layers[layer][seqs[0]].length
    owned = torch.tensor(owners)
    pos_of = [torch.arange(start, start + len(owners))[owned == r] for r in range(size)]
    lens = [a + b for a, b in zip(cache.layers[layer][seqs[0]].shard_lens, counts)]
    for i, b in enumerate(seqs):
        cache.write(layer, b, k[i], v[i], pos_of[cache.rank], lens)
    out, lse = _pass_q(q, cache, layer, seqs, pos_of, counts, decode_mask(window),
                       default_scale(q.shape[-1], softmax_scale), group, backend, overlap)
    return out.to(q.dtype), lse


def _pass_q(q, cache, layer, seqs, pos_of, counts, mask, scale, group, backend, overlap):
    """The query ring and the return of the partials (see the module docstring)."""
    ring = comm.Ring(group, overlap=overlap)
    partials: dict[int, tuple[Tensor, Tensor]] = {}

    def on_block(step, owner, blk):
        parts = [partial_attention(blk[0][i], pos_of[owner], s.k, s.v, s.pos, mask, scale, backend)
                 for i, s in enumerate(cache.layers[layer][b] for b in seqs)]
        partials[owner] = (torch.stack([o for o, _ in parts]).to(q.dtype), torch.stack([lse for _, lse in parts]))
        return None

    comm.circulate(ring, [q], "forward", ("q",), on_block, shapes=comm.seq_shapes([q], (1,), counts))
    order = range(ring.size)
    outs = all_to_all_(torch.cat([partials[j][0] for j in order], 1).unsqueeze(0), 2, 0, group, "forward", "out",
                       scatter_sizes=counts)
    lses = all_to_all_(torch.cat([partials[j][1] for j in order], 2).unsqueeze(0), 3, 0, group, "forward", "lse",
                       scatter_sizes=counts)
    return merge_all(outs, lses)
