"""Loss parity (docs/papers.md §3: Table 4 as a test): the sequence-parallel model equals the single-process one.

For every op-level attention method of the registry that runs here, W = 1..4
and every layout the method accepts, one step of the tiny model (2 layers,
12 heads, N = 24, B = 2) in fp32 gives the loss, EVERY parameter gradient
(after the gradient all-reduce) and the prefill's next tokens of the
single-process fp64 model; and the bytes counted per step equal
n_layers x the method's closed form + the loss and gradient all-reduces.

Tolerances (fp32 against fp64, relative to each tensor's largest value):
fp32 rounds at u = 6e-8. A sum of K terms carries about sqrt(K) u of
relative error (worst case K u); the longest sums here have K <= 192 (the FFN
width; H = 96, B*N = 48) and a gradient passes ~20 chained matmul/softmax/norm
steps in 2 layers, so ~20 * sqrt(192) * 6e-8 = 1.7e-5 is a generous typical
bound. The ring merges and the G-term gradient all-reduce add a handful of
roundings, no new order. GRAD_RTOL = 2e-5. The loss is one logsumexp per
token averaged over 48 tokens: LOSS_RTOL = 2e-6 (a few u times the depth).
Measured (``python -m tests.test_model_parity``): at most 8.3e-7 on gradients
and 1.2e-7 on the loss, as the single-process fp32 model (7.3e-7, 8.6e-8). A
real mistake moves values by > 1e-3 (the negative controls below must miss the
tolerance by 100x). At G = 1 every layout is the identity: contiguous only.
"""
from __future__ import annotations

import pytest
import torch

from baselines.registry import get
from baselines.registry import METHODS
from burst_impl.layout import LAYOUTS
from burst_impl.model import get_config
from burst_impl.model.sequence_parallel import layer_comm_bytes
from tests.model_refs import BATCH, SEQLEN, grad_errors, reference, sp_run

GRAD_RTOL = 2e-5
LOSS_RTOL = 2e-6
WORLD_SIZES = (1, 2, 3, 4)
# Every op-level method we implement. Adapters around peer packages (bytes recorded by formula:
# deepspeed_ulysses, ring_flash_attn) are checked against our methods in test_baselines_peers;
# here they would add DeepSpeed's per-process JIT build of its CPU comm op to every worker.
# Timing variants (``variant_of``: the same numerics with overlap off) are checked against fp64
# in tests/test_double_ring.py.
SP_METHODS = sorted(n for n, m in METHODS.items()
                    if m.level == "op" and not m.bytes_by_formula and m.available() and m.variant_of is None)


def _expected_bytes(cfg_name, method, G, layout, phase=None) -> dict:
    cfg = get_config(cfg_name)
    per_layer = layer_comm_bytes(cfg, get(method), BATCH, SEQLEN, G, layout, dtype="float32")
    out = {k: v * cfg.n_layers for k, v in per_layer.items() if phase is None or k[0] == phase}
    if G > 1 and phase is None:
        out[("forward", "loss")] = 2 * 16 * (G - 1) // G          # [sum, count] in fp64
    return out


def case_errors(pools, cfg_name: str, method: str, G: int, layouts=None, **bugs) -> dict:
    """{layout: (max relative loss error, max relative gradient error, worst parameter)} over ranks;
    asserts next tokens and bytes on the way."""
    # The model places tokens by the named layouts (RoPE needs each token's global position); "balanced"
    # depends on a mask and a sequence length, which the model's causal blocks do not take.
    layouts = layouts or ([l for l in METHODS[method].layouts if l in LAYOUTS] if G > 1 else ["contiguous"])
    ref = reference(cfg_name)
    results = pools.run(G, sp_run, cfg_name, method, layouts, **bugs)
    errs = {}
    for layout in layouts:
        loss_err = grad_err = 0.0
        worst = ""
        for rank, res in enumerate(results):
            r = res[layout]
            loss_err = max(loss_err, abs(r["loss"] - ref["loss"]) / abs(ref["loss"]))
            for name, e in grad_errors(r["grads"], ref["grads"]).items():
                if e >= grad_err:
                    grad_err, worst = e, name
            if not bugs:
                assert torch.equal(r["ids"], ref["next_ids"]), f"{method} G={G} {layout} rank {rank}: next tokens"
                expect = _expected_bytes(cfg_name, method, G, layout)
                for k, v in r["sync_bytes"].items():
                    expect[k] = expect.get(k, 0) + v
                assert r["step_bytes"] == expect, f"{method} G={G} {layout} rank {rank}: counted " \
                                                   f"{r['step_bytes']} != formula {expect}"
                expect_prefill = _expected_bytes(cfg_name, method, G, layout, phase="forward")
                if G > 1:
                    expect_prefill[("forward", "next_token")] = 2 * 8 * BATCH * (G - 1) // G
                assert r["prefill_bytes"] == expect_prefill, f"{method} G={G} {layout}: prefill bytes"
        errs[layout] = (loss_err, grad_err, worst)
    return errs


def _check(errs: dict, what: str) -> None:
    for layout, (loss_err, grad_err, worst) in errs.items():
        assert loss_err <= LOSS_RTOL, f"{what} {layout}: loss error {loss_err:.2e} > {LOSS_RTOL:.0e}"
        assert grad_err <= GRAD_RTOL, f"{what} {layout}: gradient error {grad_err:.2e} > {GRAD_RTOL:.0e} ({worst})"


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("method", SP_METHODS)
def test_sp_parity(pools, method, world_size):
    """MHA (12 heads split over every G): every layout the method accepts."""
    _check(case_errors(pools, "tiny", method, world_size), f"{method} G={world_size}")


@pytest.mark.parametrize("method,world_size,layout", [
    ("burst", 2, "zigzag"), ("burst", 4, "striped"), ("ring", 4, "zigzag"), ("ulysses", 4, "zigzag"),
    ("usp", 4, "zigzag"), ("ring_rsa", 2, "contiguous"),
])
def test_sp_parity_gqa(pools, method, world_size, layout):
    """Grouped-query attention (8 query heads, 2 kv heads; Ulysses replicates kv heads at G = 4)."""
    _check(case_errors(pools, "tiny_gqa", method, world_size, [layout]), f"{method} G={world_size} gqa")


@pytest.mark.parametrize("bug", ["positions_bug", "skip_sync"])
def test_parity_detects_mistakes(pools, bug):
    """Negative controls: RoPE at local instead of global positions (zigzag), or no gradient
    all-reduce, must miss the tolerance by far; otherwise the parity test could not fail."""
    errs = case_errors(pools, "tiny", "burst", 2, ["zigzag"], **{bug: True})
    loss_err, grad_err, _ = errs["zigzag"]
    assert grad_err > 100 * GRAD_RTOL, f"{bug}: gradient error only {grad_err:.2e}"
    if bug == "positions_bug":
        assert loss_err > 100 * LOSS_RTOL, f"{bug}: loss error only {loss_err:.2e}"


if __name__ == "__main__":   # the parity table of the report: max loss / gradient error per method x G
    from tests.distpool import Pools

    pools = Pools()
    try:
        print(f"{'method':<18}" + "".join(f"{'G=%d loss' % g:>12}{'grad':>10}" for g in WORLD_SIZES))
        for m in SP_METHODS:
            row = []
            for g in WORLD_SIZES:
                errs = case_errors(pools, "tiny", m, g)
                row.append((max(e[0] for e in errs.values()), max(e[1] for e in errs.values())))
            print(f"{m:<18}" + "".join(f"{le:>12.1e}{ge:>10.1e}" for le, ge in row), flush=True)
    finally:
        pools.close()
