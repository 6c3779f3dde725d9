"""Model-level measurements (``measure.level: model``): spec rules, the ``math`` kernel, one record per
case in-process at world size 1, and a 2-rank launch whose counted bytes equal the step formula."""
from __future__ import annotations

import json

import pytest
import torch
import yaml

from burst_impl.kernels import attn_backward, attn_forward, compute_delta
from burst_impl.model import get_config, model_flops
from experiments.harness import results as R
from experiments.harness.spec import load_any, parse_spec
from experiments.harness.worker import run_case

BASE = {
    "name": "t_model",
    "methods": ["burst", "tp_v3"],
    "sweep": {"seqlen": 64, "world_size": 2, "layout": "zigzag", "dtype": "float32"},
    "measure": {"modes": ["train"], "level": "model"},
    "model": {"name": "tiny"},
    "warmup": 0,
    "repeats": 1,
    "cluster": "cpu",
}


def _spec(**over):
    raw = json.loads(json.dumps(BASE))
    for k, v in over.items():
        if v is None:
            raw.pop(k)
        else:
            raw[k] = v
    return parse_spec(raw, "t.yaml")


# ---------------------------------------------------------------- spec rules


def test_cases_take_the_model_shape_and_zero_axis():
    spec = _spec(model={"name": "tiny", "zero": [False, True]}, exclude=[{"method": "tp_v3", "zero": True}],
                 kernels=["cpu_flash", "math"])
    ids = {c.case_id for c in spec.cases()}
    cfg = get_config("tiny")
    assert all(c.heads == cfg.n_heads and c.head_dim == cfg.head_dim for c in spec.cases())
    assert "burst.model.train.N64.G2.B1.Z12.kv12.d8.float32.causal.zigzag.tiny.zero.math" in ids
    assert not any(i.startswith("tp_v3") and ".zero" in i for i in ids) and len(ids) == 6


@pytest.mark.parametrize("over,key,rule", [
    ({"model": None}, "'model'", "is required at measure.level: model"),
    ({"measure": {"level": "layer"}}, "'model'", "only for measure.level: model"),
    ({"model": {"name": "gpt5"}}, "'model.name'", "'gpt5' is not a model"),
    ({"model": {"name": "tiny", "optimizer": "lion"}}, "'model.optimizer'", "'lion' is unknown"),
    ({"sweep": {**BASE["sweep"], "heads": 8}}, "'sweep.heads'", "is set by model 'tiny'"),
    ({"measure": {"level": "model", "modes": ["fwd_bwd"]}}, "'measure.modes'", "not a model-level mode"),
    ({"sweep": {**BASE["sweep"], "causal": False}}, "'sweep.causal'", "must be true"),
    ({"model": {"name": "tiny", "zero": [True]}}, "'model.zero'", "tensor parallel"),
    # tiny has 12 heads: TP over 5 ranks cannot split them
    ({"sweep": {**BASE["sweep"], "world_size": 5, "seqlen": 100}}, "'sweep", "divisible"),
])
def test_bad_model_specs_name_key_and_rule(over, key, rule):
    with pytest.raises(ValueError, match=f"t.yaml: key {key}.*{rule}"):
        _spec(**over)


def test_train_mode_needs_model_level():
    raw = {**BASE, "measure": {"modes": ["train"], "level": "op"}, "methods": ["burst"]}
    raw.pop("model")
    raw["sweep"] = {**BASE["sweep"], "heads": 2, "head_dim": 8}
    with pytest.raises(ValueError, match="'measure.modes'.*needs measure.level: model"):
        parse_spec(raw, "t.yaml")


def test_shipped_model_specs_load():
    specs = [s for p in ("cpu", "paper") for s in load_any(p).specs if s.measure.level == "model"]
    names = {s.name for s in specs}
    assert {"model_fig2_train_7b_8gpu", "model_fig3_train_7b_32gpu", "model_fig4b_batch_7b_4k",
            "model_table2_prefill_7b_8gpu", "model_table3_prefill_13b_8gpu"} <= names
    assert any(n.startswith("cpu_model") for n in names)


# ---------------------------------------------------------------- the math kernel


@pytest.mark.parametrize("causal", [True, False])
def test_math_kernel_matches_reference(causal):
    """fp64 inputs: both compute in fp64, so they agree to rounding (1e-12); GQA 4 -> 2 heads, Sq = Sk."""
    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(2, 24, z, 16, generator=g, dtype=torch.float64) for z in (4, 2, 2, 4))
    scale = 0.25
    got, lse = attn_forward(q, k, v, causal=causal, scale=scale, backend="math")
    ref, lse_ref = attn_forward(q, k, v, causal=causal, scale=scale, backend="reference")
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, lse_ref, rtol=1e-12, atol=1e-12)
    delta = compute_delta(do, ref)
    for a, b in zip(attn_backward(do, q, k, v, lse_ref, delta, causal=causal, scale=scale, backend="math"),
                    attn_backward(do, q, k, v, lse_ref, delta, causal=causal, scale=scale, backend="reference")):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------- records


@pytest.mark.parametrize("mode", ["train", "prefill"])
def test_world_size_one_record(mode, tmp_path, monkeypatch):
    monkeypatch.setenv(R.CLUSTER_ENV, "{}")
    spec = _spec(sweep={**BASE["sweep"], "world_size": 1}, measure={"modes": [mode], "level": "model"},
                 methods=["burst"], repeats=2)
    (case,) = spec.cases()
    rec = run_case(case, rank=0, world=1, device=torch.device("cpu"))
    f = model_flops(get_config("tiny"), 1, 64, mode=mode)
    assert rec["status"] == "ok" and rec["model"] == "tiny" and rec["weights"] == "replicated"
    assert rec["flops"] == f["total"] and "causal halved" in rec["flops_convention"]
    assert rec["tokens_per_s_per_rank"] == pytest.approx(64 / rec["time_median_s"])
    assert rec["mfu"] is None and "CPU" in rec["mfu_peak_source"]
    assert rec["mem_peak_bytes"] > 0 and rec["mem_state_bytes_per_rank"][0] > 0
    assert rec["comm_fwd_bytes"] == rec["comm_fwd_formula_bytes"] == 0    # one rank sends nothing
    assert len(rec["losses"]) == (3 if mode == "train" else 0)           # 2 timed steps + the memory step


@pytest.mark.slow
def test_two_ranks_bytes_equal_formula_and_losses_agree(tmp_path):
    """Sequence parallel (replicated and FSDP2) and TP-V1: counted bytes = the step formula (FSDP2's own
    collectives are a formula apart); every method's first loss is the same global mean (fp32, 1e-5)."""
    from experiments.run import main as run_main

    raw = {**BASE, "methods": ["burst", "tp_v1"], "model": {"name": "tiny", "zero": [False, True]},
           "exclude": [{"method": "tp_v1", "zero": True}], "timeouts": {"case_s": 120, "pg_s": 60}}
    p = tmp_path / "t_model.yaml"
    p.write_text(yaml.safe_dump(raw))
    assert run_main([str(p), "--results", str(tmp_path / "r"), "--plots", str(tmp_path / "p")]) == 0
    recs = R.read_records(tmp_path / "r" / "t_model" / "results.jsonl")
    assert len(recs) == 3 and {r["status"] for r in recs} == {"ok"}, [r["reason"] for r in recs]
    for r in recs:
        assert set(R.REQUIRED_KEYS) <= set(r)
        assert r["comm_fwd_bytes"] == r["comm_fwd_formula_bytes"] > 0
        assert r["comm_bwd_bytes"] == r["comm_bwd_formula_bytes"] > 0
        assert r["comm_layer_bytes"] == r["comm_layer_formula_bytes"] > 0
        assert (r["comm_fsdp_formula_bytes"] > 0) == r["zero"]
    first = [r["losses"][0] for r in recs]
    assert max(first) - min(first) < 1e-5, first
    zero = {r["zero"]: r["mem_state_bytes_per_rank"][0] for r in recs if r["method"] == "burst"}
    assert zero[True] < 0.6 * zero[False]          # FSDP2 keeps ~1/G of weights, grads, Adam state
    assert (tmp_path / "p" / "t_model" / "model_comm_per_layer.png").exists()


@pytest.mark.parametrize("gpu,peak", [("NVIDIA A100-SXM4-80GB", 312e12), ("NVIDIA H200", 989e12),
                                      ("NVIDIA GeForce RTX 4090", None)])
def test_mfu_peak_from_the_gpu_name(monkeypatch, gpu, peak):
    """Without a cluster profile in the environment (a SLURM job), MFU's peak comes from the hardware
    profiles whose accelerator is this GPU's model; none (and no MFU) for a GPU no profile describes."""
    from experiments.harness.model_record import peak_flops

    monkeypatch.setenv(R.CLUSTER_ENV, "{}")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: gpu)
    got, source = peak_flops("bfloat16", torch.device("cuda", 0))
    assert got == peak, source
