"""burst_usp's cache all-to-alls in the model-level step (checkpoint seq / whole).

Under ``seq``/``whole`` burst_usp's backward starts from the cached (O, lse) (``UspCache``): it sends q, k,
v, O and lse to head shards again, and its forward sends the lse back. The model-level step times those
all-to-alls (``model_level.cache_schedule``) with the bytes of ``schedules.ulysses.usp_cache_bytes``.
Checked: the cache hook's counted bytes on every rank of 2 nodes x 2 ranks equal the registry's
fwd+bwd bytes plus that formula, per (phase, kind); the step charges them under seq/whole only, and
only for burst_usp.
"""
from __future__ import annotations

import pytest

from baselines import AttnShape
from baselines.registry import get
from experiments.perfmodel.model_level import predict_model
from experiments.perfmodel.schedules.ulysses import usp_cache_bytes
from tests.test_usp_variants import B, D, _case, _run


def test_cache_bytes_equal_the_counted(pools):
    c = _case("burst_usp", 4, 2, 16, (4, 2), "zigzag")
    results = pools.run(4, _run, [c], timeout=300)
    shape = AttnShape(B, 16, 4, 2, D, 4, dtype="float32", causal=True, layout="zigzag")
    extra = usp_cache_bytes("burst_usp", shape, "whole", c["options"])
    assert extra[("forward", "a2a_lse")] > 0 and extra[("backward", "a2a_q")] > 0
    for rank, (res,) in enumerate(results):
        want = dict(get("burst_usp").bytes(shape, rank=rank, **c["options"]))
        for k, v in extra.items():
            want[k] = want.get(k, 0) + v
        assert res["hook_counts"] == want, (rank, sorted(set(res["hook_counts"].items()) ^ set(want.items())))


def test_seq_sends_the_half_forward_lse_again():
    s = AttnShape(1, 2048, 8, 8, 32, 8, dtype="float32", causal=True, layout="zigzag")
    whole, seq = usp_cache_bytes("burst_usp", s, "whole"), usp_cache_bytes("burst_usp", s, "seq")
    assert seq[("forward", "a2a_lse")] * 2 == whole[("forward", "a2a_lse")] * 3      # 1 + 1/2 forwards
    back = lambda t: {k: v for k, v in t.items() if k[0] == "backward"}   # noqa: E731
    assert back(seq) == back(whole)
    assert usp_cache_bytes("burst_usp", s, "full") == {} and usp_cache_bytes("loongtrain_usp", s, "whole") == {}


@pytest.mark.parametrize("method, checkpoint, charged", [
    ("burst_usp", "whole", True), ("burst_usp", "seq", True), ("burst_usp", "full", False),
    ("loongtrain_usp", "whole", False), ("burst_double_ring", "whole", False)])
def test_step_charges_the_cache_all_to_alls(method, checkpoint, charged):
    s = AttnShape(1, 1 << 16, 32, 32, 128, 32, dtype="bfloat16", causal=True, layout="zigzag")
    p = predict_model(method, "llama2_7b", s, mode="fwd_bwd", hardware="a800_ib_8x8", checkpoint=checkpoint,
                      weights="fsdp2", loss="fused")
    assert (p.parts["cache_a2a"] > 0) == charged
    if charged:     # one layer's placed bytes are the formula's
        assert p.cache_bytes == usp_cache_bytes(method, s, checkpoint)
