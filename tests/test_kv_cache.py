"""The sharded KV cache alone (burst_impl.inference.kv_cache): placements, positions, bad input."""
from __future__ import annotations

import pytest
import torch

from burst_impl.inference import ShardedKVCache, decode, place
from burst_impl.inference.decode import check_positions
from tests.inference_refs import FP64_TOL, attend, err, sequence


def test_round_robin_puts_position_t_on_rank_t_mod_g():
    assert place("round_robin", [4, 3, 3], 10, 5) == [1, 2, 0, 1, 2]


def test_shortest_fills_the_shortest_shard_lowest_rank_first():
    assert place("shortest", [4, 2, 3], 9, 4) == [1, 1, 2, 0]
    assert place("shortest", [0, 0, 0], 0, 4) == [0, 1, 2, 0]


@pytest.mark.parametrize("kwargs,needle", [
    (dict(placement="striped"), "placement='striped' is unknown"),
    (dict(n_layers=0), "n_layers=0 must be a positive int"),
    (dict(rank=3, world_size=3), "rank=3 must lie in [0, world_size=3)"),
    (dict(rank=1), "give both or neither"),
])
def test_bad_cache_arguments_name_the_parameter(kwargs, needle):
    args = dict(n_layers=2, batch=1, kv_heads=1, head_dim=4) | kwargs
    with pytest.raises(ValueError) as e:
        ShardedKVCache.empty(args.pop("n_layers"), args.pop("batch"), args.pop("kv_heads"), args.pop("head_dim"),
                             **args)
    assert needle in str(e.value)


def test_positions_must_continue_the_sequence():
    with pytest.raises(ValueError, match=r"positions\[1\]=\[3\] lie inside the cache: sequence 1 holds 4"):
        check_positions(torch.tensor([[5], [3]]), [5, 4], 1)
    with pytest.raises(ValueError, match="past the end of the cache"):
        check_positions(torch.tensor([[6]]), [5], 1)


def test_single_rank_decode_of_a_ragged_batch_matches_fp64_and_counts_kv_bytes():
    """W = 1: sequences of 3 and 6 tokens decoded one token at a time, out and lse against the reference."""
    data = [sequence(s, 8, 4, 2, 4) for s in (1, 2)]
    cache = ShardedKVCache.empty(1, 2, 2, 4, dtype=torch.float64, rank=0, world_size=1)
    for b, n in enumerate((3, 6)):   # a ragged start: each sequence's prompt written on its own
        cache.append(0, b, data[b][1][:n], data[b][2][:n], [0] * n)
    for step in range(2):
        lens = cache.lengths(0)
        new = [torch.tensor([n]) for n in lens]
        q, k, v = (torch.stack([data[b][j][new[b]] for b in range(2)]) for j in range(3))
        out, lse = decode(q, k, v, cache, 0, window=2 if step else None)
        for b in range(2):
            want = attend(data[b][0][new[b]], new[b], data[b][1][:lens[b] + 1], data[b][2][:lens[b] + 1],
                          2 if step else None)
            assert max(err(out[b], want[0]), err(lse[b], want[1])) <= FP64_TOL
    assert cache.lengths(0) == [5, 8]
    assert cache.nbytes() == (5 + 8) * 2 * 2 * 4 * 8     # tokens x (K, V) x kv heads x d x fp64


@pytest.mark.parametrize("cache,layer,needle", [
    (None, 0, "cache=NoneType must be a burst_impl.inference.ShardedKVCache"),
    ("cache", 1, "layer=1 must be an int in [0, n_layers=1)"),
    ("other group", 0, "cache.rank, cache.world_size = 1, 2 must be this process's rank and size in group: 0, 1"),
])
def test_decode_rejects_a_bad_cache(cache, layer, needle):
    one = [torch.zeros(1, 1, 2, 4, dtype=torch.float64)] + [torch.zeros(1, 1, 1, 4, dtype=torch.float64)] * 2
    if cache == "cache":
        cache = ShardedKVCache.empty(1, 1, 1, 4, dtype=torch.float64)
    elif cache == "other group":
        cache = ShardedKVCache.empty(1, 1, 1, 4, dtype=torch.float64, rank=1, world_size=2)
    with pytest.raises(ValueError) as e:
        decode(*one, cache, layer)
    assert needle in str(e.value)


@pytest.mark.parametrize("kwargs,needle", [
    (dict(softmax_scale=-1.0), "softmax_scale=-1.0 must be a finite positive number"),
    (dict(backend="nope"), "backend='nope' is unknown"),
    (dict(window=-2), "window=-2 must be a non-negative int"),
    (dict(merge="sum"), "merge='sum' is unknown"),
])
def test_decode_rejects_bad_arguments_without_touching_the_cache(kwargs, needle):
    one = [torch.zeros(1, 1, 2, 4, dtype=torch.float64)] + [torch.zeros(1, 1, 1, 4, dtype=torch.float64)] * 2
    cache = ShardedKVCache.empty(1, 1, 1, 4, dtype=torch.float64)
    with pytest.raises(ValueError) as e:
        decode(*one, cache, 0, **kwargs)
    assert needle in str(e.value) and cache.lengths(0) == [0]


def test_owned_rows_is_the_ranks_rows_as_a_slice_where_it_can():
    from burst_impl.inference.kv_cache import owned_rows

    for owners in ([0], [1], [0, 1, 2, 0, 1, 2, 0], [2, 2, 0, 1], [1, 0, 1, 1, 0], []):
        for rank in range(3):
            rows = owned_rows(owners, rank)
            want = [j for j, o in enumerate(owners) if o == rank]
            assert list(range(len(owners)))[rows] == want if isinstance(rows, slice) else rows == want
    assert owned_rows([0, 1, 2, 0, 1, 2], 1) == slice(1, 5, 3)     # round-robin: every G-th, a view


def test_decode_all_live_agrees_with_the_mask():
    """The host's answer equals the positions' mask for every owner pattern of up to 3 new tokens over a
    cached shard, causal and with a window."""
    import itertools

    from burst_impl.inference.partial import decode_all_live, decode_mask

    cached = torch.tensor([0, 3, 5, 9])                        # this rank's cached positions, all < 10
    for q in (1, 2, 3):
        for owners in itertools.product(range(2), repeat=q):
            for window in (None, 2, 100):
                new = torch.arange(10, 10 + q)
                k_pos = torch.cat([cached, new[[j for j, o in enumerate(owners) if o == 0]]])
                live = decode_mask(window).allowed(new, k_pos)
                if decode_all_live(window, list(owners), 0):
                    assert bool(live.all()), (q, owners, window)
                elif window is None:
                    assert not bool(live.all()), (q, owners)       # exact for the causal mask


@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (6, 1), (4, 4)])
@pytest.mark.parametrize("new", [1, 3])
def test_partial_attention_with_gqa_rows_matches_fp64(heads, kv_heads, new, monkeypatch):
    """Every key live and GQA: the query heads of a KV head run as rows of one head (the kernel gets Zkv query
    heads). The new tokens over the keys before them are all live; over keys that include them (new > 1),
    causal among them takes the masked path. Output and lse against the fp64 reference within FP64_TOL (the
    same arithmetic, reordered)."""
    from burst_impl import masks
    from burst_impl.inference import partial
    seen = []
    monkeypatch.setattr(partial, "attn_forward", lambda q, *a, f=partial.attn_forward, **kw: seen.append(q.shape)
                        or f(q, *a, **kw))
    q, k, v = sequence(3, 40, heads, kv_heads, 16)
    for keys, q_pos in ((37, torch.arange(37, 37 + new)), (40, torch.arange(40 - new, 40))):
        seen.clear()
        out, lse = partial.partial_attention(q[q_pos], q_pos, k[:keys], v[:keys], torch.arange(keys),
                                             masks.Causal(), 16 ** -0.5)
        ref_out, ref_lse = attend(q[q_pos], q_pos, k[:keys], v[:keys])
        assert err(out, ref_out) < FP64_TOL and err(lse, ref_lse) < FP64_TOL, (keys, new)
        all_live = keys == 37 or new == 1
        grouped = all_live and heads > kv_heads          # (1, g Sq, Zkv, d), else (1, Sq, Z, d)
        assert seen == [(1, heads // kv_heads * new, kv_heads, 16) if grouped else (1, new, heads, 16)], seen
