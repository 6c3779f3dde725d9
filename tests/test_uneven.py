"""Any sequence length on any number of ranks (issue 22), and ranks that disagree get the same ValueError.

Every sequence-parallel method of the registry (``op_methods``: a method added there is covered without an
edit) x every layout it accepts x causal and full x MHA and GQA, at W = 1..5 and N = 2W + r for every r in
0..W-1 (plus N = 4W - 1, so zigzag's 2W chunks get their extra tokens on the second chunks too; what
repeats a code path is left out, see ``_cases``), in fp64 against the fp64 reference: out, lse (where the
method returns it), dq, dk, dv within 1e-12 relative, and the bytes counted on every rank equal the
method's formula for that rank exactly (``tests/_helpers.fp64_case``). A case a method cannot run
(``Method.problem``) is left out with its reason printed. Windows and documents at uneven N; the model's
loss and gradients at an uneven N; a disagreement test for each agreed parameter. Cases are looped inside
one submitted function per world size (tests/distpool.py), tiny shapes (d = 8, 1-5 heads).

fp64 tolerance (``_helpers.FP64_RTOL``): the reference and the methods both accumulate in fp64 (u = 1.1e-16)
over at most N = 19 keys and W merges; 1e-12 relative leaves a factor ~100 over the worst case seen (1e-15)
and is 10^10 below a wrong mask or a misplaced block.
"""
from __future__ import annotations

import inspect

import pytest
import torch

from baselines import AttnShape, get
from baselines.registry import methods_with
from burst_impl import burst_attn_func, comm
from burst_impl.layout import lengths, shard
from tests._helpers import FP64_D as D, FP64_RTOL, fp64_failures, rel_err as _rel
from tests.refs import attention_reference, make_inputs


def op_methods() -> tuple[str, ...]:
    """Every sequence-parallel method of the registry: op level, no timing variant (their method's numerics:
    ``test_timing_variants_at_uneven_n``), no peer adapter (its sends happen inside the peer's package:
    tests/test_baselines_peers.py)."""
    return methods_with(level="op", variants=False, adapters=False, available=True)


def method_layouts(method: str) -> tuple[str, ...]:
    """The layouts ``method`` accepts (the registry's), balanced with K = 2 chunks per rank so that N >= 2W
    suffices."""
    return tuple("balanced:2" if lay == "balanced" else lay for lay in get(method).layouts)


def heads_for(world_size: int) -> dict[str, tuple[int, int]]:
    """(Z, Zkv) that every method splits over ``world_size`` ranks (Ulysses: Z % W == 0)."""
    z = {1: 2, 2: 4, 3: 3, 4: 4, 5: 5}[world_size]
    return {"mha": (z, z), "gqa": (z, 1 if z % 2 else z // 2)}


def _takes_degree(method: str) -> bool:
    return "ulysses_degree" in inspect.signature(get(method).fn).parameters


def options_for(method: str, world_size: int) -> dict:
    """At W = 4: 2 nodes of 2 ranks for every method (bytes per link class: intra and inter), so the
    double rings are real 2 x 2 double rings (elsewhere their flat fallback) and the USPs (the methods with
    a ``ulysses_degree``) run their all-to-all of 2 inside a node and their ring of 2 across."""
    if world_size != 4:
        return {}
    return {"node_size": 2, **({"ulysses_degree": 2} if _takes_degree(method) else {})}


def seqlens(world_size: int) -> list[int]:
    """N = 2W + r for every r in 0..W-1, and 4W - 1 (zigzag's second chunks get tokens too)."""
    extra = [4 * world_size - 1] if world_size > 1 else []
    return [2 * world_size + r for r in range(world_size)] + extra


def _head_kinds(method: str, world_size: int) -> tuple[str, ...]:
    """``burst`` (auto) is ``burst_qring``'s code for MHA and ``ring``'s for GQA (auto picks by bytes), so it
    runs GQA only; a USP below W = 4 (no nodes given: its Ulysses degree is 1) is its ring alone, so GQA
    only there."""
    if method == "burst" or _takes_degree(method) and world_size != 4:
        return ("gqa",)
    return ("mha", "gqa")


def _candidates(method: str, world_size: int):
    """The matrix of one method, less what repeats a code path: a double ring (``topology='double'``)
    below W = 4 is the flat ring's code (its fallback), so contiguous only there; at W = 1 every layout
    is the identity (contiguous only); the N = 4W - 1 value only for the layouts with 2 chunks per rank
    (zigzag, balanced:2); MHA and GQA alternate over (layout, causal, N), so every (layout, causal) of a
    method sees both (as tests/test_masks_ring.py alternates them)."""
    opts = options_for(method, world_size)
    double = get(method).options.get("topology") == "double"
    kinds = _head_kinds(method, world_size)
    for li, layout in enumerate(method_layouts(method)):
        if (world_size == 1 or double and world_size != 4) and layout != "contiguous":
            continue
        for ci, causal in enumerate((False, True)):
            for ni, n in enumerate(seqlens(world_size)):
                if n > 3 * world_size and layout not in ("zigzag", "balanced:2"):
                    continue
                kind = kinds[(li + ci + ni) % len(kinds)]
                yield (method, n, layout, causal, heads_for(world_size)[kind], "", opts)


def runnable(candidates, world_size: int) -> list[tuple]:
    """The cases their method can run at ``world_size`` (``Method.problem``); each method's reason for the
    ones left out is printed (pytest -s or -rP shows it)."""
    out, why = [], {}
    for case in candidates:
        method, n, layout, causal, (z, zkv), mask, opts = case
        shape = AttnShape(1, n, z, zkv, D, world_size, dtype="float64", causal=causal, layout=layout, mask=mask)
        problem = get(method).problem(shape, "op", **opts)
        if problem is None:
            out.append(case)
        else:
            why.setdefault(method, problem)
    for method, problem in why.items():
        print(f"W={world_size}: cases of {method} left out: {problem}")
    return out


def _cases(world_size: int) -> list[tuple]:
    return runnable((c for m in op_methods() for c in _candidates(m, world_size)), world_size)


def test_every_method_has_uneven_cases_at_every_world_size():
    """No method drops out of the matrix silently: each has cases at every W (a case a method cannot run is
    left out with its reason printed, ``runnable``; none is today), every layout it accepts above W = 1,
    both causal values and, unless ``_head_kinds`` says why not, both head kinds."""
    for w in (1, 2, 3, 4, 5):
        cases = _cases(w)
        for m in op_methods():
            mine = [c for c in cases if c[0] == m]
            assert {c[3] for c in mine} == {False, True}, (w, m)
            assert len({c[4] for c in mine}) == len(_head_kinds(m, w)), (w, m)
        if w == 4:
            assert all({c[2] for c in cases if c[0] == m} == set(method_layouts(m)) for m in op_methods())


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5])
def test_every_method_layout_and_uneven_n_against_fp64(pools, world_size):
    cases = _cases(world_size)
    for rank, bad in enumerate(pools.run(world_size, fp64_failures, cases, timeout=300)):
        assert not bad, f"W={world_size} rank {rank}: {len(bad)} of {len(cases)} cases fail, first: {bad[:3]}"


# ---------------------------------------------------------------- masks at uneven N


MASKS = ((True, "window:3:0"), (False, "window:2:3"), (True, "docs:4:1"))


def _mask_cases(world_size: int) -> list[tuple]:
    """A causal and a bidirectional window narrower than a shard, and seeded documents (spec strings:
    the same on every rank and in the formula's AttnShape), at two uneven N, GQA, every mask method but
    ``burst`` (auto: ``ring``'s code for GQA) and every layout it accepts (balanced:2 resolved for each mask:
    its chunks differ by a token); the two N alternate over (layout, mask), so every (layout, mask) of a
    method runs one of them and every layout and every mask both."""
    out = []
    heads = heads_for(world_size)["gqa"]
    ns = (3 * world_size + 1, 4 * world_size - 1)
    for method in methods_with(level="op", masks=True, variants=False, adapters=False, available=True):
        if method == "burst":
            continue
        opts = options_for(method, world_size)
        for li, layout in enumerate(method_layouts(method)):
            for mi, (causal, mask) in enumerate(MASKS):
                out.append((method, ns[(li + mi) % 2], layout, causal, heads, mask, opts))
    return runnable(out, world_size)


@pytest.mark.parametrize("world_size", [3, 4])
def test_windows_and_documents_at_uneven_n(pools, world_size):
    cases = _mask_cases(world_size)
    for rank, bad in enumerate(pools.run(world_size, fp64_failures, cases, timeout=300)):
        assert not bad, f"W={world_size} rank {rank}: {len(bad)} of {len(cases)} cases fail, first: {bad[:3]}"


# ---------------------------------------------------------------- ranks that disagree


def _call(odd: bool, param: str):
    """(method, q, k, v, keywords) of this rank for a call where the odd rank deviates in ``param``."""
    rank, G = comm.world()
    z, zkv, d, b, dtype, layout = 3, 3, D, 1, torch.float32, "contiguous"
    method, kw = "burst", dict(causal=True)
    if odd:
        z = 6 if param == "heads" else z
        zkv = 1 if param == "kv_heads" else zkv
        d = 16 if param == "head_dim" else d
        b = 2 if param == "batch" else b
        dtype = torch.float64 if param == "dtype" else dtype
        layout = "zigzag" if param == "layout" else layout
        kw = dict(causal=param != "causal", mask="window:2:0" if param == "mask" else None,
                  softmax_scale=0.5 if param == "softmax_scale" else None)
        kw.update({"backward": "ring"} if param == "backward" else {})
        kw.update({"grad_comm_dtype": torch.float64} if param == "grad_comm_dtype" else {})
        kw.update({"overlap": False} if param == "options" else {})
        method = "ring_rsa" if param == "method" else method
    q, k, v, _ = make_inputs(b, 10, z, zkv, d, dtype)
    q, k, v = (shard(t, layout, rank, G) for t in (q, k, v))
    if param == "seq_local":                      # 3/4/3: no layout's split of N = 10
        q, k, v = (make_inputs(1, 10, 3, 3, D)[i][:, [0, 3, 7][rank]:[3, 7, 10][rank]] for i in range(3))
    return method, q, k, v, dict(layout=layout, **kw)


DISAGREE = ("dtype", "batch", "heads", "kv_heads", "head_dim", "causal", "mask", "softmax_scale", "layout",
            "backward", "grad_comm_dtype", "options", "method", "seq_local")


def _disagreements() -> list[str]:
    """Every parameter in turn: the last rank deviates; every rank must raise, send nothing, and the
    group must then run a correct call."""
    rank, G = comm.world()
    msgs = []
    for param in DISAGREE:
        method, q, k, v, kw = _call(rank == G - 1, param)
        fn = burst_attn_func if method == "burst" else get(method).call
        with comm.count_bytes() as counts:
            try:
                fn(q, k, v, **{n: x for n, x in kw.items() if x is not None or n != "mask"})
            except ValueError as e:
                msgs.append(str(e))
            else:
                raise AssertionError(f"{param}: no ValueError on rank {rank}")
        assert counts.total() == 0, f"{param}: bytes sent before the error: {dict(counts)}"
        _, q, k, v, _ = _call(False, "none")          # the group stays usable
        q.requires_grad_()
        burst_attn_func(q, k, v, causal=True).sum().backward()
    return msgs


def test_every_disagreement_is_the_same_value_error_on_every_rank(pools):
    per_rank = pools.run(3, _disagreements)
    for i, param in enumerate(DISAGREE):
        msgs = {m[i] for m in per_rank}
        assert len(msgs) == 1, f"{param}: the ranks' messages differ: {msgs}"
        msg = msgs.pop()
        name = "seq_local" if param == "seq_local" else param
        assert name in msg and "rank 0" in msg or param == "seq_local" and "the ranks hold (3, 4, 3)" in msg, msg


def _disagree_ulysses_heads() -> str:
    """The crash of issue 22: one rank with 8 heads, the others 4 (gloo aborted a process)."""
    rank, G = comm.world()
    z = 8 if rank == 0 else 4
    q, k, v, _ = make_inputs(1, 9, z, 2, D)
    q, k, v = (shard(t, "contiguous", rank, G) for t in (q, k, v))
    try:
        get("ulysses").call(q, k, v, causal=True)
    except ValueError as e:
        return str(e)
    raise AssertionError("no ValueError")


def test_ulysses_heads_mismatch_is_an_error_not_a_crash(pools):
    msgs = set(pools.run(2, _disagree_ulysses_heads))
    assert len(msgs) == 1 and "heads: rank 0: 8, rank 1: 4" in msgs.pop()


# ---------------------------------------------------------------- the model at an uneven N

MODEL_N = {3: 25, 4: 26}      # 25 = 3 * 8 + 1 tokens over 3 ranks; 26 = 4 * 6 + 2 over 4


def _model_run(method: str, layouts: list[str], seqlen: int, options: dict) -> dict:
    """One step and one prefill of the tiny model per layout on this rank; loss, gradients, next tokens,
    counted bytes and the formula's (n_layers x the method's bytes for this rank + loss + grad sync)."""
    from burst_impl.model import build_model, get_config, loss_and_grads, prefill_step, sequence_parallel
    from burst_impl.model.parallel import grad_sync_bytes
    from burst_impl.model.sequence_parallel import attn_shape
    from tests.model_refs import BATCH, global_batch

    rank, G = comm.world()
    cfg = get_config("tiny")
    tokens, labels = global_batch("tiny", seqlen=seqlen)
    out = {}
    for layout in layouts:
        model = sequence_parallel(build_model(cfg), get(method), layout=layout, **options)
        with comm.count_bytes() as step:
            loss = loss_and_grads(model, tokens, labels).item()
        ids = prefill_step(model, tokens)
        per_layer = get(method).bytes(attn_shape(cfg, BATCH, seqlen, G, layout, "float32"), rank=rank, **options)
        expect = {k: v * cfg.n_layers for k, v in per_layer.items()}
        expect[("forward", "loss")] = 2 * 16 * (G - 1) // G          # [sum, count] in fp64
        for k, v in grad_sync_bytes(model).items():
            expect[k] = expect.get(k, 0) + v
        out[layout] = dict(loss=loss, grads={n: p.grad for n, p in model.named_parameters()}, ids=ids,
                           counted=dict(step), expect=expect)
    return out


@pytest.mark.parametrize("method,world_size,layouts,options", [
    ("burst", 3, ["contiguous", "zigzag", "striped"], {}), ("ring", 3, ["zigzag"], {}),
    ("ulysses", 3, ["zigzag", "striped"], {}), ("ring_rsa", 3, ["contiguous"], {}),
    ("usp", 4, ["zigzag"], {"ulysses_degree": 2}), ("burst_double_ring", 4, ["zigzag"], {"node_size": 2}),
])
def test_model_loss_and_gradients_at_uneven_n(pools, method, world_size, layouts, options):
    """fp32 model against the fp64 single-process one: tolerances of tests/test_model_parity.py."""
    from tests.model_refs import grad_errors, reference
    from tests.test_model_parity import GRAD_RTOL, LOSS_RTOL

    n = MODEL_N[world_size]
    ref = reference("tiny", n)
    for rank, res in enumerate(pools.run(world_size, _model_run, method, layouts, n, options)):
        for layout, r in res.items():
            what = f"{method} G={world_size} N={n} {layout} rank {rank}"
            assert abs(r["loss"] - ref["loss"]) / abs(ref["loss"]) <= LOSS_RTOL, f"{what}: loss"
            worst = max(grad_errors(r["grads"], ref["grads"]).items(), key=lambda kv: kv[1])
            assert worst[1] <= GRAD_RTOL, f"{what}: gradient {worst}"
            assert torch.equal(r["ids"], ref["next_ids"]), f"{what}: next tokens"
            assert r["counted"] == r["expect"], f"{what}: counted {r['counted']} != formula {r['expect']}"


# ---------------------------------------------------------------- the opt-out, and N < G


def _opted_out(seqlen) -> float:
    """N = 10 over 3 ranks (4/3/3) with the agreement off: ``seqlen=`` gives N; without it N would be
    seq_local x G, which only even shards satisfy."""
    rank, G = comm.world()
    q, k, v, do = make_inputs(1, 10, 3, 3, D, torch.float64)
    ref = attention_reference(q, k, v, do, True)
    ql = shard(q, "contiguous", rank, G).requires_grad_()
    with comm.check_shapes(False):
        out = burst_attn_func(ql, shard(k, "contiguous", rank, G), shard(v, "contiguous", rank, G), causal=True,
                              seqlen=seqlen)
    out.backward(shard(do, "contiguous", rank, G))
    assert comm.shape_check_enabled()
    return max(_rel(out, shard(ref["out"], "contiguous", rank, G), ref["out"]),
               _rel(ql.grad, shard(ref["dq"], "contiguous", rank, G), ref["dq"]))


def test_opt_out_with_seqlen(pools):
    assert max(pools.run(3, _opted_out, 10)) <= FP64_RTOL


def _fewer_tokens_than_ranks() -> str:
    rank, G = comm.world()
    q = torch.randn(1, 1 if rank < 2 else 0, 2, D)       # N = 2 tokens over 3 ranks: rank 2 has none
    try:
        burst_attn_func(q, q, q)
    except ValueError as e:
        return str(e)
    raise AssertionError("no ValueError")


def test_fewer_tokens_than_ranks_is_a_value_error_on_every_rank(pools):
    msgs = pools.run(3, _fewer_tokens_than_ranks)
    assert "seq_local=q.shape[1]=0 must be positive" in msgs[2]
    assert msgs[0] == msgs[1] and "inputs rejected on rank(s) [2]" in msgs[0]
    with pytest.raises(ValueError, match=r"seqlen=2 must be >= 3 .* seqlen >= number of chunks"):
        lengths("contiguous", 3, 2)


# ---------------------------------------------------------------- skipping and balance with a token more


def test_causal_skipping_and_zigzag_balance_at_uneven_n():
    """Causal: the contiguous pairs above the diagonal are still empty plans (skipped), and the plans cover
    the N(N+1)/2 live entries exactly once; zigzag (and striped) stay balanced up to the extra tokens:
    1 + O(G/N) at a realistic N."""
    from burst_impl import balance, masks, plan

    causal = masks.Causal()
    for n, g in ((10, 3), (17, 4), (23, 5)):
        for layout in ("contiguous", "zigzag", "striped"):
            e = plan.entries_matrix(causal, layout, n, g)
            assert int(e.sum()) == n * (n + 1) // 2, (layout, n, g)
        e = plan.entries_matrix(causal, "contiguous", n, g)
        assert all(int(e[a, b]) == 0 for a in range(g) for b in range(a + 1, g)), e
    for layout in ("zigzag", "striped"):
        w = balance.work_per_rank(causal, layout, 4099, 4)
        assert balance.imbalance(w["rows"]) < 1.002 and balance.imbalance(w["cols"]) < 1.002, (layout, w)


# ---------------------------------------------------------------- methods as attention layers at uneven N


@pytest.mark.parametrize("method,world_size,layout,options", [
    ("burst", 3, "zigzag", {}), ("ulysses", 3, "contiguous", {}), ("usp", 4, "zigzag", {"ulysses_degree": 2}),
])
def test_layers_at_uneven_n(pools, method, world_size, layout, options):
    """baselines.layer (projections + attention + output projection, what the harness's layer level runs)
    at N = 2W*5 + 1: output and dX per rank, the summed weight gradients (fp32 against fp64, the
    tolerance of tests/test_baselines_layer.py) and the bytes of every rank."""
    from baselines.layer import full_grads
    from tests.test_baselines_layer import B as LB, D as LD, FP32_RTOL, _run_layer, layer_reference

    shape = AttnShape(LB, 10 * world_size + 1, 6 if world_size == 3 else 4, 2 if world_size == 4 else 3, LD,
                      world_size, dtype="float32", causal=True, layout=layout)
    results = pools.run(world_size, _run_layer, method, shape, options)
    ref = layer_reference(shape)
    for rank, res in enumerate(results):
        for name in ("y", "dx"):
            err = (res[name].double() - shard(ref[name], layout, rank, world_size)).abs().max().item()
            assert err <= FP32_RTOL * max(ref[name].abs().max().item(), 1.0), f"{method} rank {rank} {name}: {err}"
        assert res["counts"] == get(method).bytes(shape, rank=rank, **options), f"{method} rank {rank}: bytes"
    for name, g in full_grads([r["grads"] for r in results], shape).items():
        err = (g - ref["grads"][name]).abs().max().item()
        assert err <= FP32_RTOL * max(ref["grads"][name].abs().max().item(), 1.0), f"{method} grad {name}: {err}"


# ---------------------------------------------------------------- the experiment harness at an uneven N


def test_harness_runs_an_uneven_case(tmp_path):
    """A spec with N = 67 over 2 zigzag ranks (33 / 34 tokens) runs end to end (torchrun, gloo): the
    records are ok and the counted bytes equal the formula of the rank that sends most."""
    from tests.test_experiments_e2e import _run, _spec

    spec = _spec(tmp_path, name="t_uneven", methods=["burst", "ulysses"], baseline="burst", repeats=1,
                 sweep={"seqlen": [67], "world_size": 2, "heads": 2, "head_dim": 8, "layout": "zigzag"})
    recs = _run(tmp_path, spec, "--no-plots")
    assert len(recs) == 2 and {r["status"] for r in recs} == {"ok"}, [r.get("reason") for r in recs]
    for r in recs:
        assert r["comm_fwd_bytes"] == r["comm_fwd_formula_bytes"] > 0, r["method"]
        assert r["comm_bwd_bytes"] == r["comm_bwd_formula_bytes"] > 0, r["method"]
        assert len(set(r["comm_fwd_bytes_per_rank"])) == 2, r["comm_fwd_bytes_per_rank"]   # ranks differ


def _bad_on_one_rank() -> list[str]:
    """Method rules that fail on the last rank only (ring_rsa's backend, usp's ulysses_degree): every
    rank raises (the others: "inputs rejected"), none waits in the agreement."""
    rank, G = comm.world()
    q, k, v, _ = make_inputs(1, 8, 4, 4, D)
    q, k, v = (shard(t, "contiguous", rank, G) for t in (q, k, v))
    bad = rank == G - 1
    msgs = []
    for method, kw in (("ring_rsa", {"backend": "cpu_flash" if bad else None}),
                       ("usp", {"ulysses_degree": 3 if bad else 2})):
        try:
            get(method).call(q, k, v, causal=True, **kw)
        except ValueError as e:
            msgs.append(str(e))
        else:
            raise AssertionError(f"{method}: no ValueError on rank {rank}")
    return msgs


def test_a_method_rule_failing_on_one_rank_raises_on_every_rank(pools):
    msgs = pools.run(2, _bad_on_one_rank, timeout=60)
    assert "backend='cpu_flash'" in msgs[1][0] and "inputs rejected on rank(s) [1]" in msgs[0][0]
    assert "ulysses_degree=3" in msgs[1][1] and "inputs rejected on rank(s) [1]" in msgs[0][1]


def test_timing_variants_at_uneven_n(pools):
    """The registry's timing variants (``variant_of``: the ``*_no_overlap`` ones, every transfer waited for
    before computing) at W = 4, 2 x 2 nodes, N = 4W + 1 and 4W + 3, causal, GQA: the same numerics and bytes
    as their method."""
    heads = heads_for(4)["gqa"]
    variants = [m for m in methods_with(level="op", adapters=False, available=True) if get(m).variant_of]
    cases = [(m, n, layout, True, heads, "", options_for(m, 4))
             for m in variants for layout in ("contiguous", "zigzag") for n in (17, 19)]
    for rank, bad in enumerate(pools.run(4, fp64_failures, cases, timeout=300)):
        assert not bad, f"rank {rank}: {bad[:3]}"


def test_double_ring_on_2x3_and_3x2_at_uneven_n(pools):
    """The double ring's receive shapes (each peer's schedule) and its per-link formula on grids that are
    not square: W = 6 as 2 nodes x 3 ranks and 3 x 2, N = 6*2 + 1 and 6*3 + 5, and both backwards."""
    heads = (6, 2)
    cases = [(m, n, "zigzag", True, heads, "", {"node_size": ns})
             for m in ("burst_double_ring", "burst_double_ring_no_overlap") for ns in (3, 2) for n in (13, 23)]
    for rank, bad in enumerate(pools.run(6, fp64_failures, cases + _forced_backwards(), timeout=300)):
        assert not bad, f"rank {rank}: {bad[:3]}"


def _forced_backwards() -> list[tuple]:
    """Both backwards on the double ring: burst_double_ring's auto picks the query side for MHA and the
    key/value side for GQA (6 vs 1 kv heads), by bytes (volume.cheaper_backward)."""
    return [("burst_double_ring", 17, "contiguous", True, (6, 6), "", {"node_size": 3}),     # MHA: query side
            ("burst_double_ring", 17, "striped", False, (6, 1), "", {"node_size": 2})]       # GQA: key/value side
