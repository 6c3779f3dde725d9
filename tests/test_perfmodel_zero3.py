"""ZeRO-3's (FSDP2's) collectives in the model-level step: ``experiments/perfmodel/schedules/zero3.py``.

Synthetic timelines whose answer is known in closed form (exact up to float rounding, 1e-12 s), the
collectives' bytes against the one formula, and the headline's rows.
"""
from __future__ import annotations

import pytest

from baselines import AttnShape
from burst_impl.model.config import get_config
from burst_impl.model.fsdp import config_step_bytes
from experiments.perfmodel.costs import CostModel
from experiments.perfmodel.model import _cost_model
from experiments.perfmodel.model_level import predict_model
from experiments.perfmodel.placement import Placement
from experiments.perfmodel.schedules.zero3 import Collectives, Window, collectives, step_seconds
from experiments.profiles.hardware import load_hardware

L = 4
COLL = Collectives(block_gather=0.1, block_scatter=0.2, root_gather=0.3, root_scatter=0.4, block_copies=(0.0, 0.0),
                   root_copies=(0.0, 0.0), channel="send.inter", bytes={})
ALL_COMM = 2 * (0.3 + L * 0.1) + 0.4 + L * 0.2


def test_without_side_streams_every_collective_is_exposed():
    fwd, bwd = Window(1.0), Window(2.0)
    t = step_seconds(fwd, bwd, Window(0.5), Window(0.5), L, COLL, side_streams=False)
    assert t == pytest.approx(L * 3.0 + 1.0 + ALL_COMM, abs=1e-12)


def test_long_blocks_hide_all_but_the_ends():
    # forward: the root's and block 0's gathers before the first block; the rest one block ahead, hidden.
    # backward: the root's gather again (the head's backward waits; block L-1's runs beside it and, the head
    # taking no time here, is exposed too); the last block's and the root's reduce-scatters after the compute.
    fwd, bwd = Window(10.0), Window(20.0)
    t = step_seconds(fwd, bwd, Window(0.0), Window(0.0), L, COLL, side_streams=True)
    exposed = (0.3 + 0.1) + (0.3 + 0.1) + (0.2 + 0.4)
    assert t - L * 30.0 == pytest.approx(exposed, abs=1e-12)


def test_a_channel_held_by_the_attention_leaves_only_the_gaps():
    # busy = seconds: the method's own transfers hold the channel for the whole of every compute op, so no
    # collective advances under compute: the step is the blocking one
    fwd, bwd, head = Window(1.0, busy=1.0), Window(2.0, busy=2.0), Window(0.5, busy=0.5)
    t = step_seconds(fwd, bwd, head, head, L, COLL, side_streams=True)
    assert t == pytest.approx(L * 3.0 + 1.0 + ALL_COMM, abs=1e-12)


def test_half_the_channel_halves_the_rate():
    # one block, no head: the root's and the block's gathers (0.4 s) before the forward (1 s); backward: the
    # root's gather (0.3) and, queued behind it with no head to hide under, the block's (0.1); the block's
    # backward (2 s), its scatter (0.2) and the root's (0.4)
    coll = Collectives(0.1, 0.2, 0.3, 0.4, (0.0, 0.0), (0.0, 0.0), "send.inter", {})
    t = step_seconds(Window(1.0, 0.5), Window(2.0, 1.0), Window(0.0), Window(0.0), 1, coll, side_streams=True)
    assert t == pytest.approx(0.4 + 1.0 + 0.3 + 0.1 + 2.0 + 0.2 + 0.4, abs=1e-12)
    # two blocks: the second block's gather (0.1 s alone) runs under the first block's forward (0.15 s, half the
    # channel taken) at half its rate, 0.075 s of it, and the other 0.025 s after; the backward's block gathers
    # hide under the 5 s backwards except the one behind the root's
    t2 = step_seconds(Window(0.15, 0.075), Window(5.0), Window(0.0), Window(0.0), 2, coll, side_streams=True)
    exposed = 0.4 + (0.1 - 0.15 / 2) + 0.3 + 0.1 + 0.2 + 0.4
    assert t2 - 2 * (0.15 + 5.0) == pytest.approx(exposed, abs=1e-12)


class _GlooCosts(CostModel):
    collectives_backend = "gloo"


@pytest.mark.parametrize("world_size,backend", [(4, "nccl"), (8, "nccl"), (4, "gloo")])
def test_the_collectives_send_the_formula(world_size, backend):
    hw = load_hardware("a800_ib_4x8")
    cfg = get_config("cpu_small")
    shape = AttnShape(batch=1, seqlen=2048, heads=8, kv_heads=8, head_dim=32, world_size=world_size,
                      dtype="bfloat16", causal=True, layout="zigzag")
    cost = _GlooCosts(hw, "bfloat16") if backend == "gloo" else _cost_model(hw, "bfloat16")
    coll = collectives(cfg, shape, cost, Placement.of(hw, world_size))
    assert coll.bytes == config_step_bytes(cfg, world_size, 2, backend=backend)
    # gloo's reduce-scatter is an all-reduce: twice the ring steps and bytes, so (about) twice the time
    if backend == "gloo":
        nccl = collectives(cfg, shape, _cost_model(hw, "bfloat16"), Placement.of(hw, world_size))
        assert coll.block_scatter > 1.9 * nccl.block_scatter and coll.block_gather == nccl.block_gather


def test_zero3_costs_the_headline_burst_time():
    """Fig. 3's Burst with ZeRO-3 is slower than without it at 128K on 32 A100 (its collectives share the
    RoCE/PCIe links with the ring), and its extra time is the exposed part of the collectives."""
    hw = load_hardware("a100_pcie_roce_4x8")
    shape = AttnShape(batch=1, seqlen=131072, heads=32, kv_heads=32, head_dim=128, world_size=32,
                      dtype="bfloat16", causal=True, layout="zigzag")
    rep = predict_model("burst", "llama2_7b", shape, mode="fwd_bwd", hardware=hw)
    zero = predict_model("burst", "llama2_7b", shape, mode="fwd_bwd", hardware=hw, weights="fsdp2")
    assert zero.parts["zero3_exposed"] > 0 and rep.parts["zero3_exposed"] == 0
    assert zero.time_s == pytest.approx(rep.time_s - rep.parts["grad_sync_exposed"] + zero.parts["zero3_exposed"])
