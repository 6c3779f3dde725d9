"""Sequence-parallel baselines (ring, ring_rsa, ulysses, usp) against a single-process fp64 reference."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from baselines import AttnShape, get
from burst_impl import comm
from burst_impl.layout import shard
from tests.refs import attention_reference, make_inputs, max_err

B, D, CHUNK = 2, 24, 5   # head dim 24 (not a power of two); 5 tokens per layout chunk


def heads_for(world_size: int, kind: str) -> tuple[int, int]:
    """(Z, Zkv) that every method can split over ``world_size`` ranks."""
    z = 6 if world_size == 3 else 4
    return {"mha": (z, z), "gqa": (z, z // 2), "mqa": (z, 1)}[kind]


# fp32: as in test_burst_attention.py. Outputs are softmax-weighted sums over at
# most N = 40 keys in fp32 (eps 1.2e-7), one merge per ring step: worst case
# ~N*eps = 5e-6; 2e-5 relative to the largest reference value leaves a factor 4
# and is 1000x below a real mistake (a wrong mask moves values by ~1e-1).
FP32_RTOL = 2e-5
# bf16: at most BF16_FACTOR x the error of plain single-process bf16 attention
# against fp64, plus a floor of 1e-2 x the magnitude (flash-attn's convention).
BF16_FACTOR, BF16_FLOOR = 2.0, 1e-2


def _run(cfg: dict) -> dict:
    rank, G = dist.get_rank(), dist.get_world_size()
    q, k, v, do = make_inputs(B, cfg["seqlen"], cfg["heads"], cfg["kv_heads"], D, cfg["dtype"])
    ql, kl, vl, dol = [shard(t, cfg["layout"], rank, G).requires_grad_(i < 3) for i, t in enumerate((q, k, v, do))]
    method = get(cfg["method"])
    with comm.count_bytes() as counts:
        out = method.call(ql, kl, vl, causal=cfg["causal"], layout=cfg["layout"], **cfg["options"])
        out.backward(dol)
    return dict(out=out.detach(), dq=ql.grad, dk=kl.grad, dv=vl.grad, counts=dict(counts))


def _shape(cfg, G) -> AttnShape:
    return AttnShape(B, cfg["seqlen"], cfg["heads"], cfg["kv_heads"], D, G,
                     dtype={torch.float32: "float32", torch.bfloat16: "bfloat16"}[cfg["dtype"]],
                     causal=cfg["causal"], layout=cfg["layout"])


def check_case(pools, method, world_size, causal, layout, heads, dtype=torch.float32, chunk=CHUNK, **options):
    z, zkv = heads_for(world_size, heads)
    cfg = dict(method=method, seqlen=2 * world_size * chunk, heads=z, kv_heads=zkv, dtype=dtype,
               causal=causal, layout=layout, options=options)
    results = pools.run(world_size, _run, cfg)
    inputs = make_inputs(B, cfg["seqlen"], z, zkv, D, dtype)
    ref = attention_reference(*(t.double() for t in inputs), causal)
    if dtype == torch.float32:
        tol = {n: FP32_RTOL * max(ref[n].abs().max().item(), 1.0) for n in ref}
    else:
        plain = attention_reference(*inputs, causal, backend="cpu_flash")
        tol = {n: BF16_FACTOR * max_err(plain[n], ref[n]) + BF16_FLOOR * max(ref[n].abs().max().item(), 1.0)
               for n in ref}
    for rank, res in enumerate(results):
        for name in ("out", "dq", "dk", "dv"):
            err = max_err(res[name], shard(ref[name], layout, rank, world_size))
            assert err <= tol[name], f"{method} rank {rank} {name}: error {err:.3g} > {tol[name]:.3g} ({cfg})"
    expect = get(method).bytes(_shape(cfg, world_size), **options)
    for rank, res in enumerate(results):
        assert res["counts"] == expect, f"{method} rank {rank}: counted {res['counts']} != formula {expect}"


# ---------------------------------------------------------------- correctness and bytes, fp32

RING_CASES = [(g, c, lay, h) for g in (1, 2, 3, 4) for c in (False, True) for lay in ("contiguous", "zigzag")
              for h in ("mha", "gqa")] + [(3, True, "striped", "gqa"), (4, True, "striped", "mha")]


@pytest.mark.parametrize("world_size,causal,layout,heads", RING_CASES)
def test_ring(pools, world_size, causal, layout, heads):
    check_case(pools, "ring", world_size, causal, layout, heads)


@pytest.mark.parametrize("world_size,causal,layout,heads",
                         [(g, c, "contiguous", h) for g in (1, 2, 3, 4) for c in (False, True) for h in ("mha", "gqa")]
                         + [(3, True, "zigzag", "gqa"), (4, True, "zigzag", "mha"), (3, True, "striped", "mha")])
def test_ring_rsa(pools, world_size, causal, layout, heads):
    check_case(pools, "ring_rsa", world_size, causal, layout, heads)


@pytest.mark.parametrize("world_size,causal,layout,heads",
                         [(g, c, "contiguous", h) for g in (1, 2, 3, 4) for c in (False, True) for h in ("mha", "gqa")]
                         + [(2, True, "zigzag", "gqa"), (4, True, "zigzag", "mha"), (3, True, "zigzag", "mha"),
                            (4, True, "contiguous", "mqa"), (2, False, "zigzag", "mqa"),
                            (3, True, "striped", "mha")])
def test_ulysses(pools, world_size, causal, layout, heads):
    # gqa at G=4 (Zkv=2) and mqa replicate kv heads before the all-to-all.
    check_case(pools, "ulysses", world_size, causal, layout, heads)


@pytest.mark.parametrize("world_size,degree,causal,layout,heads", [
    (4, 2, True, "contiguous", "mha"), (4, 2, True, "zigzag", "mha"), (4, 2, False, "contiguous", "gqa"),
    (4, 2, True, "zigzag", "gqa"), (4, 2, True, "zigzag", "mqa"), (4, 1, True, "zigzag", "gqa"),
    (4, 4, True, "zigzag", "mha"), (2, 2, False, "zigzag", "gqa"), (1, 1, True, "contiguous", "mha"),
    (3, 3, True, "zigzag", "gqa"),
])
def test_usp(pools, world_size, degree, causal, layout, heads):
    check_case(pools, "usp", world_size, causal, layout, heads, ulysses_degree=degree)


@pytest.mark.parametrize("method,world_size,layout,heads,options", [
    ("ring", 4, "zigzag", "gqa", {}), ("ring_rsa", 3, "contiguous", "mha", {}),
    ("ulysses", 4, "zigzag", "gqa", {}), ("usp", 4, "zigzag", "mha", {"ulysses_degree": 2}),
])
def test_bf16_error_budget(pools, method, world_size, layout, heads, options):
    check_case(pools, method, world_size, True, layout, heads, dtype=torch.bfloat16, chunk=16, **options)


# ---------------------------------------------------------------- memory that shows up


def _saved_bytes(cfg: dict) -> int:
    """Bytes autograd keeps for backward of one call (the method's activation memory)."""
    rank, G = dist.get_rank(), dist.get_world_size()
    q, k, v, _ = make_inputs(B, cfg["seqlen"], cfg["heads"], cfg["kv_heads"], D, torch.float32)
    ql, kl, vl = [shard(t, "contiguous", rank, G).requires_grad_() for t in (q, k, v)]
    seen: dict[int, int] = {}

    def pack(t):
        seen[t.data_ptr()] = max(seen.get(t.data_ptr(), 0), t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        get(cfg["method"]).call(ql, kl, vl, causal=True)
    return sum(seen.values())


@pytest.mark.parametrize("method", ["ring", "ring_rsa", "ulysses", "burst"])
def test_saved_activations_match_memory_model(pools, method):
    """ring_rsa really keeps the (B, Z, N/G, N) probabilities; the others keep O(N/G) rows."""
    G, n = 2, 64
    cfg = dict(method=method, seqlen=n, heads=4, kv_heads=2)
    saved = pools.run(G, _saved_bytes, cfg)
    shape = AttnShape(B, n, 4, 2, D, G, dtype="float32")
    assert saved == [get(method).memory(shape)] * G
    if method == "ring_rsa":
        assert saved[0] >= B * 4 * (n // G) * n * 4   # the score rows themselves


# ---------------------------------------------------------------- bad input: ValueError before any byte


def _bad_call(method: str, heads: int, kv_heads: int, options: dict) -> str:
    rank, G = dist.get_rank(), dist.get_world_size()
    q, k, v, _ = make_inputs(1, 4 * G, heads, kv_heads, 8, torch.float32)
    q, k, v = (shard(t, "contiguous", rank, G) for t in (q, k, v))
    with comm.count_bytes() as counts:
        try:
            get(method).call(q, k, v, causal=True, **options)
        except ValueError as e:
            msg = str(e)
        else:
            msg = ""
    assert counts.total() == 0, f"bytes counted before the ValueError: {dict(counts)}"
    # The group still works: no rank is stuck in a half-started collective.
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == G
    return msg


@pytest.mark.parametrize("method,heads,kv_heads,options,needle", [
    ("ulysses", 6, 6, {}, "heads=6"),                          # 6 heads over 4 ranks
    ("ulysses", 8, 3, {}, "must be a multiple of key/value heads"),  # check_inputs: Z % Zkv
    ("ulysses", 12, 3, {}, "kv_heads=3"),                      # 3 kv heads neither split nor divide 4
    ("usp", 4, 4, {"ulysses_degree": 3}, "ulysses_degree=3"),  # 3 x r != 4
    ("usp", 4, 4, {"ulysses_degree": 2, "ring_degree": 3}, "ring_degree=3"),
    ("usp", 6, 6, {"ulysses_degree": 4}, "heads=6"),
])
def test_bad_input_raises_before_communication(pools, method, heads, kv_heads, options, needle):
    msgs = pools.run(4, _bad_call, method, heads, kv_heads, options)
    for m in msgs:
        assert needle in m, m


def test_usp_default_degree_and_registry_checks():
    from baselines.methods.usp import default_ulysses_degree

    assert default_ulysses_degree(4, 8, 8) == 2
    assert default_ulysses_degree(32, 32, 8) == 8
    assert default_ulysses_degree(2, 8, 8) == 1
    with pytest.raises(ValueError, match="ulysses_degree=3"):
        get("usp").validate(AttnShape(1, 64, 4, 4, 8, 4), ulysses_degree=3)
    with pytest.raises(ValueError, match="heads=6"):
        get("ulysses").validate(AttnShape(1, 64, 6, 6, 8, 4))


def test_ring_flash_attn_adapter_is_registered_and_validates_first():
    """Not runnable without CUDA + flash-attn; its checks run before the package is imported."""
    m = get("ring_flash_attn")
    if not torch.cuda.is_available():
        assert not m.available()
    q, k, v, _ = make_inputs(1, 8, 2, 2, 8, torch.bfloat16)
    with pytest.raises(ValueError, match="zigzag"):
        m.call(q, k, v, causal=False, layout="zigzag")
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        m.call(q.float(), k.float(), v.float(), causal=True)
    # Formula: K, V hop G-1 times each way; dK, dV (fp32) are sent at all G backward steps.
    s = AttnShape(1, 1024, 8, 2, 64, 4, dtype="bfloat16")
    blk = 1 * 256 * 2 * 64
    assert m.bytes(s) == {("forward", "k"): 3 * blk * 2, ("forward", "v"): 3 * blk * 2,
                          ("backward", "k"): 3 * blk * 2, ("backward", "v"): 3 * blk * 2,
                          ("backward", "dk"): 4 * blk * 4, ("backward", "dv"): 4 * blk * 4}


def test_formulas_reproduce_the_papers_ratios():
    """docs/papers.md §1 table, MHA, with every tensor at 4 bytes (fp32 inputs and accumulators):
    RingAttention (Li et al.) backward 6BZNd vs forward 2BZNd; blockwise ring backward
    4BZNd; Burst backward 3BZNd + 2BZN; Ulysses 4 all-to-alls each way of N*H/G."""
    s = AttnShape(1, 4096, 8, 8, 64, 4, dtype="float32")

    def phase(name, p):
        return sum(b for (ph, _), b in get(name).bytes(s).items() if ph == p)

    fwd = phase("ring", "forward")
    assert phase("ring_rsa", "forward") == fwd
    assert phase("ring_rsa", "backward") == 3 * fwd
    assert phase("ring", "backward") == 2 * fwd
    rows = 1 * 4096 * 3 // 4 * 8          # c * B*N*Z
    assert phase("burst_qring", "backward") == 3 * fwd // 2 + 2 * rows * 4
    assert phase("ulysses", "forward") == phase("ulysses", "backward") == 4 * (4096 * 512 * 4 // 4) * 3 // 4


def _usp_twice():
    from baselines.methods import usp

    q, k, v, _ = make_inputs(1, 16, 4, 4, 8)
    rank, G = dist.get_rank(), dist.get_world_size()
    q, k, v = (shard(t, "contiguous", rank, G) for t in (q, k, v))
    first = usp.subgroups(None, 2)
    for _ in range(2):
        get("usp").call(q, k, v, causal=True, ulysses_degree=2)
    again = usp.subgroups(None, 2)
    n_keys = sum(1 for key in usp._GROUPS if key == ((0, 1, 2, 3), 2))
    return n_keys, first[0] is again[0] and first[1] is again[1]


def test_usp_subgroups_are_created_once(pools):
    assert pools.run(4, _usp_twice) == [(1, True)] * 4


def test_layout_support_is_declared_and_enforced():
    """striped needs position-generic masks: USP's 2-D split cannot form it and says so up front."""
    from baselines import AttnShape

    assert "striped" in get("burst").layouts and "striped" not in get("usp").layouts
    with pytest.raises(ValueError, match="layout='striped' is not supported by method 'usp'"):
        get("usp").validate(AttnShape(1, 64, 4, 4, 16, 4, layout="striped"))
