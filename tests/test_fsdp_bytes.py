"""FSDP2's bytes: the one formula (``fsdp.step_bytes``) against a built model and against a real step.

* ``config_step_bytes(cfg, G, e)`` (the performance model's, no model built) equals ``comm_bytes(model)``
  (the harness's, from the built model's parameters) for G that pads dim 0 (5) and G that does not (2);
* on a gloo group, a training step of the FSDP2-sharded tiny model issues exactly the collectives the
  formula counts: the bytes of every ``all_gather_single`` / ``reduce_scatter_single`` FSDP2 calls
  (``_fsdp_collectives.py``, ``DefaultAllGather`` / ``DefaultReduceScatter``), counted as one rank's ring
  sends ((G-1) shards of the gathered buffer; 2 (G-1) shards of the reduced one, which gloo all-reduces:
  ``fsdp.REDUCE_SCATTER_STEPS``), by phase (before / after ``backward()``), equal the formula's.
  Integers: exact. (It failed before the formula re-gathered the root in the backward: ``shard_weights``
  passes ``reshard_after_forward=True`` to the root as well.)
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from burst_impl.model import build_model, get_config, loss_and_grads, sequence_parallel
from burst_impl.model.fsdp import comm_bytes, config_step_bytes, shard_weights
from burst_impl.model.parallel import ParallelPlan
from baselines.registry import get
from tests.model_refs import global_batch


@pytest.mark.parametrize("name,world_size", [("tiny", 5), ("tiny_gqa", 2), ("cpu_small", 5)])
def test_config_formula_is_the_model_formula(name, world_size):
    cfg = get_config(name)
    model = build_model(cfg)
    model.parallel = ParallelPlan("sp", world_size=world_size)
    want = comm_bytes(model)
    assert config_step_bytes(cfg, world_size, 4) == want
    # reshard_after_forward=False drops the backward's re-gather
    got = config_step_bytes(cfg, world_size, 4, reshard_after_forward=False)
    assert got == {k: v for k, v in want.items() if k != ("backward", "fsdp.params")}
    gloo = config_step_bytes(cfg, world_size, 4, backend="gloo")
    assert gloo == comm_bytes(model, backend="gloo")
    assert gloo[("backward", "fsdp.grads")] == 2 * want[("backward", "fsdp.grads")]


def _counted_fsdp_step(cfg_name: str, method: str) -> dict:
    """On every rank: one training step of the FSDP2-sharded model with FSDP2's collectives counted."""
    counted: dict = {}
    phase = ["forward"]
    ag, rs = dist.all_gather_single, dist.reduce_scatter_single
    G = dist.get_world_size()

    def all_gather_single(output_tensor, input_tensor, *a, **kw):
        key = (phase[0], "fsdp.params")
        counted[key] = counted.get(key, 0) + input_tensor.numel() * input_tensor.element_size() * (G - 1)
        return ag(output_tensor, input_tensor, *a, **kw)

    def reduce_scatter_single(output, input, *a, **kw):
        key = (phase[0], "fsdp.grads")      # gloo all-reduces the input: 2 (G-1) shards
        counted[key] = counted.get(key, 0) + 2 * output.numel() * output.element_size() * (G - 1)
        return rs(output, input, *a, **kw)

    model = shard_weights(sequence_parallel(build_model(get_config(cfg_name)), get(method), layout="zigzag"))
    dist.all_gather_single, dist.reduce_scatter_single = all_gather_single, reduce_scatter_single
    try:
        tokens, labels = global_batch(cfg_name)
        # loss_and_grads runs the forward and the backward; the phase flips when autograd starts
        orig = torch.Tensor.backward

        def backward(self, *a, **kw):
            phase[0] = "backward"
            return orig(self, *a, **kw)

        torch.Tensor.backward = backward
        try:
            loss_and_grads(model, tokens, labels)
        finally:
            torch.Tensor.backward = orig
    finally:
        dist.all_gather_single, dist.reduce_scatter_single = ag, rs
    return {"counted": counted, "formula": comm_bytes(model)}


@pytest.mark.parametrize("world_size", [3])   # 3 pads dim 0 of the tiny vocabulary (64)
def test_fsdp2_step_sends_the_formula(pools, world_size):
    for rank, res in enumerate(pools.run(world_size, _counted_fsdp_step, "tiny", "burst")):
        assert res["counted"] == res["formula"], f"rank {rank}: counted {res['counted']} vs formula {res['formula']}"
