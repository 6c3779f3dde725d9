"""``allgather_kv`` (baselines/methods/allgather_kv.py): all-gather K/V, local attention, reduce-scatter dK/dV.

In fp64 against the fp64 reference: out, lse, dq, dk, dv within 1e-12 relative (``tests/_helpers.fp64_case``,
the bound and its reasoning there), at W = 1..5 (3 and 5 odd), every layout, causal and full, MHA and GQA,
even and uneven N, the window, document and block-sparse masks, non-contiguous inputs, both backward
K/V schemes (``regather``), and the bytes counted on every rank (by kind and by link class) equal to the
formula exactly. Then: what autograd keeps equals the memory formula, bad options are a ValueError on
every rank before any byte, and the plans cover each mask's area exactly.
"""
from __future__ import annotations

import pytest
import torch

from baselines import AttnShape, get
from baselines.methods.allgather_kv import gathered_plan
from burst_impl import comm, masks
from burst_impl.flops import attention_flops
from experiments.perfmodel import predict_case
from burst_impl.layout import shard
from tests._helpers import FP64_D as D, fp64_failures, rel_err as _rel
from tests.refs import attention_reference, make_inputs

LAYOUTS = ("contiguous", "zigzag", "striped", "balanced:2")
MASKS = ((True, ""), (False, ""), (True, "window:3:0"), (False, "window:2:3"), (True, "docs:4:1"),
         (False, "bsparse:2:0.5:3"))


def _heads(world_size: int) -> dict[str, tuple[int, int]]:
    z = {1: 2, 2: 4, 3: 3, 4: 4, 5: 5}[world_size]
    return {"mha": (z, z), "gqa": (z, 1)}


def _cases(world_size: int) -> list[tuple]:
    """Every layout x mask at an uneven N (and an even one for the plain masks), MHA for causal and
    full, GQA for all; ``regather`` both ways; at W = 4 two nodes of two ranks (intra and inter bytes).
    Block-sparse needs N divisible by its block (2): its N is the even one."""
    node = {"node_size": 2} if world_size == 4 else {}
    layouts = LAYOUTS if world_size > 1 else ("contiguous",)
    even = 4 * max(world_size, 3)   # N >= 12: docs:4:1 then has documents longer than one token
    uneven = even - 1
    out = []
    for layout in layouts:
        for causal, mask in MASKS:
            kinds = ("mha", "gqa") if not mask else ("gqa",)
            for kind in kinds:
                for n in ((even,) if mask.startswith("bsparse") else (even, uneven) if not mask else (uneven,)):
                    for regather in (True, False):
                        out.append(("allgather_kv", n, layout, causal, _heads(world_size)[kind], mask,
                                    {"regather": regather, **node}))
    return out


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5])
def test_every_layout_mask_and_uneven_n_against_fp64_and_bytes_equal_the_formula(pools, world_size):
    cases = _cases(world_size)
    for rank, bad in enumerate(pools.run(world_size, fp64_failures, cases, True, timeout=600)):
        assert not bad, f"W={world_size} rank {rank}: {len(bad)} of {len(cases)} cases fail, first: {bad[:2]}"


def _grad_dtype_case() -> tuple[dict, dict, float]:
    """fp32 inputs, a float64 reduce-scatter: counted bytes by kind, the formula, and the gradients' error."""
    rank, G = comm.world()
    n, z, zkv = 4 * G + 1, 4, 2
    q, k, v, do = make_inputs(1, n, z, zkv, D, torch.float32, seed=7)
    ref = attention_reference(q, k, v, do, True)
    ql, kl, vl = (shard(t, "zigzag", rank, G).requires_grad_() for t in (q, k, v))
    opts = dict(grad_comm_dtype=torch.float64)
    with comm.count_bytes() as counts:
        out = get("allgather_kv").call(ql, kl, vl, causal=True, layout="zigzag", **opts)
        out.backward(shard(do, "zigzag", rank, G))
    shape = AttnShape(1, n, z, zkv, D, G, dtype="float32", causal=True, layout="zigzag")
    err = max(_rel(t.grad, shard(ref[name], "zigzag", rank, G), ref[name])
              for name, t in (("dq", ql), ("dk", kl), ("dv", vl)))
    return dict(counts), get("allgather_kv").bytes(shape, rank=rank, **opts), err


def test_reduce_scatter_dtype_sets_the_gradient_bytes(pools):
    for counted, formula, err in pools.run(3, _grad_dtype_case):
        assert counted == formula
        assert counted[("backward", "dk")] == 2 * counted[("forward", "k")]     # f = 8 bytes, e = 4
        assert err < 2e-5                                                          # fp32: tests/test_baselines.py


def _saved(regather: bool) -> int:
    rank, G = comm.world()
    q, k, v, _ = make_inputs(2, 8 * G, 4, 2, D, torch.float32)
    ql, kl, vl = (shard(t, "zigzag", rank, G).requires_grad_() for t in (q, k, v))
    seen: dict[int, int] = {}

    def pack(t):
        seen[t.data_ptr()] = max(seen.get(t.data_ptr(), 0), t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        get("allgather_kv").call(ql, kl, vl, causal=True, layout="zigzag", regather=regather)
    return sum(seen.values())


@pytest.mark.parametrize("regather", [True, False])
def test_saved_activations_match_the_memory_formula(pools, regather):
    G = 2
    shape = AttnShape(2, 8 * G, 4, 2, D, G, dtype="float32", causal=True, layout="zigzag")
    want = get("allgather_kv").memory(shape, regather=regather)
    assert pools.run(G, _saved, regather) == [want] * G
    gathered = 2 * 2 * 8 * G * 2 * D * 4                 # K and V, (B, N, Zkv, d) fp32, instead of their shards
    assert want - get("allgather_kv").memory(shape, regather=True) == (0 if regather else gathered - gathered // G)


def _bad(regather) -> tuple[str, int]:
    rank, G = comm.world()
    q, k, v, _ = make_inputs(1, 4 * G, 2, 2, D, torch.float32)
    q, k, v = (shard(t, "contiguous", rank, G) for t in (q, k, v))
    with comm.count_bytes() as counts:
        try:
            get("allgather_kv").call(q, k, v, causal=True, regather=regather if rank == 1 else True)
        except ValueError as e:
            return str(e), counts.total()
    return "", counts.total()


def test_a_bad_option_on_one_rank_is_a_value_error_on_every_rank_before_any_byte(pools):
    for rank, (msg, sent) in enumerate(pools.run(3, _bad, "yes")):
        assert sent == 0, msg
        assert "regather='yes' must be True" in msg if rank == 1 else "rejected on rank(s) [1]" in msg, msg
    with pytest.raises(ValueError, match="regather='yes'"):
        get("allgather_kv").validate(AttnShape(1, 12, 2, 2, D, 3), regather="yes")


@pytest.mark.parametrize("spec,causal", [("", True), ("", False), ("window:5:0", True), ("docs:6:2", True),
                                         ("bsparse:4:0.4:1", False)])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "striped"])
def test_the_plans_of_all_ranks_cover_the_mask_exactly_once(spec, causal, layout):
    n, G = 64, 4
    m = masks.resolve(causal, spec or None, n)
    assert sum(gathered_plan(m, layout, r, G, n).entries for r in range(G)) == m.area(n)


# ---------------------------------------------------------------- performance model


@pytest.mark.parametrize("regather", [True, False])
@pytest.mark.parametrize("layout,mask", [("contiguous", ""), ("zigzag", ""), ("balanced", "docs:2048:1"),
                                         ("zigzag", "window:1024:0")])
def test_the_model_places_every_registry_byte_and_the_suites_flops(layout, mask, regather):
    s = AttnShape(1, 16384, 8, 2, 64, 8, dtype="bfloat16", causal=True, layout=layout, mask=mask)
    opts = {"regather": regather}
    for mode in ("forward", "backward"):
        p = predict_case("allgather_kv", s, mode=mode, level="op", hardware="a800_ib_4x8", options=opts,
                         keep_schedule=True)
        want = {k: v for k, v in get("allgather_kv").bytes(s, **opts).items() if k[0] == mode}
        assert all(p.bytes_per_rank[g] == want for g in range(s.world_size)), (mode, p.bytes_per_rank[0], want)
        work = sum(t.flops for t in p.schedule.tasks if t.kind == "compute")
        assert work == pytest.approx(attention_flops(s, mode=mode), rel=1e-12)
