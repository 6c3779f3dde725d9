"""Context-parallel inference against the single-process fp64 reference (burst_impl.inference).

One scenario per (world size, placement, kv heads) on a gloo group: two sequences of different
prompt lengths prefilled pass-KV (zigzag, and contiguous with a window; uneven N), one continued pass-Q,
then decode steps of 1, 3 and 2 new tokens through both merges, the placement switched half-way
(the placements mix) and a sliding window on the last step. Every operator's output and lse are
compared with the reference on every rank, and every rank's counted bytes with the closed forms.
Tiny shapes (d = 4, B <= 2) keep W = 5 affordable on two cores.
"""
from __future__ import annotations

import pytest
import torch

from burst_impl import comm, layout as layouts
from burst_impl.inference import (ShardedKVCache, continuation_owners, continue_bytes, decode, decode_bytes,
                                  decode_mask, partial_attention, prefill, prefill_bytes, prefill_continue)
from tests.inference_refs import FP64_TOL, attend, bad_input_log, err, sequence

D = 4
PROMPTS = ((11, "zigzag", None), (6, "contiguous", 2))   # (N, layout, window) of the two prompts, uneven N
CONTINUE = 2                                       # pass-Q continuation of sequence 1: W + 2 tokens
STEPS = ((1, "all_gather", None), (3, "heads", None), (2, "all_gather", 4))   # (q, merge, window)


def _counted(fn):
    with comm.count_bytes() as counts:
        out = fn()
    return out, {k: v for k, v in counts.items() if v}


def _scenario(placement: str, kv_heads: int) -> list:
    """Every check of the scenario on this rank; the failures (empty: all passed)."""
    rank, g = comm.world()
    z = 2 * g if g > 1 else 2                   # "heads" splits Z over the ranks; GQA group Z / kv_heads
    total = [n + (CONTINUE + g if i == 1 else 0) + sum(s[0] for s in STEPS) for i, (n, _, _) in enumerate(PROMPTS)]
    data = [sequence(7 + i, total[i], z, kv_heads, D) for i in range(2)]
    cache = ShardedKVCache.empty(2, 2, kv_heads, D, dtype=torch.float64, placement=placement)
    bad = []

    def check(what, out, lse, want, counted, formula):
        e = max(err(out, want[0]), err(lse, want[1]))
        if not e <= FP64_TOL or counted != formula:
            bad.append((what, rank, e, counted, formula))

    for b, (n, lay, window) in enumerate(PROMPTS):     # pass-KV prefill, each sequence its own prompt length
        pos = layouts.positions(lay, rank, g, n)
        q, k, v = (t[pos].unsqueeze(0) for t in data[b])
        (out, lse), counted = _counted(lambda: prefill(q, k, v, cache, 0, seqs=[b], layout=lay, window=window))
        want = attend(data[b][0][pos], pos, data[b][1][:n], data[b][2][:n], window)
        check(f"prefill seq {b}", out[0], lse[0], want, counted,
              prefill_bytes(rank, list(layouts.lengths(lay, g, n)), 1, kv_heads, D, 8))

    start, count = PROMPTS[1][0], CONTINUE + g          # pass-Q continuation of sequence 1
    owners = torch.tensor(continuation_owners(cache, 0, 1, count))
    pos = torch.arange(start, start + count)[owners == rank]
    q, k, v = (t[pos].unsqueeze(0) for t in data[1])
    (out, lse), counted = _counted(lambda: prefill_continue(q, k, v, cache, 0, seqs=[1], window=3))
    want = attend(data[1][0][pos], pos, data[1][1][:start + count], data[1][2][:start + count], window=3)
    check("continue seq 1", out[0], lse[0], want, counted,
          continue_bytes(rank, [int((owners == r).sum()) for r in range(g)], 1, z, D, 8, 8))

    for i, (n_new, merge, window) in enumerate(STEPS):
        if i == 1:
            cache.placement = "shortest" if placement == "round_robin" else "round_robin"
        lens = cache.lengths(0)
        new = [torch.arange(length, length + n_new) for length in lens]
        q, k, v = (torch.stack([data[b][j][new[b]] for b in range(2)]) for j in range(3))
        (out, lse), counted = _counted(lambda: decode(q, k, v, cache, 0, merge=merge, window=window))
        heads = slice(None) if merge == "all_gather" else slice(rank * z // g, (rank + 1) * z // g)
        for b in range(2):
            want = attend(data[b][0][new[b]], new[b], data[b][1][:lens[b] + n_new], data[b][2][:lens[b] + n_new],
                          window)
            check(f"decode step {i} seq {b} ({merge})", out[b], lse[b], (want[0][:, heads], want[1][heads]),
                  counted, decode_bytes(merge, g, 2, n_new, z, D, 8, 8))
        if merge == "all_gather":   # every rank must hold the same bits (generation samples from them)
            every = [out]
            if g > 1:
                every = [torch.empty_like(out) for _ in range(g)]
                torch.distributed.all_gather(every, out.contiguous())
            if not all(torch.equal(o, out) for o in every):
                bad.append((f"decode step {i}: ranks' outputs differ", rank))
    if cache.lengths(0) != total or cache.lengths(1) != [0, 0]:
        bad.append(("cache lengths", cache.lengths(0), total))
    return bad


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("placement,kv_heads", [("round_robin", 2), ("shortest", 1)])
def test_prefill_continue_decode_match_fp64(pools, world_size, placement, kv_heads):
    for rank, bad in enumerate(pools.run(world_size, _scenario, placement, kv_heads, timeout=300)):
        assert not bad, f"rank {rank}: {bad}"


def _every_token_once(placement: str) -> list:
    """After the scenario's calls, the ranks' shards together hold each position exactly once."""
    rank, g = comm.world()
    cache = ShardedKVCache.empty(1, 1, 1, D, dtype=torch.float64, placement=placement)
    q, k, v = sequence(3, 9, 2, 1, D)
    pos = layouts.positions("contiguous", rank, g, 5)
    prefill(q[pos].unsqueeze(0), k[pos].unsqueeze(0), v[pos].unsqueeze(0), cache, 0, layout="contiguous")
    decode(q[5:9].unsqueeze(0), k[5:9].unsqueeze(0), v[5:9].unsqueeze(0), cache, 0)
    return cache.shard(0, 0).pos.tolist()


def _decode_from_empty() -> float:
    """Decode into an empty sequence: at first most ranks' shards are empty (partials 0, lse -inf)."""
    rank, g = comm.world()
    cache = ShardedKVCache.empty(1, 1, 1, D, dtype=torch.float64)
    q, k, v = sequence(4, 4, 3, 1, D)
    worst = 0.0
    for a, b in ((0, 1), (1, 3), (3, 4)):
        out, lse = decode(*(t[a:b].unsqueeze(0) for t in (q, k, v)), cache, 0)
        want = attend(q[a:b], torch.arange(a, b), k[:b], v[:b])
        worst = max(worst, err(out[0], want[0]), err(lse[0], want[1]))
    return worst


def test_decode_from_an_empty_cache(pools):
    assert max(pools.run(3, _decode_from_empty)) <= FP64_TOL


@pytest.mark.parametrize("placement", ["round_robin", "shortest"])
def test_shards_partition_the_positions(pools, placement):
    held = pools.run(3, _every_token_once, placement)
    assert sorted(p for shard in held for p in shard) == list(range(9))
    if placement == "round_robin":   # decode's tokens at t go to rank t mod G
        assert [[p for p in shard if p >= 5] for shard in held] == [[6], [7], [5, 8]]


def _bad_inputs() -> list[str]:
    """Each bad call's message on this rank, with the bytes sent and the cache's lengths after it."""
    rank, g = comm.world()
    cache = ShardedKVCache.empty(2, 1, 1, D, dtype=torch.float64)
    q, k, v = sequence(5, 8, 3, 1, D)     # 3 heads: merge="heads" is valid on each rank alone
    pos = layouts.positions("contiguous", rank, g, 6)
    prefill(q[pos].unsqueeze(0), k[pos].unsqueeze(0), v[pos].unsqueeze(0), cache, 0)
    one = [t[6:7].unsqueeze(0) for t in (q, k, v)]
    calls = {
        "layer": lambda: decode(*one, cache, 2),
        "positions": lambda: decode(*one, cache, 0, positions=torch.tensor([[7]]) if rank == 0 else None),
        "window": lambda: decode(*one, cache, 0, window=2 if rank == 1 else None),
        "merge": lambda: decode(*one, cache, 0, merge="heads" if rank == 2 else "all_gather"),
        "behind": lambda: decode(*one, ShardedKVCache.empty(2, 1, 1, D, dtype=torch.float64) if rank == 1
                                 else cache, 0),
        "continue": lambda: prefill_continue(*(t[6:8 if rank == 1 else 7].unsqueeze(0) for t in (q, k, v)), cache, 0),
    }
    out = bad_input_log(calls, after=lambda: f"lengths {cache.lengths(0)}")
    try:
        cache.check_layers(3)
    except ValueError as e:
        out.append(f"layers: {e}")
    return out


def test_bad_input_is_a_value_error_on_every_rank_before_any_byte(pools):
    per_rank = pools.run(3, _bad_inputs)
    for rank, msgs in enumerate(per_rank):
        text = "\n".join(msgs)
        assert "no error" not in text, text
        assert all(m == "bytes 0 lengths [6]" for m in msgs[1:-1:2]), text
        assert "layer=2 must be an int in [0, n_layers=2)" in msgs[0]
        assert ("past the end of the cache" in msgs[2]) == (rank == 0), text
        assert "window: rank 0: None, rank 1: 2, rank 2: None" in msgs[4]
        assert "merge: rank 0: 'all_gather', rank 1: 'all_gather', rank 2: 'heads'" in msgs[6]
        assert "shards" in msgs[8] and "disagree" in msgs[8]
        assert "the ranks hold [1, 2, 1] new tokens" in msgs[10] and "as [2, 1, 1]" in msgs[10], text
        assert "cache.n_layers=2 must equal the model's n_layers=3" in msgs[12]


def _low_precision(dtype) -> list[tuple[str, float, float]]:
    """(merge, error of the sharded decode, error of single-process attention in the same dtype), vs fp64."""
    rank, g = comm.world()
    q, k, v = sequence(9, 36, 6, 2, 16)
    pos, mask = torch.arange(32, 36), decode_mask(20)
    single, _ = partial_attention(q[32:].to(dtype), pos, k.to(dtype), v.to(dtype), torch.arange(36), mask, 16 ** -0.5)
    out = []
    for merge in ("all_gather", "heads"):
        cache = ShardedKVCache.empty(1, 1, 2, 16, dtype=dtype)
        cache.append(0, 0, k[:32].to(dtype), v[:32].to(dtype), cache.owners(0, 0, 32))   # a prefix, then 4 new
        o, _ = decode(*(t[32:].unsqueeze(0).to(dtype) for t in (q, k, v)), cache, 0, merge=merge, window=20)
        heads = slice(None) if merge == "all_gather" else slice(rank * 6 // g, (rank + 1) * 6 // g)
        want = attend(q[32:], pos, k, v, 20)[0][:, heads]
        out.append((merge, err(o[0], want), err(single[:, heads], want)))
    return out


def test_fp32_and_bf16_decode_within_the_tolerance_policy(pools):
    """docs/testing.md: fp32 within 2e-5 of the largest reference value; bf16 within 2x the error of
    single-process bf16 attention plus a floor of 1e-2."""
    for merge, got, _ in (r for rank in pools.run(3, _low_precision, torch.float32) for r in rank):
        assert got <= 2e-5, (merge, got)
    for merge, got, single in (r for rank in pools.run(3, _low_precision, torch.bfloat16) for r in rank):
        assert got <= 2 * single + 1e-2, (merge, got, single)
