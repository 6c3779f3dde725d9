"""Unmodified Hugging Face causal LMs, sequence-parallel through AttentionInterface, equal the
single-process model (issue 23).

For Llama (MHA, 12/12 heads), Qwen2 (GQA, 12/2, q/k/v biases) and Mistral (MQA, 12/1, sliding
window 8 on every layer), every sequence-parallel method we implement (``sp_methods``, from the
registry: a new one is covered without an edit) at W = 2, 3, 4, zigzag and contiguous: one fp64
step of ``baselines.hf.sp_loss_and_grads`` (shard the global batch, forward, global mean loss,
backward, gradient all-reduce) gives the loss and EVERY parameter gradient of the unmodified model
on the whole batch (sdpa, HF's own masks), within 1e-9 relative (measured
<= 2.1e-15: fp64 rounding, u = 1.1e-16, through ~20 chained ops). One gloo pool per world size runs
all (method, layout) cases of a family in one call. N = 24 splits evenly for every layout at W = 2,
3, 4; N = 25 (uneven shards: chunks differ by a token) is checked at W = 3 and 4 as well.

Where the heads do not split (Qwen2's 2 kv heads over 3 Ulysses ranks: 2 neither divides 3 nor is
divisible by it), ``use_method`` must raise the ValueError naming the heads and the rule, on every
rank, before a byte is sent: that case is checked, not skipped.

fp32 and bf16, a few cases (tolerances next to the checks): the parallel run against the fp64
reference, beside the single-process model's own error in that dtype. Every method, ring_rsa
included, is fp64 end to end.
"""
from __future__ import annotations

import functools

import pytest
import torch

pytest.importorskip("transformers", reason="transformers is not installed (the [hf] extra: pip install -e '.[hf]')")

WORLD_SIZES = (2, 3, 4)
FAMILIES = ("llama", "qwen2", "mistral")
LAYOUTS = ("zigzag", "contiguous")
BATCH, SEQLEN = 2, 24
# Ulysses needs kv heads that divide W or are divisible by it (kv_replication): Qwen2's 2 over 3 ranks do not.
# About that method's rule alone, so kept by name.
REJECTED = {("qwen2", "ulysses", 3)}
FP64_RTOL = 1e-9


def sp_methods() -> tuple[str, ...]:
    """Every sequence-parallel method we implement that runs here, from the registry. Timing variants are
    left out (``variant_of``: their method's numerics), and so are peer adapters (sends inside the peer's
    package; DeepSpeed's is checked against ours in tests/test_baselines_peers.py)."""
    from baselines.registry import methods_with

    return methods_with(level="op", variants=False, adapters=False, available=True)


def sp_cases(family: str, world_size: int, dtype=torch.float64) -> list[tuple]:
    """Every method x every layout of ``LAYOUTS`` it takes, as ``run_cases`` cases."""
    from baselines.registry import get

    return [(family, m, l, dtype, tuple(options(m, world_size).items()), (), False)
            for m in sp_methods() for l in LAYOUTS if l in get(m).layouts]


def options(method: str, world_size: int) -> dict:
    """A real double ring (2 nodes x 2 ranks) at W = 4 for a method on the double ring (its registered
    ``topology`` option); at W = 2, 3 one rank per node: the flat ring."""
    from baselines.registry import get

    return {"node_size": 2} if get(method).options.get("topology") == "double" and world_size == 4 else {}


def global_ids(seed: int = 1, batch: int = BATCH, seqlen: int = SEQLEN) -> torch.Tensor:
    return torch.randint(0, 64, (batch, seqlen), generator=torch.Generator().manual_seed(seed))


@functools.lru_cache(maxsize=32)
def reference(family: str, dtype=torch.float64, variant: tuple = (), batch_kw: tuple = (),
              seqlen: int = SEQLEN):
    """(loss, {name: grad in fp64}) of the unmodified single-process model on the global batch."""
    from baselines.hf import single_loss_and_grads
    from baselines.hf.models import build

    model = build(family, dtype, **dict(variant))
    loss, grads = single_loss_and_grads(model, global_ids(seqlen=seqlen), **dict(batch_kw))
    return loss.item(), {n: g.double() for n, g in grads.items()}


def rel_errors(got: tuple, want: tuple) -> tuple[float, float, str]:
    """(relative loss error, worst gradient error relative to each tensor's max, its parameter)."""
    loss, grads = got
    assert grads.keys() == want[1].keys(), f"parameters differ: {sorted(set(grads) ^ set(want[1]))}"
    errs = {n: ((grads[n].double() - w).abs().max() / w.abs().max().clamp_min(1e-30)).item()
            for n, w in want[1].items()}
    worst = max(errs, key=errs.get)
    return abs(loss - want[0]) / abs(want[0]), errs[worst], worst


# ---------------------------------------------------------------- on every rank of a pool


def run_cases(cases: list[tuple], batch_kw: dict | None = None, seqlen: int = SEQLEN) -> dict:
    """On every rank: {case: (loss, grads on rank 0 / None) or ("error", message, bytes sent)} for
    cases (family, method, layout, dtype, options, variant, fsdp)."""
    from baselines import hf
    from baselines.hf.models import build
    from burst_impl import comm

    torch.set_num_threads(1)
    rank = torch.distributed.get_rank()
    out = {}
    for case in cases:
        family, method, layout, dtype, opts, variant, fsdp = case
        model = build(family, dtype, **dict(variant))
        with comm.count_bytes() as sent:
            try:
                hf.use_method(model, method, layout, **dict(opts))
            except ValueError as e:
                out[case] = ("error", str(e), sent.total())
                continue
        if fsdp:
            hf.shard_model(model)
        loss, grads = hf.sp_loss_and_grads(model, global_ids(seqlen=seqlen), layout=layout, fsdp=fsdp,
                                           **(batch_kw or {}))
        out[case] = (loss.item(), {n: g.double() for n, g in grads.items()} if rank == 0 else None)
    return out


def check_pool_results(results: list[dict], case, want, loss_rtol: float, grad_rtol: float) -> tuple:
    """The loss on every rank and rank 0's gradients within the tolerances; the errors. (The ranks'
    losses may differ in the last bits: global_mean adds the others' sum to this rank's own.)"""
    got = results[0][case]
    assert got[0] != "error", f"{case}: {got[1]}"
    for rank, res in enumerate(results):
        assert abs(res[case][0] - want[0]) <= loss_rtol * abs(want[0]), f"{case}: rank {rank} loss {res[case][0]}"
    loss_err, grad_err, worst = rel_errors(got, want)
    assert loss_err <= loss_rtol, f"{case}: loss error {loss_err:.2e} > {loss_rtol:.0e}"
    assert grad_err <= grad_rtol, f"{case}: gradient error {grad_err:.2e} > {grad_rtol:.0e} ({worst})"
    return loss_err, grad_err


# ---------------------------------------------------------------- tests


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_hf_parity_fp64(pools, family, world_size):
    """Every method x layout: fp64 loss and every gradient equal the single-process model's."""
    cases = sp_cases(family, world_size)
    results = pools.run(world_size, run_cases, cases)
    want = reference(family)
    for case in cases:
        if (family, case[1], world_size) in REJECTED:
            for res in results:          # every rank refuses, before any byte
                kind, msg, sent = res[case]
                assert kind == "error" and sent == 0, res[case]
                assert "num_key_value_heads=2" in msg and "divisible by the Ulysses degree 3" in msg, msg
            continue
        check_pool_results(results, case, want, FP64_RTOL, FP64_RTOL)   # every method, ring_rsa too


# fp32 rounds at u = 6e-8; a gradient passes ~20 chained matmul/softmax/norm steps in 2 layers, with sums
# of K <= 96 terms (the MLP width; B*N = 48 tokens): ~20 * sqrt(96) * 6e-8 = 1.2e-5 typical, so 2e-5 on
# gradients; the loss is a mean of 48 logsumexps, a few u deep: 2e-6 (the reasoning of
# tests/test_model_parity.py). Measured (python -m tests.test_hf_parity): <= 7.0e-7 on gradients and
# 1.0e-7 on the loss, as the single-process fp32 model's own error (1.0e-6, 1.0e-7).
FP32_RTOL = (2e-6, 2e-5)
# bf16 rounds at u = 3.9e-3, and the single-process bf16 model is itself 1.3e-2 .. 2.6e-2 off fp64 in its
# worst gradient. The parallel run rounds differently (blocks merged in fp32, W partial gradients summed in a
# bf16 all-reduce), not more often by an order: its gradient error must stay within 2x the single-process bf16
# model's own error for the same case (measured ratio 0.8 .. 1.2). The loss is a mean of 48 fp32 logsumexps
# of bf16 logits: 1e-3 (measured <= 4.6e-5 for both).
BF16_LOSS_RTOL, BF16_GRAD_FACTOR = 1e-3, 2.0
# A sample of (family, method, layout), one per method kind, not every method: kept by name.
LOW_CASES = [("llama", "burst", "zigzag"), ("qwen2", "ulysses", "zigzag"), ("mistral", "usp", "contiguous"),
             ("qwen2", "burst_double_ring", "zigzag")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_hf_parity_low_precision(pools, dtype):
    """W = 4, a few methods: within the stated tolerances of the fp64 single-process model."""
    cases = [(f, m, l, dtype, tuple(options(m, 4).items()), (), False) for f, m, l in LOW_CASES]
    results = pools.run(4, run_cases, cases)
    for case in cases:
        if dtype == torch.float32:
            loss_rtol, grad_rtol = FP32_RTOL
        else:
            own = rel_errors(reference(case[0], dtype), reference(case[0]))[1]
            loss_rtol, grad_rtol = BF16_LOSS_RTOL, BF16_GRAD_FACTOR * own
        check_pool_results(results, case, reference(case[0]), loss_rtol, grad_rtol)


if __name__ == "__main__":   # the measured errors quoted above: python -m tests.test_hf_parity
    from tests.distpool import Pools

    pools = Pools()
    try:
        for W in WORLD_SIZES:
            for family in FAMILIES:
                cases = [c for c in sp_cases(family, W) if (family, c[1], W) not in REJECTED]
                res = pools.run(W, run_cases, cases)
                for m in sp_methods():
                    errs = [rel_errors(res[0][c], reference(family))[:2] for c in cases if c[1] == m]
                    if errs:
                        print(f"fp64 W={W} {family:<8}{m:<18} loss {max(e[0] for e in errs):.1e} "
                              f"grad {max(e[1] for e in errs):.1e}", flush=True)
        for dtype in (torch.float32, torch.bfloat16):
            cases = [(f, m, l, dtype, tuple(options(m, 4).items()), (), False) for f, m, l in LOW_CASES]
            res = pools.run(4, run_cases, cases)
            for c in cases:
                sp = rel_errors(res[0][c], reference(c[0]))
                single = rel_errors(reference(c[0], dtype), reference(c[0]))
                print(f"{dtype} W=4 {c[:3]}: parallel loss {sp[0]:.1e} grad {sp[1]:.1e}; "
                      f"single-process loss {single[0]:.1e} grad {single[1]:.1e}", flush=True)
    finally:
        pools.close()


UNEVEN_N = 25    # over 3 ranks 9/8/8 tokens (contiguous); zigzag's 2W chunks of 4 and 5 tokens at W = 3 and 4


@pytest.mark.parametrize("world_size", [3, 4])
def test_hf_parity_at_uneven_n(pools, world_size):
    """N that no layout splits evenly: every method's fp64 loss and gradients equal the single-process model's."""
    cases = sp_cases("llama", world_size)
    results = pools.run(world_size, run_cases, cases, None, UNEVEN_N)
    want = reference("llama", seqlen=UNEVEN_N)
    for case in cases:
        check_pool_results(results, case, want, FP64_RTOL, FP64_RTOL)
