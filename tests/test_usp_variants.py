"""burst_usp and loongtrain_usp (issue 34 item 1): the two USP rows of BurstEngine's main table.

Both are Ulysses inside groups of u consecutive ranks and a ring across them; they differ in the
ring's backward (the query side for burst_usp, LoongTrain's K/V side for loongtrain_usp), in
their default degrees and ring, and in what sequence-level checkpointing does with them (burst_usp
caches (O, lse) through ``Method.cached_attention``, loongtrain_usp runs ``seq`` as ``full``).

Checked here, against the single-process fp64 reference (out, every gradient; lse through
burst_usp's cache hook, the only path that returns it), with counted bytes equal to the formulas
per (phase, kind) and per link class on every rank: 2x2 nodes x ranks for every layout they accept,
a mask and uneven N; 3x2 and 2x4 on one or two shapes each (world 8 is slow on 2 cores). The
registry-driven tests (test_double_ring, test_masks_ring, test_defects, test_model_parity,
test_checkpoint) pick both up by their capabilities as well.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from baselines.registry import get
from burst_impl import comm, masks
from burst_impl.balance import resolve_layout
from burst_impl.layout import shard
from burst_impl.model.checkpoint import method_mode
from burst_impl.shape import AttnShape
from tests.refs import attention_reference, make_inputs, max_err

B, D = 1, 8
FP32_RTOL = 2e-5
NAMES = ("burst_usp", "loongtrain_usp")


def _case(method, world, node_size, n, heads, layout, mask=None, **options) -> dict:
    return dict(method=method, world=world, node_size=node_size, n=n, heads=heads, layout=layout, mask=mask,
                options={"node_size": node_size, **options})


def _layout(c: dict):
    return resolve_layout(c["layout"], masks.resolve(True, c["mask"], c["n"]), c["n"], c["world"])


def _run(cases: list[dict]) -> list[dict]:
    """On every rank: each case's out and gradients through the method, its counters, and for
    burst_usp the (O, lse) of its cache hook and the hook's backward from them."""
    rank = dist.get_rank()
    out = []
    for c in cases:
        z, zkv = c["heads"]
        lay = _layout(c)
        q, k, v, do = make_inputs(B, c["n"], z, zkv, D, torch.float32, seed=3)
        ql, kl, vl, dol = (shard(t, lay, rank, c["world"]) for t in (q, k, v, do))
        ql, kl, vl = (t.requires_grad_() for t in (ql, kl, vl))
        method = get(c["method"])
        mask = {} if c["mask"] is None else {"mask": c["mask"]}
        with comm.count_bytes() as counts:
            o = method.call(ql, kl, vl, causal=True, layout=lay, **mask, **c["options"])
            o.backward(dol)
        res = dict(out=o.detach(), dq=ql.grad, dk=kl.grad, dv=vl.grad, counts=dict(counts),
                   links=counts.link_dict(), notes=dict(counts.notes))
        if method.cached_attention is not None:
            hook = method.cached_attention(causal=True, layout=lay, group=None,
                                           options={**method.options, **c["options"], **mask})
            with torch.no_grad(), comm.count_bytes() as hook_counts:
                ho, hlse = hook.forward(ql.detach(), kl.detach(), vl.detach(), lay)
                hq, hk, hv = hook.backward(dol, ql.detach(), kl.detach(), vl.detach(), ho, hlse)
            res.update(hook_out=ho, hook_lse=hlse, hook_dq=hq, hook_dk=hk, hook_dv=hv,
                       hook_counts=dict(hook_counts))
        out.append(res)
    return out


def _check(cases: list[dict], results: list[list[dict]]) -> None:
    for i, c in enumerate(cases):
        z, zkv = c["heads"]
        lay = _layout(c)
        ref = attention_reference(*make_inputs(B, c["n"], z, zkv, D, torch.float64, seed=3), True, mask=c["mask"])
        shape = AttnShape(B, c["n"], z, zkv, D, c["world"], dtype="float32", causal=True, layout=c["layout"],
                          mask=c["mask"] or "")
        method = get(c["method"])
        for rank in range(c["world"]):
            res, what = results[rank][i], f"{c['method']} rank {rank} ({c})"
            pairs = [("out", "out"), ("dq", "dq"), ("dk", "dk"), ("dv", "dv")]
            if "hook_out" in res:
                pairs += [("hook_out", "out"), ("hook_lse", "lse"), ("hook_dq", "dq"), ("hook_dk", "dk"),
                          ("hook_dv", "dv")]
            for got, name in pairs:
                want = shard(ref[name], lay, rank, c["world"], dim=2 if name == "lse" else 1)
                tol = FP32_RTOL * max(ref[name][torch.isfinite(ref[name])].abs().max().item(), 1.0)
                assert max_err(res[got], want) <= tol, f"{what} {got}: {max_err(res[got], want):.3g} > {tol:.3g}"
            assert res["counts"] == method.bytes(shape, rank=rank, **c["options"]), what
            assert res["links"] == method.links(shape, rank, **c["options"]), what
            if "hook_counts" in res:   # the cache's backward runs no forward ring
                assert not [k for k in res["hook_counts"] if k[0] == "backward" and k[1] in ("k", "v")], what


def _check_world(pools, cases: list[dict], timeout: int = 300) -> list[list[dict]]:
    world = cases[0]["world"]
    results = pools.run(world, _run, cases, timeout=timeout)
    _check(cases, results)
    return results


def _grid_2x2() -> list[dict]:
    cases = []
    for m in NAMES:
        u = {"ulysses_degree": 2} if m == "loongtrain_usp" else {}   # its default at 2 ranks per node is 1
        for layout, heads in (("contiguous", (4, 4)), ("zigzag", (4, 2)), ("balanced:2", (4, 4))):
            cases.append(_case(m, 4, 2, 16, heads, layout, **u))
        cases.append(_case(m, 4, 2, 16, (4, 4), "balanced:2", mask="window:5:0", **u))
        cases.append(_case(m, 4, 2, 19, (4, 2), "zigzag", **u))      # uneven N
        cases.append(_case(m, 4, 2, 18, (4, 4), "contiguous", **u))
        cases.append(_case(m, 4, 2, 16, (4, 1), "zigzag", **u))     # one kv head: replicated before the all-to-all
    return cases


def test_fp64_and_bytes_2x2(pools):
    """2 nodes x 2 ranks, u = 2 (the all-to-all inside a node, a ring of one rank per node): every
    layout, GQA (a kv head per rank, and one kv head replicated), a sliding window on the balanced
    layout, uneven N."""
    _check_world(pools, _grid_2x2(), timeout=400)


def test_fp64_and_bytes_3x2(pools):
    """3 nodes x 2 ranks: a ring of 3 nodes behind u = 2, uneven N on zigzag."""
    cases = [_case("burst_usp", 6, 2, 24, (4, 2), "zigzag"), _case("burst_usp", 6, 2, 26, (4, 4), "zigzag"),
             _case("loongtrain_usp", 6, 2, 24, (4, 4), "contiguous", ulysses_degree=2)]
    _check_world(pools, cases)


@pytest.mark.timeout(600)
def test_fp64_and_bytes_2x4_and_the_rings_differ(pools):
    """2 nodes x 4 ranks at the defaults: burst_usp is u = 4 (a node) with a flat Burst ring of one
    rank per node; loongtrain_usp is u = 2 with a K/V ring of 4 (2 per node, one window: flat) and,
    asked for, LoongTrain's double ring. They send different bytes on different links."""
    cases = [_case("burst_usp", 8, 4, 32, (4, 4), "zigzag"), _case("loongtrain_usp", 8, 4, 32, (4, 4), "zigzag"),
             _case("loongtrain_usp", 8, 4, 34, (4, 2), "zigzag", ring_topology="double")]
    results = _check_world(pools, cases, timeout=600)
    notes = [results[0][i]["notes"] for i in range(3)]
    assert notes[0]["burst.backward"] == "burst" and notes[1]["burst.backward"] == "ring"
    assert notes[0]["burst.topology"].startswith("flat ring"), notes[0]     # one ring rank per node
    assert notes[1]["burst.topology"].startswith("flat ring"), notes[1]     # one window
    assert notes[2]["burst.topology"].startswith("double ring over 2 nodes x 2 ranks"), notes[2]


def test_defaults_bytes_and_backward_side_differ():
    """At the paper's shape (4 nodes x 8, 40 heads): burst_usp u = 8, loongtrain_usp u = 4 (the authors'
    exp.sh); the backward's circulating side and the per-link split follow."""
    s = AttnShape(1, 32 * 1024, 40, 40, 128, 32, causal=True, layout="zigzag")
    burst, loong = get("burst_usp"), get("loongtrain_usp")
    full = s.batch * (s.seqlen // 32) * s.heads * s.head_dim * s.elem_size
    assert burst.bytes(s, node_size=8)[("forward", "a2a_q")] == full * 7 // 8
    assert loong.bytes(s, node_size=8)[("forward", "a2a_q")] == full * 3 // 4
    assert ("backward", "q") in burst.bytes(s, node_size=8) and ("backward", "k") not in burst.bytes(s, node_size=8)
    assert ("backward", "k") in loong.bytes(s, node_size=8) and ("backward", "q") not in loong.bytes(s, node_size=8)
    # burst_usp's ring is one rank per node: every ring send crosses; loongtrain_usp's alternates
    assert {k[2] for k in burst.links(s, 0, 8) if not k[1].startswith("a2a_")} == {"inter"}
    assert {k[2] for k in loong.links(s, 0, 8) if not k[1].startswith("a2a_")} == {"intra"}
    assert {k[2] for k in loong.links(s, 4, 8) if not k[1].startswith("a2a_")} == {"inter"}


def test_only_burst_usp_caches_o_and_lse():
    assert method_mode(get("burst_usp"), "seq") == "seq" and method_mode(get("burst_usp"), "whole") == "whole"
    assert method_mode(get("loongtrain_usp"), "seq") == "full" and method_mode(get("usp"), "whole") == "full"
    assert get("loongtrain_usp").cached_attention is None


def test_bound_backward_is_refused():
    q = torch.randn(1, 4, 2, 8)
    for name in NAMES:
        with pytest.raises(ValueError, match=f"backward='auto': {name} binds"):
            get(name).call(q, q, q, backward="auto")


def _steps(method: str, node_size: int) -> dict:
    """One training step per checkpoint mode: loss, grads, bytes the backward phase sent forward-ring kinds."""
    from dataclasses import replace

    from burst_impl.model import build_model, get_config, loss_and_grads, sequence_parallel
    from burst_impl.model.checkpoint import effective_mode
    from tests.model_refs import global_batch

    tokens, labels = global_batch("tiny")
    out = {}
    for mode in ("full", "seq", "whole"):
        cfg = replace(get_config("tiny"), loss="fused", checkpoint=mode)
        model = sequence_parallel(build_model(cfg), get(method), layout="zigzag", node_size=node_size)
        with comm.count_bytes() as counted:
            value = loss_and_grads(model, tokens, labels).item()
        out[mode] = dict(loss=value, grads={n: p.grad for n, p in model.named_parameters()},
                         effective=effective_mode(model.layers[0], mode), counts=dict(counted))
    return out


@pytest.mark.timeout(900)
def test_sequence_level_checkpointing_caches_for_burst_usp_only(pools):
    """2 nodes x 2 ranks, the tiny model: burst_usp under seq and whole gives the fp64 loss and
    gradients with its forward ring's bytes halved (seq) or gone (whole) against full; loongtrain_usp
    runs them as full (the same bytes)."""
    from tests.model_refs import grad_errors, reference
    from tests.test_model_parity import GRAD_RTOL, LOSS_RTOL

    ref = reference("tiny")
    for method in NAMES:
        results = pools.run(4, _steps, method, 2, timeout=900)
        for rank, res in enumerate(results):
            for mode, r in res.items():
                assert abs(r["loss"] - ref["loss"]) <= LOSS_RTOL * abs(ref["loss"]), (method, mode, rank)
                errs = grad_errors(r["grads"], ref["grads"])
                assert max(errs.values()) <= GRAD_RTOL, (method, mode, rank, max(errs, key=errs.get))
            ring_fwd = {m: sum(b for (p, kind), b in res[m]["counts"].items() if p == "forward" and kind in ("k", "v"))
                        for m in res}
            if method == "burst_usp":
                assert [res[m]["effective"] for m in res] == ["full", "seq", "whole"]
                assert ring_fwd["seq"] * 4 == ring_fwd["full"] * 3, ring_fwd      # 1 + 1/2 passes, not 2
                assert ring_fwd["whole"] * 2 == ring_fwd["full"], ring_fwd        # 1 pass, not 2
                # the cache's extra all-to-all: the lse of one forward (whole), of 1 + 1/2 (seq)
                lse_a2a = {m: res[m]["counts"].get(("forward", "a2a_lse"), 0) for m in res}
                assert lse_a2a["full"] == 0 and lse_a2a["whole"] > 0, lse_a2a
                assert lse_a2a["seq"] * 2 == lse_a2a["whole"] * 3, lse_a2a
            else:
                assert [res[m]["effective"] for m in res] == ["full"] * 3
                assert ring_fwd["seq"] == ring_fwd["whole"] == ring_fwd["full"], ring_fwd
