"""The inference benchmark's attention layer (baselines/decode_layer.py): prefill into the cache, then decode
steps, for the three rows (context parallel with either merge, tensor parallel), against a single-process fp64
layer; the bytes each rank sends equal ``prefill_layer_bytes`` / ``decode_layer_bytes``; the cache's
``reserve`` / ``snapshot`` / ``rewind`` hooks time every step at one context length without changing a bit."""
from __future__ import annotations

import pytest
import torch

from baselines.decode_layer import (ROWS, cache_kv_heads, decode_layer_bytes, decode_step, fill_cache,
                                    make_decode_layer, prefill_input_tokens, prefill_layer_bytes, prefill_step)
from baselines.layer import full_weights
from burst_impl import comm
from burst_impl.layout import shard
from burst_impl.shape import AttnShape
from tests.inference_refs import FP64_TOL, attend, err

N, STEPS = 12, 2


def _reference(shape: AttnShape, x: torch.Tensor) -> torch.Tensor:
    """x (B, L, H) -> causal attention layer output (B, L, H), fp64, one process."""
    w = full_weights(shape, 0)
    b, n, _ = x.shape
    out = []
    for i in range(b):
        q = (x[i] @ w["wq"]).view(n, shape.heads, shape.head_dim)
        k = (x[i] @ w["wk"]).view(n, shape.kv_heads, shape.head_dim)
        v = (x[i] @ w["wv"]).view(n, shape.kv_heads, shape.head_dim)
        o, _ = attend(q, torch.arange(n), k, v)
        out.append(o.reshape(n, -1) @ w["wo"])
    return torch.stack(out)


def _run(row: str, heads: int, kv_heads: int, layout: str):
    rank, g = comm.world()
    shape = AttnShape(2, N, heads, kv_heads, 4, g, dtype="float64", layout=layout)
    x = torch.randn(2, N + STEPS, heads * 4, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    want = _reference(shape, x)
    lay = make_decode_layer(row, shape)
    xin = x[:, :N] if row == "tp" else shard(x[:, :N], shape.resolved_layout, rank, g)
    assert xin.shape[1] == prefill_input_tokens(lay)
    with comm.count_bytes() as counts:
        y = prefill_step(lay, xin)
    ref = want[:, :N] if row == "tp" else shard(want[:, :N], shape.resolved_layout, rank, g)
    worst = err(y, ref)
    sent = [(counts.as_dict(), prefill_layer_bytes(row, shape, rank))]
    lay.cache.reserve(STEPS)
    mark = lay.cache.snapshot()
    first = decode_step(lay, x[:, N:N + 1])
    lay.cache.rewind(mark)
    for t in range(STEPS):
        with comm.count_bytes() as counts:
            y = decode_step(lay, x[:, N + t:N + t + 1])
        worst = max(worst, err(y, want[:, N + t:N + t + 1]))
        sent.append((counts.as_dict(), decode_layer_bytes(row, shape, 1)))
        if t == 0:
            assert torch.equal(y, first)            # rewound: the same step again, bit for bit
    return worst, sent, lay.cache.nbytes(), cache_kv_heads(row, shape)


def _keyed(counted: dict) -> dict:
    return {tuple(k.split("/")) if isinstance(k, str) else k: v for k, v in counted.items() if v}


@pytest.mark.parametrize("world_size,heads,kv_heads,layout", [(2, 4, 2, "zigzag"), (4, 4, 1, "contiguous")])
@pytest.mark.parametrize("row", ROWS)
def test_decode_layer_matches_fp64_and_its_bytes(pools, row, world_size, heads, kv_heads, layout):
    results = pools.run(world_size, _run, row, heads, kv_heads, layout)
    for worst, sent, _, _ in results:
        assert worst <= FP64_TOL
        for counted, formula in sent:
            assert _keyed(counted) == formula
    per_head = (N + STEPS) * 2 * 2 * 4 * 8          # tokens x B x (K, V) x d x fp64, one KV head
    held = [h for _, _, h, _ in results]
    zkv = results[0][3]
    if row == "tp":       # every token, the rank's KV heads (replicated where G > Zkv)
        assert zkv == max(1, kv_heads // world_size) and held == [per_head * zkv] * world_size
    else:                 # every token once over the group, all KV heads
        assert zkv == kv_heads and sum(held) == per_head * kv_heads


def _fill(row: str, context: int):
    rank, g = comm.world()
    shape = AttnShape(1, context, 4, 2, 4, g, dtype="float32", layout="zigzag")
    lay = make_decode_layer(row, shape)
    fill_cache(lay, context)
    s = lay.cache.shard(0, 0)
    return s.pos.tolist(), s.shard_lens, lay.cache.nbytes()


def test_fill_cache_places_the_prompt_as_prefill_would(pools):
    cp = pools.run(2, _fill, "cp_all_gather", 8)
    assert sorted(p for pos, _, _ in cp for p in pos) == list(range(8))
    assert cp[0][0] == [0, 1, 6, 7] and cp[0][1] == [4, 4]          # zigzag shard of rank 0
    assert sum(b for _, _, b in cp) == 8 * 2 * 2 * 4 * 4
    tp = pools.run(2, _fill, "tp", 8)
    assert all(pos == list(range(8)) for pos, _, _ in tp) and tp[0][2] == 8 * 2 * 1 * 4 * 4


@pytest.mark.parametrize("row", ROWS)
def test_reserved_cache_is_written_in_place(row):
    """fill_cache reserves before its first write: the prompt and every decode step then write into the
    reserved buffers, never a copy of the shard (an empty view's data_ptr() is 0, which once sent every append
    of a filled cache to torch.cat: TP decode at 128K cost 10x its kernel)."""
    shape = AttnShape(1, 64, 4, 2, 4, 1, dtype="float32")
    lay = make_decode_layer(row, shape)
    fill_cache(lay, 64, reserve=2)
    s = lay.cache.shard(0, 0)
    buf = s.spare[0].untyped_storage().data_ptr()
    assert s.k.untyped_storage().data_ptr() == buf
    x = torch.randn(1, 1, 16)
    for _ in range(2):
        decode_step(lay, x)
        s = lay.cache.shard(0, 0)
        assert s.spare is not None and s.k.untyped_storage().data_ptr() == buf and s.k.shape[0] == s.pos.numel()
    decode_step(lay, x)       # past the reserve: concatenates, still correct
    assert lay.cache.shard(0, 0).spare is None and lay.cache.shard(0, 0).k.shape[0] == 67


def test_bad_rows_are_refused():
    shape = AttnShape(1, 8, 4, 2, 4, 1, dtype="float32")
    with pytest.raises(ValueError, match="row='ring' is unknown"):
        make_decode_layer("ring", shape)
    with pytest.raises(ValueError, match="must be a non-negative int"):
        make_decode_layer("cp_all_gather", shape).cache.reserve(-1)
