"""Loss parity in a timed training record (``model.loss_parity``, experiments/harness/model_parity.py).

On 2 gloo ranks, the tiny decoder trained 3 steps by Burst (replicated and FSDP2) and TP-V3, as a
model-level case builds it: the record's fields say each step's loss equals the single-process model's
within the dtype's rounding bound. A deliberately perturbed run (the LM head's weights scaled by 1.02 on
every rank before training: a 2% error in every logit, 5e-3 of the loss at this init) must be flagged,
missing the bound by > 100x: the check can fail.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from baselines import AttnShape
from experiments.harness.case import Case
from experiments.harness.model_parity import LOSS_RTOL, parity, parity_fields
from experiments.harness.model_steps import build_model_run
from burst_impl.model.step import train_step

STEPS = 3
ROWS = (("burst", False, False), ("burst", True, False), ("tp_v3", False, False), ("burst", False, True))


def _case(method: str, zero: bool) -> Case:
    shape = AttnShape(1, 32, 12, 12, 8, 2, dtype="float32", causal=True, layout="zigzag")
    return Case(experiment="t_parity", method=method, level="model", mode="train", shape=shape, warmup=0,
                repeats=1, seed=0, model="tiny", zero=zero, loss_parity=True)


def _train(rows) -> list[dict]:
    out = []
    for method, zero, perturb in rows:
        case = _case(method, zero)
        torch.manual_seed(case.seed)
        run = build_model_run(case, group=dist.group.WORLD, device=torch.device("cpu"))
        if perturb:            # the same wrong weights on every rank: a method that computes another function
            with torch.no_grad():
                run.model.output.weight.mul_(1.02)
        for _ in range(STEPS):
            run.losses.append(train_step(run.model, run.optimizer, run.tokens, run.labels))
        out.append(parity_fields(case, run, torch.device("cpu")) if dist.get_rank() == 0 else None)
    return out


def test_record_loss_parity_and_a_perturbed_run(pools):
    fields = pools.run(2, _train, ROWS, timeout=300)[0]
    rtol = LOSS_RTOL["float32"]
    for (method, zero, perturb), f in zip(ROWS, fields):
        assert len(f["reference_train_losses"]) == STEPS and f["loss_rtol"] == rtol and f["loss_rtol_reason"]
        if perturb:
            assert not f["loss_equal"] and f["loss_rel_diff"] > 100 * rtol, (method, f["loss_rel_diff"])
        else:
            assert f["loss_equal"], (method, zero, f["loss_rel_diff"])


def test_parity_refuses_a_different_number_of_steps():
    with pytest.raises(ValueError, match="same number of steps"):
        parity([1.0, 2.0], [1.0], "float32")
    case = _case("burst", False)
    assert parity_fields(Case(**{**case.__dict__, "loss_parity": False}), None, torch.device("cpu")) == {}


def test_report_shows_each_rows_parity():
    from experiments.report.parity import parity_blocks

    base = {"status": "ok", "seqlen": 1024, "world_size": 4, "losses": [7.4, 7.3], "loss_rtol": 2e-5,
            "loss_rtol_reason": "rounding only"}
    recs = [{**base, "method": "burst", "zero": True, "loss_rel_diff": 6e-8, "loss_equal": True},
            {**base, "method": "tp_v3", "zero": False, "loss_rel_diff": 3e-3, "loss_equal": False},
            {**base, "method": "ring", "loss_equal": None}]          # did not check: not shown
    para, table = parity_blocks(recs)
    assert "rounding only" in para.pieces[0]
    assert [r[0] for r in table.rows] == ["burst + ZeRO-3 (FSDP2)", "tp_v3"]
    assert [r[-1] for r in table.rows] == ["equal", "DIFFERS"] and table.rows[0][2] == "2"
    assert parity_blocks([{**base, "method": "ring"}]) == []
