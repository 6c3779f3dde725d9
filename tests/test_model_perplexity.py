"""Perplexity parity (BurstAttention Table 4) as a model-level measurement: ``measure.modes: [perplexity]``
trains every method's model a few steps and evaluates held-out perplexity next to the single-process
model (``experiments/harness/model_perplexity.py``); the spec rules of the mode; the shipped specs."""
from __future__ import annotations

import json

import pytest
import torch

from experiments.harness.model_perplexity import PPL_RTOL, perplexity_record
from experiments.harness.spec import EXPERIMENTS_DIR, load_spec, parse_spec

# Every method that trains a model, "burst without LAO" as burst on the math kernel (materialised scores),
# and TP without FlashAttention likewise: the rows of the paper's Table 4 and the suite's other methods.
METHODS = ["burst", "ring_rsa", "ring", "ulysses", "usp", "burst_double_ring", "tp_v1", "tp_v3"]
BASE = {
    "name": "t_ppl",
    "methods": METHODS,
    "kernels": ["auto", "math"],
    "exclude": [{"method": m, "kernel": "math"} for m in METHODS if m not in ("burst", "tp_v1")],
    "sweep": {"seqlen": 48, "world_size": 2, "layout": "zigzag", "dtype": "float32"},
    "measure": {"modes": ["perplexity"], "level": "model"},
    "model": {"name": "tiny", "train_steps": 3, "eval_tokens": 96, "lr": 1e-2},
    "warmup": 0,
    "repeats": 1,
    "cluster": "cpu",
}


def _spec(**over):
    raw = json.loads(json.dumps(BASE))
    raw.update(over)
    return parse_spec(raw, "t.yaml")


@pytest.mark.parametrize("model,key,rule", [
    ({"name": "tiny", "eval_tokens": 96}, "'model.train_steps'", "0 must be > 0 with measure.modes"),
    ({"name": "tiny", "train_steps": 2}, "'model.eval_tokens'", "0 must be > 0"),
    ({"name": "tiny", "train_steps": 2, "eval_tokens": 8}, "'model.eval_tokens'", "must be at least seqlen=48"),
    ({"name": "tiny", "train_steps": 2, "eval_tokens": 96, "corpus": "c4"}, "'model.corpus'", "'c4' is not a corpus"),
    ({"name": "tiny", "train_steps": 2, "eval_tokens": 96, "lr": 0}, "'model.lr'", "must be > 0"),
])
def test_perplexity_rules_name_key_and_rule(model, key, rule):
    with pytest.raises(ValueError, match=f"t.yaml: key {key}.*{rule}"):
        _spec(model=model)


def test_perplexity_cases_are_the_table_rows():
    ids = {c.case_id.split(".")[0] + ("." + c.kernel if c.kernel else "") for c in _spec().cases()}
    assert ids == {*METHODS, "burst.math", "tp_v1.math"}


def _run_all(raw: dict) -> list[dict]:
    """On every rank of the pool: each case's perplexity record (rank 0), None elsewhere."""
    spec = parse_spec(raw, "t.yaml")
    rank = torch.distributed.get_rank()
    return [perplexity_record(c, rank=rank, world=2, device=torch.device("cpu")) for c in spec.cases()]


def test_perplexity_parity_across_methods(pools):
    """W = 2, tiny model, 3 AdamW steps: every method's held-out perplexity equals the single-process
    model's within the fp32 tolerance, and training moved it (the check is not of an untrained model)."""
    recs = pools.run(2, _run_all, BASE, timeout=300)[0]
    assert len(recs) == len(METHODS) + 2
    ref = recs[0]["perplexity_reference"]
    for r in recs:
        assert r["perplexity_reference"] == ref                 # one single-process reference for all
        assert r["perplexity_equal"] and r["perplexity_rel_diff"] <= PPL_RTOL["float32"], (r["case_id"], r)
        assert r["perplexity"] < 0.9 * r["perplexity_before"], r["case_id"]
        assert len(r["train_losses"]) == 3 and r["checkpoint"] == "none"


def test_shipped_perplexity_spec_loads():
    spec = load_spec(EXPERIMENTS_DIR / "cpu" / "cpu_model_table4_perplexity.yaml")
    rows = {(c.method, c.kernel) for c in spec.cases()}
    assert {("burst", "math"), ("burst", None), ("ring_rsa", None), ("tp_v1", "math"), ("tp_v1", None)} <= rows
    assert {"ring", "ulysses", "usp", "burst_double_ring", "tp_v3"} <= {m for m, _ in rows}
    assert spec.measure.modes == ("perplexity",) and spec.model.train_steps > 0
