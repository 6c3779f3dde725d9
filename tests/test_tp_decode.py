"""The tensor-parallel decode baseline (baselines/tp_decode.py): head-sharded caches, KV heads
replicated where G > Zkv, against the fp64 reference; attention sends nothing."""
from __future__ import annotations

import pytest
import torch

from baselines.tp_decode import tp_cache, tp_decode, tp_heads
from burst_impl import comm
from tests.inference_refs import FP64_TOL, attend, err, sequence

D = 4


def test_heads_split_and_kv_replication():
    assert tp_heads(8, 4, 2, 1) == (slice(4, 8), slice(2, 4))
    assert [tp_heads(8, 2, 4, r)[1] for r in range(4)] == [slice(0, 1), slice(0, 1), slice(1, 2), slice(1, 2)]
    with pytest.raises(ValueError, match="heads=6 must be divisible by the tensor-parallel size 4"):
        tp_heads(6, 2, 4, 0)
    with pytest.raises(ValueError, match="kv_heads=6 must be divisible by the tensor-parallel size 4"):
        tp_heads(12, 6, 4, 0)
    with pytest.raises(ValueError, match="tensor-parallel size 4 must be a multiple of kv_heads=3"):
        tp_heads(12, 3, 4, 0)


def _tp_run(heads: int, kv_heads: int) -> tuple[float, int, int]:
    """Prefill 5 tokens, decode 1 then 2; worst error over the rank's heads, bytes sent, cache bytes."""
    rank, g = comm.world()
    qh, kvh = tp_heads(heads, kv_heads, g, rank)
    q_all, k_all, v_all = sequence(11, 8, heads, kv_heads, D)
    cache = tp_cache(1, 1, heads, kv_heads, D, dtype=torch.float64)
    worst, sent = 0.0, 0
    start = 0
    for n in (5, 1, 2):
        new = torch.arange(start, start + n)
        with comm.count_bytes() as counts:
            out, lse = tp_decode(q_all[new][:, qh].unsqueeze(0), k_all[new][:, kvh].unsqueeze(0),
                                 v_all[new][:, kvh].unsqueeze(0), cache, 0)
        sent += counts.total()
        want = attend(q_all[new], new, k_all[:start + n], v_all[:start + n])
        worst = max(worst, err(out[0], want[0][:, qh]), err(lse[0], want[1][qh]))
        start += n
    return worst, sent, cache.nbytes()


@pytest.mark.parametrize("world_size,heads,kv_heads", [(2, 4, 4), (3, 6, 1), (4, 8, 2)])
def test_tp_decode_matches_fp64_and_sends_nothing(pools, world_size, heads, kv_heads):
    for worst, sent, held in pools.run(world_size, _tp_run, heads, kv_heads):
        assert worst <= FP64_TOL
        assert sent == 0
        # every token of max(1, Zkv/G) KV heads: replicated heads cost capacity
        assert held == 8 * 2 * max(1, kv_heads // world_size) * D * 8
