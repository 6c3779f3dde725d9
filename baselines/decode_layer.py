"""An attention layer that serves inference: the prompt's prefill into a KV cache, then decode steps on it.

The benchmark's unit of time to first token (``prefill_step``) and of time per output token
(``decode_step``), for the three ways of splitting decode over G ranks (``ROWS``):

* ``"cp_all_gather"``: context parallel, replicated model (vLLM's decode context parallelism): every
  rank projects the new tokens with the full weights, attends over its shard of the cache
  (``burst_impl.inference.decode``, all-gather merge) and applies the full output projection;
* ``"cp_heads"``: context parallel attention, tensor-parallel output projection (Helix): the heads
  merge leaves rank j its Z/G heads, whose rows of W_o it applies; an all-reduce sums the partial
  outputs (Megatron's row-parallel linear);
* ``"tp"``: tensor parallel (Megatron TP): rank j projects its heads' columns, attends over its
  head-sharded cache (``baselines.tp_decode``; KV heads replicated where G > Zkv) and applies its rows
  of W_o; an all-reduce sums the partial outputs.

Weights are ``baselines.layer.full_weights`` (the training layer's, the same seed gives the same layer),
with W_q, W_k, W_v joined into one (H, (Zq + 2 Zkv) d) matrix per rank so a decode step makes one
GEMM of its new tokens. RoPE is left out: it is elementwise on q and k, changes no byte sent and no
kernel's shape, and every token keeps its global position in the cache (the masks use it).

Prefill: context parallel rows run ``burst_impl.inference.prefill`` (the Burst ring, pass-KV) on the
layout shard of the prompt; ``tp`` attends its heads over the whole prompt with the local kernel and
caches every token of its KV heads. Bytes one rank sends: ``decode_layer_bytes`` and
``prefill_layer_bytes`` (the merge's formula, ``burst_impl.inference.bytes``, plus the row-parallel
output projection's all-reduce, ``baselines.methods.tp.tp_region_bytes``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from burst_impl import comm
from burst_impl import layout as layouts
from burst_impl.collectives import all_reduce_
from burst_impl.inference import ShardedKVCache, decode, decode_bytes, prefill, prefill_bytes
from burst_impl.kernels import attn_forward, default_scale, stats_dtype
from burst_impl.shape import AttnShape

from .layer import full_weights
from .methods.tp import head_columns, tp_region_bytes
from .tp_decode import tp_cache, tp_decode, tp_heads

Tensor = torch.Tensor
ROWS = ("cp_all_gather", "cp_heads", "tp")
MERGE_OF = {"cp_all_gather": "all_gather", "cp_heads": "heads", "tp": None}


def check_row(row: str) -> None:
    if row not in ROWS:
        raise ValueError(f"row={row!r} is unknown; choose one of {ROWS}")


@dataclass
class DecodeLayer:
    """This rank's weights and cache. wqkv (H, (zq + 2 zkv) d); wo (zo d, H): decode's output projection,
    all heads for ``cp_all_gather``, this rank's heads otherwise; wo_prefill: the prefill's (context parallel:
    every head, since a rank holds all heads of its tokens; TP: its heads)."""

    row: str
    shape: AttnShape            # heads, kv_heads, head_dim, dtype, world_size, layout of the prompt
    wqkv: Tensor
    wo: Tensor
    zq: int                     # query heads this rank projects
    zkv: int                    # KV heads it projects (and caches: TP)
    cache: ShardedKVCache
    group: object
    wo_prefill: Tensor | None = None

    @property
    def tensor_parallel_out(self) -> bool:
        return self.row != "cp_all_gather"


def make_decode_layer(row: str, shape: AttnShape, *, group=None, seed: int = 0, device="cpu",
                      placement: str = "round_robin") -> DecodeLayer:
    """The layer of ``row`` for ``shape`` (B sequences, H = Z d) with an empty one-layer cache; ValueError
    naming the rule before anything is sent."""
    check_row(row)
    rank, g = comm.world(group)
    if g != shape.world_size:
        raise ValueError(f"shape.world_size={shape.world_size} must equal the group size {g}")
    if row == "cp_heads" and shape.heads % g:
        raise ValueError(f"row='cp_heads' leaves each rank heads={shape.heads} / {g}: they must divide evenly")
    w = full_weights(shape, seed)
    d, z, zkv = shape.head_dim, shape.heads, shape.kv_heads
    if row == "tp":
        qh, kvh = tp_heads(z, zkv, g, rank)
        qi, ki = list(range(z))[qh], list(range(zkv))[kvh]
        cols = [w["wq"][:, head_columns(qi, d)], w["wk"][:, head_columns(ki, d)], w["wv"][:, head_columns(ki, d)]]
        wo = w["wo"][head_columns(qi, d)]
        cache = tp_cache(1, shape.batch, z, zkv, d, group=group, dtype=shape.torch_dtype, device=device)
        zq, zkv_local = len(qi), len(ki)
    else:
        cols = [w["wq"], w["wk"], w["wv"]]
        per = z // g if row == "cp_heads" else z
        wo = w["wo"][rank * per * d:(rank + 1) * per * d] if row == "cp_heads" else w["wo"]
        cache = ShardedKVCache.empty(1, shape.batch, zkv, d, dtype=shape.torch_dtype, device=device,
                                     placement=placement, group=group)
        zq, zkv_local = z, zkv
    wo = wo.to(device).contiguous()
    return DecodeLayer(row, shape, torch.cat(cols, 1).to(device).contiguous(), wo, zq, zkv_local, cache, group,
                       wo_prefill=w["wo"].to(device).contiguous() if row == "cp_heads" else wo)


def _split_qkv(lay: DecodeLayer, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    b, n, _ = x.shape
    d = lay.shape.head_dim
    qkv = x @ lay.wqkv                                             # (B, n, (zq + 2 zkv) d): one GEMM
    q, k, v = qkv.split([lay.zq * d, lay.zkv * d, lay.zkv * d], dim=-1)
    return q.reshape(b, n, lay.zq, d), k.reshape(b, n, lay.zkv, d), v.reshape(b, n, lay.zkv, d)


def _out_proj(lay: DecodeLayer, out: Tensor, row_parallel: bool, wo: Tensor) -> Tensor:
    """out (B, n, heads of this rank, d) -> (B, n, H): a row-parallel projection's partial sums are all-reduced."""
    b, n = out.shape[:2]
    y = out.reshape(b, n, -1) @ wo
    return all_reduce_(y, lay.group, "forward", "out_proj") if row_parallel else y


def decode_step(lay: DecodeLayer, x: Tensor) -> Tensor:
    """x (B, q, H): the new tokens' hidden states, the same on every rank -> y (B, q, H), the same on every
    rank. Appends their K/V to the cache (its placement's ranks; TP: every rank its heads)."""
    q, k, v = _split_qkv(lay, x)
    if lay.row == "tp":
        out, _ = tp_decode(q, k, v, lay.cache, 0, group=lay.group)
    else:
        out, _ = decode(q, k, v, lay.cache, 0, merge=MERGE_OF[lay.row], group=lay.group)
    return _out_proj(lay, out, lay.tensor_parallel_out, lay.wo)


def prefill_input_tokens(lay: DecodeLayer) -> int:
    """Tokens of the prompt this rank's ``prefill_step`` takes: its layout shard, or all N (TP)."""
    s = lay.shape
    return s.seqlen if lay.row == "tp" else s.lengths[comm.world(lay.group)[0]]


def prefill_step(lay: DecodeLayer, x: Tensor) -> Tensor:
    """The prompt into the empty cache. x: (B, N/G, H), this rank's ``shape.layout`` shard (context parallel),
    or (B, N, H), the whole prompt (TP) -> the layer's output for the same tokens. Both context-parallel rows
    prefill alike (a rank holds every head of its tokens, so W_o is applied whole: the heads row shards W_o
    for decode only)."""
    s = lay.shape
    q, k, v = _split_qkv(lay, x)
    if lay.row != "tp":
        out, _ = prefill(q, k, v, lay.cache, 0, layout=s.layout, group=lay.group)
        return _out_proj(lay, out, False, lay.wo_prefill)
    out, _ = attn_forward(q, k, v, causal=True, scale=default_scale(s.head_dim, None))
    pos = torch.arange(x.shape[1], device=x.device)
    for b in range(s.batch):
        lay.cache.write(0, b, k[b], v[b], pos, [x.shape[1]])
    return _out_proj(lay, out, True, lay.wo)


def fill_cache(lay: DecodeLayer, context: int, *, seed: int = 0, reserve: int = 0, block: int = 4096) -> None:
    """Fill the empty cache with ``context`` tokens per sequence of synthetic K/V, placed as a prefill of the
    prompt would place them (``shape.layout``'s shard; TP: every token), with room for ``reserve`` more
    (``ShardedKVCache.reserve``): decode benchmarks at contexts no CPU prefills. The rows repeat a seeded
    block of ``block`` rows, written a block at a time into the reserved buffers (drawing 1M rows, or one
    1M-row temporary, would cost more than the benchmark); attention's cost does not depend on them."""
    s = lay.shape
    rank, g = comm.world(lay.group)
    if lay.row == "tp":
        pos, lens = torch.arange(context), [context]
    else:
        resolved = AttnShape(s.batch, context, s.heads, s.kv_heads, s.head_dim, g, dtype=s.dtype,
                             layout=s.layout).resolved_layout
        pos, lens = layouts.positions(resolved, rank, g, context), list(layouts.lengths(resolved, g, context))
    mine = 0 if lay.row == "tp" else rank
    n = pos.numel()
    lay.cache.reserve(n + reserve)
    gen = torch.Generator().manual_seed(seed * 1_000_003 + rank)
    rows = torch.randn((min(block, max(n, 1)), 2, lay.cache.kv_heads, s.head_dim), generator=gen).to(s.torch_dtype)
    for b in range(s.batch):
        for start in range(0, n, rows.shape[0]):
            part = rows[:min(rows.shape[0], n - start)]
            done = start + part.shape[0]      # shard_lens as the last write leaves them; this rank's: rows so far
            lay.cache.write(0, b, part[:, 0], part[:, 1], pos[start:done],
                            [done if j == mine else x for j, x in enumerate(lens)])


def decode_layer_bytes(row: str, shape: AttnShape, new_tokens: int) -> dict[tuple[str, str], int]:
    """``{(phase, kind): bytes}`` one rank sends in one ``decode_step`` of ``new_tokens`` per sequence: the
    merge (``burst_impl.inference.bytes.decode_bytes``; TP's attention sends nothing) and, where W_o is
    row-parallel, the all-reduce of the (B, q, H) output (``tp_region_bytes``, Megatron's f/g)."""
    check_row(row)
    s, g = shape, shape.world_size
    out = {}
    if row != "tp":
        e_lse = torch.empty((), dtype=stats_dtype(s.torch_dtype)).element_size()
        out.update(decode_bytes(MERGE_OF[row], g, s.batch, new_tokens, s.heads, s.head_dim, s.elem_size, e_lse))
    if row != "cp_all_gather":
        out.update(row_parallel_bytes(s.batch * new_tokens * s.heads * s.head_dim * s.elem_size, g))
    return {k: v for k, v in out.items() if v}


def prefill_layer_bytes(row: str, shape: AttnShape, rank: int = 0) -> dict[tuple[str, str], int]:
    """One rank's bytes in ``prefill_step``: the Burst ring's K/V (``prefill_bytes``, every rank's shard
    length; both context-parallel rows), or TP's all-reduce of the (B, N, H) output."""
    check_row(row)
    s, g = shape, shape.world_size
    if row != "tp":
        out = prefill_bytes(rank, list(s.lengths), s.batch, s.kv_heads, s.head_dim, s.elem_size)
    else:
        out = row_parallel_bytes(s.batch * s.seqlen * s.heads * s.head_dim * s.elem_size, g)
    return {k: v for k, v in out.items() if v}


def row_parallel_bytes(nbytes: int, g: int) -> dict[tuple[str, str], int]:
    """The row-parallel output projection's all-reduce of ``nbytes`` (Megatron TP V1's forward region)."""
    b = tp_region_bytes(nbytes, g, "v1").get(("forward", "out"), 0)
    return {("forward", "out_proj"): b} if b else {}


def cache_kv_heads(row: str, shape: AttnShape) -> int:
    """KV heads a rank caches per token it holds: all Zkv (context parallel), its TP share (max(1, Zkv/G))."""
    check_row(row)
    if row != "tp":
        return shape.kv_heads
    kv = tp_heads(shape.heads, shape.kv_heads, shape.world_size, 0)[1]
    return kv.stop - kv.start
