"""What the papers' implementations hold (experiments/perfmodel/peer_memory.py), term by term.

Each implementation's terms against the formulas docs/memory.md writes down (small shape, exact bytes);
the frameworks' model state from the sourced constants; the runs table against the specs it names;
and the memory of those rows in the model's records: the peer's, with its harness's phases.
"""
from __future__ import annotations

import pytest

from baselines import AttnShape, get
from burst_impl.model.config import get_config, layer_params, num_params
from experiments.harness.spec import load_spec, resolve_spec_path
from experiments.perfmodel import peer_memory as pm

G, N, Z, D, E = 4, 64, 4, 8, 2
T = N // G
Qb, KVb, Lb = T * Z * D * E, 2 * T * Z * D * E, 4 * T * Z


def _shape(**kw) -> AttnShape:
    return AttnShape(**{**dict(batch=1, seqlen=N, heads=Z, kv_heads=Z, head_dim=D, world_size=G, dtype="bfloat16",
                               causal=True, layout="zigzag"), **kw})


def _sums(t: pm.Terms) -> tuple[int, int, int]:
    a = t.attention()
    return a.kept, a.forward, a.backward


def test_transformer_engine_keeps_every_block_until_the_end_of_its_forward():
    """(G-1) received K/V blocks besides the saved one, G partial outputs and lses, the fp64 running lse."""
    kept, fwd, bwd = _sums(pm.te_p2p(_shape()))
    assert kept == 2 * Qb + KVb + Lb
    assert fwd == (G - 1) * KVb + G * (Qb + Lb) + 2 * Lb
    assert bwd == 4 * KVb + Qb + (Qb + KVb) + 4 * T * Z * (D + 1)
    # it grows with G at a fixed rows per rank: the moment that decides its OOM
    assert _sums(pm.te_p2p(_shape(seqlen=2 * N, world_size=2 * G)))[1] > 2 * fwd - 1


def test_burst_double_ring_adds_its_buffers_to_the_flat_ring():
    flat, double = pm.burst_ring(_shape()), pm.burst_ring(_shape(), double=True)
    read = Lb + 2 * Qb + Lb
    assert _sums(double)[1] - _sums(flat)[1] == 2 * KVb
    assert _sums(double)[2] - _sums(flat)[2] == 2 * read + 3 * Qb
    assert _sums(flat)[0] == 3 * Qb + KVb + Lb          # with the separate output copy (replicate(acc_o))
    # accumulators in the input dtype: dq, dk, dv and one step's gradients are e-byte tensors
    assert flat.backward["dq, dk, dv accumulators in the input dtype (OpBurstAttn.backward zeros_like)"] == Qb + KVb
    # their ablation baseline circulates O instead of delta (optimize_bwd_comm off)
    base = pm.burst_ring(_shape(), optimize_bwd=False)
    assert _sums(base)[2] - _sums(flat)[2] == (Qb - Lb) - Lb


def test_loongtrain_keeps_fp32_gradients_and_its_windows_buffers():
    one, windows = pm.loongtrain_ring(_shape(), windows=False), pm.loongtrain_ring(_shape())
    r = 4 // E
    assert _sums(windows)[1] - _sums(one)[1] == KVb
    assert _sums(windows)[2] - _sums(one)[2] == KVb + r * KVb
    assert one.backward["fp32 dq, dk, dv (zigzag_double_ring_flash_attn_backward)"] == r * (Qb + KVb)


@pytest.mark.parametrize("fn", [pm.burst_usp, pm.loongtrain_usp, pm.deepspeed_ulysses])
def test_all_to_all_methods_keep_the_output_all_to_alls_result(fn):
    terms = fn(_shape())
    assert any("output all-to-all" in k for k in terms.kept) and _sums(terms)[0] == 3 * Qb + KVb + Lb
    assert max(_sums(terms)[1:]) >= 3 * Qb                    # up to three copies of a tensor in transit


def test_framework_state_from_the_sourced_constants():
    cfg = get_config("llama2_7b")
    P, PL, e, g = num_params(cfg), layer_params(cfg), 2, 32
    meg = pm.FRAMEWORKS["megatron"].state(cfg, g, e, "replicated").resident
    assert meg.weights + meg.grads == 6 * P and meg.optimizer == int(12 * P / g) and meg.gathered == 0
    bmt = pm.FRAMEWORKS["bmtrain"].state(cfg, g, e, "fsdp2")
    assert bmt.resident.optimizer == 0 and bmt.resident.gathered == 3 * PL * e and bmt.pcie_bytes_per_step > 0
    ds = pm.FRAMEWORKS["deepspeed"].state(cfg, g, e, "fsdp2").resident
    assert ds.optimizer == int(0.2 * 12 * P / g)
    assert pm.FRAMEWORKS["bmtrain"].phases == ("forward", "backward")       # their harness: not the loss phase


@pytest.mark.parametrize("spec_name", sorted(pm.RUNS))
def test_runs_name_rows_of_their_spec(spec_name):
    spec = load_spec(resolve_spec_path(spec_name))
    rows = {v.name for v in spec.model.variants} if spec.model and spec.model.variants else set(spec.methods)
    assert set(pm.RUNS[spec_name]) <= rows, set(pm.RUNS[spec_name]) - rows
    assert all(name in pm.IMPLEMENTATIONS for name in pm.RUNS[spec_name].values())
    assert pm.implementation_of(spec_name, "no_such_row") is None


def test_peer_rows_take_their_implementations_memory():
    """A row a spec declares (BurstEngine's main table, 14B at 1M on 32 A800) is modelled with its
    implementation's terms and its harness's phases: Megatron CP's end-of-forward moment decides its peak,
    BurstEngine's measured phases leave the loss's forward out; the record says the optimizer offload."""
    from experiments.perfmodel.model_level import predict_model
    from experiments.profiles.hardware import load_hardware

    spec = load_spec(resolve_spec_path("model_burstengine_main_14b"))
    cases = {c.variant: c for c in spec.cases() if c.world_size == 32}
    hw, mem = load_hardware("a800_ib_4x8"), {}
    for row in ("megatron_cp", "burst_ring"):
        c = cases[row]
        mem[row] = predict_model(c.method, c.model, c.shape, mode="fwd_bwd", hardware=hw, weights="fsdp2",
                                 checkpoint=c.checkpoint, loss=c.loss,
                                 implementation=pm.implementation_of(spec.name, row)).memory
    meg, burst = mem["megatron_cp"], mem["burst_ring"]
    assert meg["implementation"] == "te_p2p" and meg["step"]["peak_moment"] == "attention_forward"
    assert burst["implementation"] == "burstengine_double_ring" and "loss_forward" not in burst["step"]["moments"]
    assert burst["offload"].startswith("modelled: optimizer state on the host") and burst["pcie_bytes_per_step"] > 0
    assert get("ring").name == cases["megatron_cp"].method      # the row's time is still the suite's ring
