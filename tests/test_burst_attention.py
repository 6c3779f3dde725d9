"""BurstAttention against a single-process fp64 reference, on real gloo process groups."""
from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist

from burst_impl import burst_attn_func, comm, volume
from burst_impl.shape import DTYPE_NAMES, AttnShape
from burst_impl.layout import shard
from tests.refs import attention_reference, make_inputs, max_err

B, D = 2, 24          # head dim 24: not a power of two
CHUNK = 5             # odd tokens per layout chunk; zigzag has 2G chunks, N = 2*G*CHUNK
HEADS = {"mha": (4, 4), "gqa": (4, 2), "mqa": (6, 1)}

# fp32 tolerance, relative to the largest reference magnitude. Each output is a
# softmax-weighted sum over at most N = 40 keys computed in fp32 (eps 1.2e-7)
# with one exp/log per term and one merge per ring step; the error of such sums
# grows at most ~N*eps ~ 5e-6 in the worst case. 2e-5 leaves a factor ~4 over
# that bound while staying 1000x below any real mistake (a wrong mask or a
# dropped block changes values at the 1e-1 level).
FP32_RTOL = 2e-5
# bf16: flash-attn's test convention. The distributed result may be at most
# BF16_FACTOR times as far from the fp64 reference as plain single-process bf16
# attention is, plus a floor of one bf16 rounding (2^-8 relative, a full ulp) of
# the largest value, for outputs whose plain error happens to be ~0 (the final
# cast to bf16 alone can cost that much).
BF16_FACTOR = 2.0
BF16_FLOOR = 2.0 ** -8


def _run_case(cfg: dict) -> dict:
    """Per rank: shard the full inputs, run forward+backward, return shards and byte counts."""
    rank, G = dist.get_rank(), dist.get_world_size()
    q, k, v, do = make_inputs(B, cfg["seqlen"], cfg["heads"], cfg["kv_heads"], D, cfg["dtype"])
    local = [shard(t, cfg["layout"], rank, G).requires_grad_(i < 3) for i, t in enumerate((q, k, v, do))]
    ql, kl, vl, dol = local
    with comm.count_bytes() as counts:
        out, lse = burst_attn_func(ql, kl, vl, causal=cfg["causal"], layout=cfg["layout"],
                                   backward=cfg["backward"], return_lse=True,
                                   grad_comm_dtype=cfg.get("grad_comm_dtype", torch.float32))
        out.backward(dol)
    return dict(out=out.detach(), lse=lse.detach(), dq=ql.grad, dk=kl.grad, dv=vl.grad,
                counts=dict(counts), notes=dict(counts.notes))


def _check(results, cfg, ref, tol_of):
    G = len(results)
    for rank, res in enumerate(results):
        for name in ("out", "lse", "dq", "dk", "dv"):
            expect = shard(ref[name], cfg["layout"], rank, G, dim=2 if name == "lse" else 1)
            err, tol = max_err(res[name], expect), tol_of(name, rank)
            assert err <= tol, f"rank {rank} {name}: max error {err:.3g} > tolerance {tol:.3g} ({cfg})"


def _check_counts(results, cfg, elem_size):
    G = len(results)
    grad_elem = torch.empty((), dtype=cfg.get("grad_comm_dtype", torch.float32)).element_size()
    shape = AttnShape(B, cfg["seqlen"], cfg["heads"], cfg["kv_heads"], D, G, dtype=DTYPE_NAMES[cfg["dtype"]])
    assert shape.elem_size == elem_size
    chosen = results[0]["notes"]["burst.backward"]
    # "auto" must have taken the scheme that sends fewer bytes, not merely one whose bytes match its formula
    assert chosen == (volume.cheaper_backward(shape, grad_elem) if cfg["backward"] == "auto" else cfg["backward"])
    expect = volume.expected_bytes(shape, backward=chosen, grad_elem_size=grad_elem)
    for rank, res in enumerate(results):
        assert res["counts"] == expect, f"rank {rank}: counted {res['counts']} != formula {expect}"


FP32_CASES = list(itertools.product([1, 2, 3, 4], [False, True], ["contiguous", "zigzag"],
                                    ["burst", "ring"], ["mha", "gqa"]))
# striped only changes causal block masks: causal cases, both schemes, GQA for the odd world size
FP32_CASES += [(g, True, "striped", bw, h) for g in (2, 3, 4) for bw in ("burst", "ring")
               for h in (["mha", "gqa"] if g == 3 else ["mha"])]


@pytest.mark.parametrize("world_size,causal,layout,backward,heads", FP32_CASES)
def test_fp32_matches_fp64_reference(pools, world_size, causal, layout, backward, heads):
    z, zkv = HEADS[heads]
    cfg = dict(seqlen=2 * world_size * CHUNK, heads=z, kv_heads=zkv, dtype=torch.float32,
               causal=causal, layout=layout, backward=backward)
    results = pools.run(world_size, _run_case, cfg)
    ref = attention_reference(*make_inputs(B, cfg["seqlen"], z, zkv, D, torch.float64), causal)
    scale = {n: ref[n].abs().max().item() for n in ref}
    _check(results, cfg, ref, lambda name, rank: FP32_RTOL * max(scale[name], 1.0))
    assert results[0]["notes"]["burst.backward"] == backward
    _check_counts(results, cfg, elem_size=4)


@pytest.mark.parametrize("world_size,causal,layout,backward,heads", [
    (2, True, "zigzag", "burst", "mha"),
    (3, True, "zigzag", "ring", "gqa"),
    (3, False, "contiguous", "burst", "mqa"),
    (4, True, "contiguous", "auto", "gqa"),
    (4, True, "zigzag", "auto", "mha"),
    (3, True, "striped", "burst", "gqa"),
])
def test_bf16_error_budget(pools, world_size, causal, layout, backward, heads):
    z, zkv = HEADS[heads]
    seqlen = 2 * world_size * 16
    cfg = dict(seqlen=seqlen, heads=z, kv_heads=zkv, dtype=torch.bfloat16, causal=causal,
               layout=layout, backward=backward)
    results = pools.run(world_size, _run_case, cfg)
    inputs = make_inputs(B, seqlen, z, zkv, D, torch.bfloat16)
    ref = attention_reference(*(t.double() for t in inputs), causal)   # exact math on the bf16 inputs
    plain = attention_reference(*inputs, causal, backend="cpu_flash")  # plain bf16 attention
    budget = {n: BF16_FACTOR * max_err(plain[n], ref[n]) + BF16_FLOOR * max(ref[n].abs().max().item(), 1.0)
              for n in ref}
    _check(results, cfg, ref, lambda name, rank: budget[name])
    _check_counts(results, cfg, elem_size=2)


@pytest.mark.parametrize("backward", ["burst", "ring"])
def test_bf16_gradient_ring_counts_and_accuracy(pools, backward):
    """grad_comm_dtype=bf16 halves the travelling accumulator bytes; accuracy stays in budget."""
    seqlen = 2 * 3 * 16
    cfg = dict(seqlen=seqlen, heads=4, kv_heads=2, dtype=torch.bfloat16, causal=True, layout="zigzag",
               backward=backward, grad_comm_dtype=torch.bfloat16)
    results = pools.run(3, _run_case, cfg)
    _check_counts(results, cfg, elem_size=2)
    inputs = make_inputs(B, seqlen, 4, 2, D, torch.bfloat16)
    ref = attention_reference(*(t.double() for t in inputs), True)
    plain = attention_reference(*inputs, True, backend="cpu_flash")
    # bf16 partial sums on the ring add up to G-1 extra roundings: a looser factor of 4.
    budget = {n: 4 * max_err(plain[n], ref[n]) + BF16_FLOOR * max(ref[n].abs().max().item(), 1.0)
              for n in ref}
    _check(results, cfg, ref, lambda name, rank: budget[name])


@pytest.mark.parametrize("heads,expect", [("mha", "burst"), ("gqa", "ring"), ("mqa", "ring")])
def test_auto_picks_fewer_bytes(heads, expect):
    z, zkv = HEADS[heads]
    # Per token, fp32 inputs and accumulators: burst Z*(12d+8), ring Zkv*16d;
    # Z=4, Zkv=2, d=64: burst 3104 > ring 2048 bytes, so GQA at ratio 2 already favours ring.
    assert volume.cheaper_backward(AttnShape(1, 4096, z, zkv, 64, 4, dtype="float32")) == expect
    # bf16, Z=8, Zkv=2: burst 8*(64*8+8)=4160 > ring 2*64*12=1536 per token.
    assert volume.cheaper_backward(AttnShape(1, 4096, 8, 2, 64, 4, dtype="bfloat16")) == "ring"
    assert volume.cheaper_backward(AttnShape(1, 4096, 8, 8, 64, 4, dtype="bfloat16")) == "burst"


@pytest.mark.parametrize("G", [2, 3, 4, 8])
def test_closed_form_matches_paper_table(G):
    """Per rank, the formulas are (G-1)/G times the table of docs/papers.md §1 (MHA, elements)."""
    b, n, z, d = 2, 4096 * 3, 8, 64
    c = (G - 1) / G
    # bf16 elements (e = 2 bytes) and bf16 accumulators: bytes = 2 x elements for the d-wide
    # tensors; lse and delta are always fp32, so the paper's 2BZN scalars count 4 bytes each.
    s, e = AttnShape(b, n, z, z, d, G, dtype="bfloat16"), 2
    def phase(backward, which):   # the suite's one byte formula, one phase of it
        table = volume.expected_bytes(s, backward, grad_elem_size=e)
        return {kind: b for (p, kind), b in table.items() if p == which}
    fwd, burst, ring = phase("burst", "forward"), phase("burst", "backward"), phase("ring", "backward")
    assert sum(fwd.values()) == c * 2 * b * z * n * d * e                            # 2BZNd
    assert sum(burst.values()) == c * (3 * b * z * n * d * e + 2 * b * z * n * 4)    # 3BZNd + 2BZN
    assert sum(ring.values()) == c * 4 * b * z * n * d * e                           # 4BZNd
