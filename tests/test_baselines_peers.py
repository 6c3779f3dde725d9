"""Cross-checks against code no one here wrote, on gloo.

* our ``ulysses`` against DeepSpeed's ``DistributedAttention``
  (deepspeed.sequence.layer; pinned in the Makefile) around the same local
  kernel: outputs and gradients;
* our ``burst`` and ``ring`` forward against PyTorch's own ring attention,
  ``torch.distributed.tensor.experimental._context_parallel._attention.
  _templated_ring_attention`` (private API) with the CPU flash kernel.
Both sides are also checked against the fp64 reference, so a disagreement
says which side is wrong.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from burst_impl import burst_attn_func
from burst_impl.layout import shard
from tests._helpers import deepspeed_comm_without_shm_op
from tests.refs import attention_reference, make_inputs, max_err

from baselines.methods.deepspeed_ulysses import deepspeed_available

needs_deepspeed = pytest.mark.skipif(not deepspeed_available(),
                                     reason="deepspeed not installed (make venv installs it)")


B, D = 2, 16
# Both sides are fp32 with the same local kernel: a peer's result may differ
# from ours only by reduction order. Against fp64, the bound of
# test_baselines.py (2e-5 relative) holds for both; between the two, twice that.
FP32_RTOL = 2e-5


def _ours_vs_deepspeed(z, zkv, causal, mask=None):
    from baselines.methods.deepspeed_ulysses import deepspeed_ulysses_adapter
    from baselines.methods.ulysses import ulysses_attn_func

    deepspeed_comm_without_shm_op()        # the all-to-alls compared do not use it; its build costs ~40 s
    rank, G = dist.get_rank(), dist.get_world_size()
    q, k, v, do = make_inputs(B, 8 * G, z, zkv, D)
    res = {}
    for name, fn in (("ours", ulysses_attn_func), ("deepspeed", deepspeed_ulysses_adapter)):
        ql, kl, vl, dol = [shard(t, "contiguous", rank, G).requires_grad_(i < 3) for i, t in enumerate((q, k, v, do))]
        out = fn(ql, kl, vl, causal=causal, **({} if mask is None else {"mask": mask}))
        out.backward(dol)
        res[name] = dict(out=out.detach(), dq=ql.grad, dk=kl.grad, dv=vl.grad)
    return res


@needs_deepspeed
@pytest.mark.parametrize("world_size,causal,heads", [(2, True, (4, 4)), (2, False, (4, 2)), (4, True, (8, 4)),
                                                     (4, False, (4, 4))])
def test_ulysses_matches_deepspeed(pools, world_size, causal, heads):
    _check_ulysses_vs_deepspeed(pools, world_size, causal, heads, None)


@needs_deepspeed
@pytest.mark.parametrize("causal,heads,mask", [(True, (4, 2), "window:3:0"), (True, (4, 4), "docs:5:1"),
                                               (False, (4, 4), "bsparse:4:0.3:2")])
def test_masked_ulysses_matches_deepspeed(pools, causal, heads, mask):
    """Masks through DeepSpeed's DistributedAttention (its all-to-alls, our masked local kernel on the
    whole sequence): a causal window of 3 tokens, seeded documents, block-sparse without causal."""
    _check_ulysses_vs_deepspeed(pools, 2, causal, heads, mask)


def _check_ulysses_vs_deepspeed(pools, world_size, causal, heads, mask):
    z, zkv = heads
    results = pools.run(world_size, _ours_vs_deepspeed, z, zkv, causal, mask)
    ref = attention_reference(*(t.double() for t in make_inputs(B, 8 * world_size, z, zkv, D)), causal, mask=mask)
    for rank, res in enumerate(results):
        for name in ("out", "dq", "dk", "dv"):
            scale = max(ref[name].abs().max().item(), 1.0)
            expect = shard(ref[name], "contiguous", rank, world_size)
            for side in ("ours", "deepspeed"):
                assert max_err(res[side][name], expect) <= FP32_RTOL * scale, (side, rank, name)
            assert max_err(res["ours"][name], res["deepspeed"][name]) <= 2 * FP32_RTOL * scale, (rank, name)


def _deepspeed_uneven_heads(z):
    """DeepSpeed with a head count not divisible by G and an explicit group."""
    import datetime

    from baselines.methods.deepspeed_ulysses import _LocalAttnModule, _ensure_deepspeed_comm
    from deepspeed.sequence.layer import DistributedAttention
    from deepspeed.utils import groups

    deepspeed_comm_without_shm_op()
    _ensure_deepspeed_comm()
    rank, G = dist.get_rank(), dist.get_world_size()
    # A fresh group of all ranks with a short timeout: the failing all-to-all breaks
    # only this group, and the rank left waiting gives up after 5 s.
    sp = dist.new_group(list(range(G)), timeout=datetime.timedelta(seconds=5))
    q, k, v, _ = make_inputs(1, 4 * G, z, z, 8)
    q, k, v = (shard(t, "contiguous", rank, G) for t in (q, k, v))
    attn = DistributedAttention(_LocalAttnModule(True, None), sp, scatter_idx=2, gather_idx=1)
    try:
        attn(q, k, v, 0)
        outcome = "ok"
    except Exception as e:  # noqa: BLE001 - the defect shows as a failed collective
        outcome = f"{type(e).__name__}: {e}"
    t = torch.ones(1)
    dist.all_reduce(t)  # the default group is unaffected
    return dict(rank_in_group=dist.get_rank(sp), deepspeed_rank=groups._get_sequence_parallel_rank(),
                outcome=outcome)


@needs_deepspeed
@pytest.mark.peer_defect
def test_deepspeed_uneven_heads_ignores_the_group_it_is_given(pools):
    """deepspeed 0.19.8: with Z % G != 0 DistributedAttention takes the uneven-heads
    path, which reads this rank's index from deepspeed.utils.groups
    (``_get_sequence_parallel_rank()``, 0 on every rank unless a DeepSpeed mpu or
    mesh is registered) instead of from the process group passed to it. Rank 1
    then sizes its all-to-all as if it were rank 0 and the collective fails (gloo
    enforces matching lengths; NCCL would hang or misplace data). Our ``ulysses``
    refuses such shapes with a ValueError before communicating."""
    res = pools.run(2, _deepspeed_uneven_heads, 3)
    assert [r["rank_in_group"] for r in res] == [0, 1]
    assert [r["deepspeed_rank"] for r in res] == [0, 0], "defect fixed upstream? update the README and this test"
    assert all(r["outcome"] != "ok" for r in res), res


def _ours_vs_torch_cp(cfg):
    from torch.distributed.tensor.experimental._context_parallel import _attention as cp

    from baselines.methods.ring import ring_attn_func

    rank, G = dist.get_rank(), dist.get_world_size()
    z, zkv, layout, causal = cfg["heads"], cfg["kv_heads"], cfg["layout"], cfg["causal"]
    q, k, v, _ = make_inputs(B, 4 * G, z, zkv, D)
    ql, kl, vl = (shard(t, layout, rank, G) for t in (q, k, v))
    ours = {"burst": burst_attn_func(ql, kl, vl, causal=causal, layout=layout, return_lse=True),
            "ring": (ring_attn_func(ql, kl, vl, causal=causal, layout=layout), None)}
    # PyTorch CP: (B, Z, S, d), its CPU flash op takes equal head counts, so kv heads are expanded
    # locally (numerically the same attention). Zigzag == its round-robin load balancing.
    old = cp._cp_options.enable_load_balance
    cp._cp_options.enable_load_balance = layout == "zigzag"
    try:
        rep = z // zkv
        out, lse, *_ = cp._templated_ring_attention(
            dist.group.WORLD, 2, torch.ops.aten._scaled_dot_product_flash_attention_for_cpu,
            ql.transpose(1, 2), kl.repeat_interleave(rep, 2).transpose(1, 2),
            vl.repeat_interleave(rep, 2).transpose(1, 2), is_causal=causal)
    finally:
        cp._cp_options.enable_load_balance = old
    return dict(torch=(out.transpose(1, 2), lse), **ours)


@pytest.mark.parametrize("world_size,causal,layout,heads", [
    (2, True, "contiguous", (4, 4)), (3, True, "zigzag", (4, 2)), (4, True, "zigzag", (4, 4)),
    (4, False, "contiguous", (4, 2)),
])
def test_burst_and_ring_forward_match_torch_context_parallel(pools, world_size, causal, layout, heads):
    z, zkv = heads
    cfg = dict(heads=z, kv_heads=zkv, layout=layout, causal=causal)
    results = pools.run(world_size, _ours_vs_torch_cp, cfg)
    ref = attention_reference(*(t.double() for t in make_inputs(B, 4 * world_size, z, zkv, D)), causal)
    tol = FP32_RTOL * max(ref["out"].abs().max().item(), 1.0)
    for rank, res in enumerate(results):
        expect = shard(ref["out"], layout, rank, world_size)
        for side in ("torch", "burst", "ring"):
            assert max_err(res[side][0], expect) <= tol, (side, rank)
        assert max_err(res["burst"][0], res["torch"][0]) <= 2 * tol
        assert max_err(res["ring"][0], res["torch"][0]) <= 2 * tol
        lse_tol = FP32_RTOL * max(ref["lse"].abs().max().item(), 1.0)
        assert max_err(res["burst"][1], res["torch"][1]) <= 2 * lse_tol


def test_stale_deepspeed_build_lock_removed_fresh_one_kept(tmp_path, monkeypatch):
    """A build lock older than STALE_LOCK_S (a killed JIT build) is removed before DeepSpeed's comm
    starts, else torch waits on it forever; a fresh one (a build in progress) is left alone."""
    import os
    import time

    from baselines.methods import deepspeed_ulysses as ds

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    lock = tmp_path / "deepspeed_shm_comm" / "lock"
    lock.parent.mkdir()
    lock.touch()
    ds._clear_stale_build_lock()
    assert lock.exists()
    old = time.time() - ds.STALE_LOCK_S - 5
    os.utime(lock, (old, old))
    ds._clear_stale_build_lock()
    assert not lock.exists()
