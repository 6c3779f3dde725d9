"""BurstAttention's headline at model level (issue 35, item 1): LLaMA-2 7B, 128K tokens, 32 A100 over RoCE.

The twin ``fig3_train_7b_32gpu_model_level`` carries Burst with and without ZeRO-3 (the model-level spec's
``zero: [false, true]``) next to TP-V3; TP-V3's step memory keeps each column-parallel linear's local input
and re-gathers it in the backward, as the paper's TP-V3 (BMTrain's ``OpParallelLinear``), so it fits.
"""
from __future__ import annotations

from baselines import AttnShape, get
from burst_impl.model.config import get_config
from burst_impl.model.memory import step_memory
from experiments.harness.record import read
from experiments.harness.spec import load_spec, resolve_spec_path
from experiments.perfmodel.model_figures import twin_zero, write_spec_model_level
from experiments.perfmodel.model_level import predict_model
from experiments.profiles.hardware import load_hardware

SEVEN_B = get_config("llama2_7b")


def _shape(n: int, g: int = 32) -> AttnShape:
    return AttnShape(batch=1, seqlen=n, heads=32, kv_heads=32, head_dim=128, world_size=g, dtype="bfloat16",
                     causal=True, layout="zigzag")


def test_the_fig3_twin_takes_zero_from_its_model_level_spec():
    spec = load_spec(resolve_spec_path("fig3_train_7b_32gpu"))
    assert twin_zero(spec) == {"burst": (False, True), "tp_v3": (False,)}
    # a twin that runs zero: [false] only, and one whose twin has no training step (prefill)
    assert twin_zero(load_spec(resolve_spec_path("fig2_train_7b_8gpu")))["burst"] == (False,)
    assert twin_zero(load_spec(resolve_spec_path("table2_prefill_7b_8gpu"))) == {}


def test_tp_v3_keeps_local_inputs_and_regathers_one_in_the_backward():
    """Per block, V3 keeps no gathered (B, N, H): its activations are V1's formula at N/G held tokens less
    the two gathered inputs the old term kept; one (B, N, H) is a backward temporary."""
    n, g, e, L = 8192, 8, 2, SEVEN_B.n_layers
    kw = dict(batch=1, seqlen=n, world_size=g, dtype="bfloat16", weights="tp", checkpoint="none", loss="unfused")
    m = step_memory(SEVEN_B, method=get("tp_v3"), **kw)
    H, F = SEVEN_B.hidden, SEVEN_B.ffn_hidden // g
    attn = int(get("tp_v3").memory(_shape(n, g)))
    per_block = ((n // g) * 6 * H + n * 4 * F) * e + attn - n * H * e
    assert m.activations == L * per_block
    assert m.block_temp == n * (2 * F + H) * e + n * H * e


def test_headline_rows_fit_and_are_timed_at_128k_on_32_a100():
    hw = load_hardware("a100_pcie_roce_4x8")
    s = _shape(131072)
    tp = predict_model("tp_v3", SEVEN_B, s, mode="fwd_bwd", hardware=hw)
    zero = predict_model("burst", SEVEN_B, s, mode="fwd_bwd", hardware=hw, weights="fsdp2")
    assert tp.status == "ok" and zero.status == "ok", (tp.reason, zero.reason)
    assert tp.memory["total_bytes"] < tp.memory["capacity_bytes"]
    # ZeRO-3 shards weights, gradients and AdamW state over the 32 ranks: 1/32 of the replicated ones
    rep = predict_model("burst", SEVEN_B, s, mode="fwd_bwd", hardware=hw)
    assert zero.memory["parts"]["optimizer"] * 32 >= rep.memory["parts"]["optimizer"] > \
        zero.memory["parts"]["optimizer"] * 31


def test_twin_records_carry_burst_with_zero(tmp_path):
    spec = load_spec(resolve_spec_path("fig3_train_7b_32gpu"))
    write_spec_model_level(spec, results_root=tmp_path / "r", plots_root=tmp_path / "p", draw=False)
    recs = read(tmp_path / "r" / "fig3_train_7b_32gpu_model_level" / "results.jsonl")
    rows = {(r["method"], r["zero"], r["seqlen"]): r for r in recs}
    assert len(rows) == len(recs)                       # no two records of one (method, zero, N)
    mine, theirs = rows[("burst", True, 131072)], rows[("tp_v3", False, 131072)]
    assert mine["case_id"].endswith(".zero") and mine["status"] == theirs["status"] == "ok"
    assert ("tp_v3", True, 131072) not in rows          # the spec excludes TP with ZeRO
    table = (tmp_path / "p" / "fig3_train_7b_32gpu_model_level" / "table_modelled.md").read_text()
    assert "burst+ZeRO" in table
