"""Issue 16: defects found by an independent test suite, one section per defect.

1. inputs of any strides (a head dim that is not unit-stride was read as garbage);
2. fp64 end to end (lse and delta in fp64; gradcheck);
3./4. a block computation that raises inside a ring leaves the group usable;
   bad input is rejected before the first send;
5. nested ``count_bytes``;
6. shards of different lengths: the opt-in cross-rank shape check;
7. a worker killed mid-sweep: the sweep records it, goes on and draws its figures.

Multi-process cases run on the gloo pool (``pools``) at world sizes 1 and 3
(the odd one), plus 4 where USP needs it for its Ulysses x ring split; every
result is compared with the single-process fp64 reference (tests/refs.py).

The tests about every method take their methods from the registry (``sp_methods``: every
sequence-parallel method we implement; ``layer_methods``), so a new one is covered without an
edit; the lists kept by name below are about one method each and say so.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import yaml

from baselines import AttnShape, get
from baselines.layer import layer_forward, layer_input, local_grads, make_layer
from baselines.registry import methods_with
from burst_impl import burst_attn_func, comm
from burst_impl.layout import shard, unshard
from tests._helpers import method_params
from tests.refs import attention_reference, make_inputs, max_err

B, D, CHUNK = 2, 24, 3     # head dim 24 (not a power of two); 3 tokens per layout chunk
# fp32, relative to the largest reference magnitude, as in test_burst_attention.py: softmax-weighted
# sums over at most N = 24 keys in fp32 (eps 1.2e-7) with one merge per ring step err by at most
# ~N*eps = 3e-6; 2e-5 leaves a factor > 4 and is far below what a strided view read as garbage does
# (errors of 1 to 1e38 in the reproductions).
FP32_RTOL = 2e-5
# fp64: the same sums in fp64 (eps 2.2e-16) err by ~N*eps = 5e-15; 1e-12 leaves a factor 200, and any
# fp32 step left in the path (an fp32 lse, delta or accumulator) shows up as ~1e-7, 1e5 times more.
FP64_RTOL = 1e-12
# gradcheck (fp64, central differences with eps=1e-6): truncation error ~eps^2 = 1e-12 and rounding
# ~1e-16/eps = 1e-10 relative, so rtol 1e-5 / atol 1e-7 still leave a factor 100; gradcheck's own
# defaults (1e-3 / 1e-5) would let a gradient that is 0.1% off pass.
GRADCHECK_TOL = dict(rtol=1e-5, atol=1e-7)


def heads_for(world_size: int) -> tuple[int, int]:
    """GQA heads every method can split over ``world_size`` ranks (Ulysses needs Z, Zkv % G == 0)."""
    return (6, 3) if world_size == 3 else (4, 2)


def _seqlen(world_size: int) -> int:
    return 2 * world_size * CHUNK * (2 if world_size == 1 else 1)


def sp_methods(layout: str = "zigzag") -> tuple[str, ...]:
    """Every sequence-parallel method we implement that takes ``layout``, from the registry. Timing
    variants (their method's numerics: ``variant_of``) and peer adapters (sends inside the peer's
    package; tests/test_baselines_peers.py checks each against ours) are left out."""
    return methods_with(level="op", layout=layout, variants=False, adapters=False)


# usp's Ulysses x ring splits beyond its default degree (1 on one node of <= 3 ranks: the ring alone);
# about usp alone, so kept by name: all-to-all over all 3 ranks, and all-to-all inside pairs with the
# Burst ring across them.
USP_SPLITS = [("usp", 3, {"ulysses_degree": 3}), ("usp", 4, {"ulysses_degree": 2})]


# ---------------------------------------------------------------- 1. strides

def _padded(t):
    """A view into a wider buffer (stride(-2) > shape(-1)), like q of a packed qkv projection."""
    buf = torch.zeros(*t.shape[:-1], t.shape[-1] + 3, dtype=t.dtype)
    buf[..., : t.shape[-1]] = t
    return buf[..., : t.shape[-1]]


def _seq_strided(t):
    """Every other token of a twice-longer buffer: stride(1) doubled."""
    buf = torch.zeros(t.shape[0], 2 * t.shape[1], *t.shape[2:], dtype=t.dtype)
    buf[:, ::2] = t
    return buf[:, ::2]


# Same values, other strides. The first two have a head dim that is not unit-stride.
VIEWS = {
    "head_dim_strided": lambda t: t.transpose(-1, -2).contiguous().transpose(-1, -2),  # the view
    "reversed": lambda t: t.permute(*reversed(range(t.dim()))).contiguous().permute(*reversed(range(t.dim()))),
    "heads_first": lambda t: t.transpose(1, 2).contiguous().transpose(1, 2),          # (B, Z, S, d) storage
    "packed": _padded,
    "seq_strided": _seq_strided,
}
# q, k, v, dout each in a different view (dout with a strided head dim: the ring-backward case)
MIXED = ("packed", "heads_first", "reversed", "head_dim_strided")


def _leaf(t, view: str):
    x = VIEWS[view](t).detach()
    assert torch.equal(x, t)
    return x.requires_grad_()


def _strided_sweep(method: str, cfg: dict) -> list[dict]:
    """Per rank: every view of q, k, v and dout through ``method``; outputs and gradients."""
    rank, G = comm.world()
    q, k, v, do = make_inputs(B, cfg["seqlen"], cfg["heads"], cfg["kv_heads"], D, cfg["dtype"])
    local = [shard(t, cfg["layout"], rank, G) for t in (q, k, v, do)]
    assert all(t.stride(-1) == 1 for t in local)
    plans = [(name,) * 4 for name in VIEWS] + [MIXED]
    out = []
    for views in plans:
        ql, kl, vl = (_leaf(t, name) for t, name in zip(local[:3], views[:3]))
        dol = VIEWS[views[3]](local[3])
        if views[0] == "head_dim_strided":
            assert ql.stride(-1) != 1 and dol.stride(-1) != 1  # the case under test really is strided
        o = get(method).call(ql, kl, vl, causal=cfg["causal"], layout=cfg["layout"], **cfg["options"])
        o.backward(dol)
        out.append(dict(views=views, out=o.detach(), dq=ql.grad, dk=kl.grad, dv=vl.grad))
    return out


def strided_cases() -> list[tuple]:
    return [(m, g, {}) for m in sp_methods() for g in (1, 3)] + USP_SPLITS


@pytest.mark.parametrize("method,world_size,options", method_params(strided_cases()))
def test_any_strides_match_fp64_reference(pools, method, world_size, options):
    """Transposed, permuted, padded and strided views (head dim included) of q, k, v and dout give the
    reference output and gradients through every sequence-parallel method and both backward schemes
    (burst_qring: query side circulates; ring: key/value side; burst: auto, the ring scheme for GQA)."""
    z, zkv = heads_for(world_size)
    cfg = dict(seqlen=_seqlen(world_size), heads=z, kv_heads=zkv, dtype=torch.float32, causal=True,
               layout="zigzag", options=options)
    results = pools.run(world_size, _strided_sweep, method, cfg)
    ref = attention_reference(*make_inputs(B, cfg["seqlen"], z, zkv, D, torch.float64), True)
    tol = {n: FP32_RTOL * max(ref[n].abs().max().item(), 1.0) for n in ref}
    for rank, per_view in enumerate(results):
        for res in per_view:
            for name in ("out", "dq", "dk", "dv"):
                err = max_err(res[name], shard(ref[name], "zigzag", rank, world_size))
                assert err <= tol[name], f"{method} rank {rank} views {res['views']} {name}: {err:.3g}"


def _strided_layer(method: str, shape: AttnShape) -> list[dict]:
    """An attention layer fed contiguous, then strided, hidden states and output gradients."""
    g = torch.Generator().manual_seed(1)
    h = shape.heads * shape.head_dim
    x_full, dy_full = torch.randn(B, shape.seqlen, h, generator=g), torch.randn(B, shape.seqlen, h, generator=g)
    out = []
    for view in (None, "head_dim_strided", "reversed", "packed"):
        lay = make_layer(method, shape, group=None, seed=0)
        x = layer_input(lay, x_full)
        x = x.clone().requires_grad_() if view is None else _leaf(x, view)
        dy = layer_input(lay, dy_full)
        y = layer_forward(lay, x)
        y.backward(dy if view is None else VIEWS[view](dy))
        out.append(dict(y=y.detach(), dx=x.grad, **{f"grad_{n}": g for n, (_, g) in local_grads(lay).items()}))
    return out


def layer_methods() -> list[tuple]:
    """Every layer-level method (tensor parallelism) that takes the contiguous layout, from the registry,
    and, by name, two sequence-parallel layers: one ring (burst) and one all-to-all (ulysses) layer path;
    the sequence-parallel methods' strides are checked at the operator above."""
    return [(m,) for m in methods_with(level="layer", layout="contiguous")] + [("burst",), ("ulysses",)]


@pytest.mark.parametrize("method", method_params(layer_methods()))
def test_layers_take_strided_hidden_states(pools, method):
    """Attention layers (TP's too): strided views of the hidden states (B, N/G or N, H) give what
    contiguous ones give, output, input gradient and weight gradients (W=3); the contiguous layer
    is checked against the fp64 layer in test_baselines_layer.py."""
    G = 3
    shape = AttnShape(B, _seqlen(G), *heads_for(G), 8, G, dtype="float32", causal=True, layout="contiguous")
    for rank, (plain, *views) in enumerate(pools.run(G, _strided_layer, method, shape)):
        for res in views:
            for name, t in plain.items():
                assert max_err(res[name], t) <= FP32_RTOL * max(t.abs().max().item(), 1.0), (method, rank, name)


# ---------------------------------------------------------------- 2. fp64 end to end


def _fp64_case(method: str, cfg: dict) -> dict:
    rank, G = comm.world()
    q, k, v, do = make_inputs(B, cfg["seqlen"], cfg["heads"], cfg["kv_heads"], D, torch.float64)
    ql, kl, vl, dol = [shard(t, "zigzag", rank, G).requires_grad_(i < 3) for i, t in enumerate((q, k, v, do))]
    with comm.count_bytes() as counts:
        if method == "burst_lse":
            o, lse = burst_attn_func(ql, kl, vl, causal=True, layout="zigzag", backward=cfg["backward"],
                                     return_lse=True)
        else:
            o, lse = get(method).call(ql, kl, vl, causal=True, layout="zigzag", **cfg["options"]), None
        o.backward(dol)
    return dict(out=o.detach(), lse=lse, dq=ql.grad, dk=kl.grad, dv=vl.grad, counts=dict(counts),
                notes=dict(counts.notes))


# ring_rsa computes its (B, Z, N/G, N) scores in fp32 by design (baselines/ring_rsa.py), so fp64 inputs
# get fp32 accuracy there: the fp32 tolerance, with its reason, applies. About that method alone.
FP32_INSIDE = {"ring_rsa"}


def fp64_cases() -> list[tuple]:
    """The operator with its lse (both backward schemes), then every sequence-parallel method."""
    return [("burst_lse", g, b, {}) for b in ("burst", "ring") for g in (1, 3)] + \
        [(m, g, None, {}) for m in sp_methods() for g in (1, 3)] + [(m, g, None, o) for m, g, o in USP_SPLITS]


@pytest.mark.parametrize("method,world_size,backward,options", method_params(fp64_cases()))
def test_fp64_end_to_end(pools, method, world_size, backward, options):
    """fp64 inputs: forward and backward run (the backward used to fail on an fp32 lse) and match the
    reference to fp64 precision; lse and delta are fp64 and travel as 8 bytes per row and head."""
    from burst_impl import volume

    z, zkv = heads_for(world_size)
    cfg = dict(seqlen=_seqlen(world_size), heads=z, kv_heads=zkv, backward=backward, options=options)
    results = pools.run(world_size, _fp64_case, method, cfg)
    ref = attention_reference(*make_inputs(B, cfg["seqlen"], z, zkv, D, torch.float64), True)
    rtol = FP32_RTOL if method in FP32_INSIDE else FP64_RTOL
    for rank, res in enumerate(results):
        assert res["out"].dtype == res["dq"].dtype == res["dk"].dtype == torch.float64
        names = ["out", "dq", "dk", "dv"] + (["lse"] if res["lse"] is not None else [])
        for name in names:
            expect = shard(ref[name], "zigzag", rank, world_size, dim=2 if name == "lse" else 1)
            err, tol = max_err(res[name], expect), rtol * max(ref[name].abs().max().item(), 1.0)
            assert err <= tol, f"{method} rank {rank} {name}: {err:.3g} > {tol:.3g}"
        if res["lse"] is not None:
            assert res["lse"].dtype == torch.float64
            expect = volume.expected_bytes(AttnShape(B, cfg["seqlen"], z, zkv, D, world_size, dtype="float64"),
                                           backward=backward, grad_elem_size=8)
            assert res["counts"] == expect, f"rank {rank}: {res['counts']} != {expect}"


@pytest.mark.parametrize("backward,causal,view", [("burst", True, None), ("ring", False, "head_dim_strided")])
def test_gradcheck_world_size_one(backward, causal, view):
    """torch.autograd.gradcheck of burst_attn_func in fp64 (GQA, no process group)."""
    q, k, v, _ = make_inputs(1, 4, 2, 1, 4, torch.float64, seed=3)
    if view:
        q, k, v = (VIEWS[view](t) for t in (q, k, v))
    args = tuple(t.detach().requires_grad_() for t in (q, k, v))
    assert torch.autograd.gradcheck(
        lambda q, k, v: burst_attn_func(q, k, v, causal=causal, backward=backward), args, **GRADCHECK_TOL)


class _Replicated(torch.autograd.Function):
    """Identity forward; backward sums the gradient over ranks: the input is the same tensor on
    every rank (as gradcheck's perturbations are, since every rank runs it in lockstep)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous().clone()
        dist.all_reduce(g)
        return g


class _GatherSeq(torch.autograd.Function):
    """All ranks' output shards as the full sequence; backward keeps this rank's shard of the
    (identical on every rank) output gradient."""

    @staticmethod
    def forward(ctx, x, layout):
        rank, G = comm.world()
        parts = [torch.empty_like(x) for _ in range(G)]
        dist.all_gather(parts, x.contiguous())
        ctx.cfg = (layout, rank, G)
        return unshard(parts, layout)

    @staticmethod
    def backward(ctx, g):
        layout, rank, G = ctx.cfg
        return shard(g, layout, rank, G), None


def _gradcheck_ring(layout: str) -> list[bool]:
    rank, G = comm.world()
    q, k, v, _ = make_inputs(1, 2 * G, 2, 1, 2, torch.float64, seed=5)
    passed = []
    for backward in ("burst", "ring"):
        def full_attention(q, k, v):  # full tensors in, full output out, identical on every rank
            ql, kl, vl = (shard(_Replicated.apply(t), layout, rank, G) for t in (q, k, v))
            out = burst_attn_func(ql, kl, vl, causal=True, layout=layout, backward=backward)
            return _GatherSeq.apply(out, layout)

        args = tuple(t.detach().requires_grad_() for t in (q, k, v))
        torch.manual_seed(0)  # fast mode's random projections: the same on every rank
        passed.append(torch.autograd.gradcheck(full_attention, args, fast_mode=True, **GRADCHECK_TOL))
    return passed


def test_gradcheck_world_size_three(pools):
    """gradcheck of the distributed operator, both backward schemes: every rank perturbs the full
    inputs identically at the same time, so the numerical Jacobian is the global one. Fast mode
    (random projections of the Jacobian) keeps it to a few ring calls; W=1 runs the full check."""
    assert pools.run(3, _gradcheck_ring, "zigzag") == [[True, True]] * 3


# ---------------------------------------------------------------- 3. failure inside a ring


def _fail_inside_ring(scenarios: list[tuple[str, int]], **kw) -> list[str]:
    """For each (phase, call index): rank 1's kernel raises at that call (ring step = call index);
    every rank reports what it saw; then the group must still work: a collective and a fresh,
    correct burst_attn_func call on every rank. After a failed forward no rank runs the backward:
    the peers are not told of the failure, so deciding that is the caller's (the harness's) job.
    ``kw`` go to every burst_attn_func call (e.g. the double ring's topology and node_size)."""
    import burst_impl.attention as A

    rank, G = comm.world()
    q, k, v, do = make_inputs(1, 4 * G, 4, 2, 8, torch.float32)
    ref = attention_reference(q, k, v, do, False)
    local = [shard(t, "contiguous", rank, G) for t in (q, k, v, do)]
    seen = []
    for phase, fail_at in scenarios:
        kernel = "attn_forward" if phase == "forward" else "attn_backward"
        original, calls = getattr(A, kernel), [0]

        def failing(*args, _original=original, **kwargs):
            calls[0] += 1
            if rank == 1 and calls[0] - 1 == fail_at:
                raise RuntimeError(f"injected block failure ({phase}, call {fail_at})")
            return _original(*args, **kwargs)

        ql, kl, vl = (t.clone().requires_grad_() for t in local[:3])
        setattr(A, kernel, failing)
        try:
            out = burst_attn_func(ql, kl, vl, backward="ring" if phase == "ring_backward" else "burst", **kw)
            if phase != "forward":  # after a failed forward no rank runs the backward (the harness's job)
                out.backward(local[3])
            seen.append("completed")
        except RuntimeError as e:
            seen.append(str(e))
        finally:
            setattr(A, kernel, original)
        t = torch.ones(1)
        dist.all_reduce(t)
        assert t.item() == G, "the group is broken after a failure inside the ring"
        ql, kl, vl = (t.clone().requires_grad_() for t in local[:3])
        out = burst_attn_func(ql, kl, vl, backward="burst", **kw)
        out.backward(local[3])
        for name, got in (("out", out), ("dq", ql.grad), ("dk", kl.grad), ("dv", vl.grad)):
            tol = FP32_RTOL * max(ref[name].abs().max().item(), 1.0)
            assert max_err(got, shard(ref[name], "contiguous", rank, G)) <= tol, name
    return seen


def test_failure_inside_a_ring_leaves_the_group_usable(pools):
    """A block raising on one rank at any step of the forward, the burst backward or the ring
    backward: that rank raises its own error once the ring is done, its peers complete (they are not
    told), and the group keeps working. Without the fix the peers wait for a transfer that never
    comes (timeout or gloo abort)."""
    scenarios = [(phase, i) for phase in ("forward", "burst_backward", "ring_backward") for i in range(3)]
    seen = pools.run(3, _fail_inside_ring, scenarios, timeout=90)
    for rank in range(3):
        for (phase, i), what in zip(scenarios, seen[rank]):
            if rank == 1:
                assert what == f"injected block failure ({phase}, call {i})", what
            else:
                assert what == "completed", (rank, phase, i, what)


# ---------------------------------------------------------------- 3./5. bad input, before any byte

BAD = [
    # (description, kwargs, needle, the optional keyword under test: None = a call every method takes)
    ("integer q, k, v", dict(dtype=torch.int64), "q.dtype=torch.int64", None),
    ("k is None", dict(k=None), "k=NoneType", None),
    ("scale inf", dict(softmax_scale=math.inf), "softmax_scale=inf", None),
    ("scale nan", dict(softmax_scale=math.nan), "softmax_scale=nan", None),
    ("scale zero", dict(softmax_scale=0.0), "softmax_scale=0.0", None),
    ("scale str", dict(softmax_scale="0.1"), "softmax_scale='0.1'", None),
    ("flash_attn on CPU", dict(backend="flash_attn"), "backend='flash_attn'", None),
    ("cuda_sdpa on CPU", dict(backend="cuda_sdpa"), "backend='cuda_sdpa'", None),
    ("grad dtype int8", dict(grad_comm_dtype=torch.int8), "grad_comm_dtype=torch.int8", "grad_comm_dtype"),
    ("grad dtype str", dict(grad_comm_dtype="float32"), "grad_comm_dtype='float32'", "grad_comm_dtype"),
]


# ring_rsa's own fp32 dK, dV all-reduce takes grad_comm_dtype (it is not the operator): about that method, by name.
TAKES_GRAD_COMM_DTYPE = {"ring_rsa"}


def _not_taken(e: TypeError, keyword: str | None) -> bool:
    """Python's answer to a keyword a method does not take (ulysses and usp have no gradient accumulators
    travelling, so no ``grad_comm_dtype``); a method that takes it must answer a bad value with a ValueError."""
    return keyword is not None and f"unexpected keyword argument '{keyword}'" in str(e)


def _bad_calls() -> list[str]:
    rank, G = comm.world()
    z, zkv = heads_for(G)
    q, k, v, do = make_inputs(1, 2 * G, z, zkv, 8, torch.float32)
    q, k, v, do = (shard(t, "contiguous", rank, G) for t in (q, k, v, do))
    outsider = None
    if G > 1:  # a group without the last rank; new_group is collective, so every rank creates it
        outsider = dist.new_group(list(range(G - 1)))
    msgs = []
    with comm.count_bytes() as counts:
        for method in sp_methods("contiguous"):
            cases = list(BAD)
            if G > 1 and rank == G - 1:
                cases.append(("not a member", dict(group=outsider), "is not a member", None))
            for what, kw, needle, keyword in cases:
                kw = dict(kw)
                dtype = kw.pop("dtype", None)
                args = [t.to(dtype) if dtype else t for t in (q, k, v)]
                if "k" in kw:
                    args[1] = kw.pop("k")
                try:
                    get(method).call(*args, causal=True, **kw)
                except ValueError as e:
                    assert needle in str(e), f"{method}, {what}: {needle!r} not in {e}"
                    msgs.append(f"{method}: {e}")
                except TypeError as e:
                    if not _not_taken(e, keyword):
                        raise
                    msgs.append(f"{method}: does not take {keyword}")
                else:
                    raise AssertionError(f"{method}, {what}: no ValueError")
    assert counts.total() == 0, f"bytes sent before the ValueError: {dict(counts)}"
    t = torch.ones(1)
    if G > 1:
        dist.all_reduce(t)
    assert t.item() == G
    qg = q.clone().requires_grad_()
    burst_attn_func(qg, k, v, causal=True).backward(do)  # and the operator still runs
    return msgs


@pytest.mark.parametrize("world_size", [1, 3])
def test_bad_input_is_a_value_error_before_any_byte(pools, world_size):
    """Integer tensors, k=None, a non-finite, zero or non-numeric scale, a CUDA backend on CPU
    tensors, a non-float grad_comm_dtype, a group this rank is not in: a ValueError naming the
    parameter and the rule, from every method, with nothing sent and the group usable after. A method
    bound to the BurstAttention operator (``operator_backward``) takes the operator's keywords, so it must
    validate grad_comm_dtype rather than not take it (and so must ring_rsa)."""
    msgs = pools.run(world_size, _bad_calls)
    methods = sp_methods("contiguous")
    n_bad = len(methods) * len(BAD)
    assert [len(m) for m in msgs] == [n_bad] * (world_size - 1) + [n_bad + (len(methods) if world_size > 1 else 0)]
    takes = {m for m in methods if get(m).operator_backward is not None} | TAKES_GRAD_COMM_DTYPE
    assert not [m for m in msgs[0] if m.split(":")[0] in takes and "does not take" in m], msgs[0]


def test_bad_input_without_process_group():
    assert not dist.is_initialized()
    q = torch.randn(1, 4, 2, 8)
    with pytest.raises(ValueError, match="softmax_scale=inf must be a finite positive number"):
        burst_attn_func(q, q, q, softmax_scale=math.inf)
    with pytest.raises(ValueError, match=r"q.dtype=torch.int32 must be a floating dtype: one of float16"):
        burst_attn_func(q.int(), q.int(), q.int())
    with pytest.raises(ValueError, match="backend='flash_attn' runs on cuda tensors"):
        burst_attn_func(q, q, q, backend="flash_attn")
    with pytest.raises(ValueError, match="backend='cuda_sdpa' runs on cuda tensors"):
        get("ulysses").call(q, q, q, backend="cuda_sdpa")


def test_backend_rules():
    from burst_impl.kernels import check_backend, resolve_backend

    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match="does not take dtype torch.float64"):
        check_backend("cuda_sdpa", torch.device("cuda"), torch.float64)
    with pytest.raises(ValueError, match="does not take dtype torch.float32"):
        check_backend("flash_attn", torch.device("cuda"), torch.float32)
    assert resolve_backend(torch.device("cuda"), None, torch.float64, 64) == "reference"  # no fp64 CUDA kernel
    assert resolve_backend(cpu, None, torch.float64, 64) == "cpu_flash"
    check_backend("reference", cpu, torch.float16)


# ---------------------------------------------------------------- 4. nested count_bytes


def test_nested_counters_are_told_apart_by_identity():
    """An outer counter per step around one inner counter per phase: the inner counters are opened
    while equal to the outer one (all empty, or all holding the same bytes)."""
    with comm.count_bytes() as step:
        with comm.count_bytes() as fwd:
            comm.record("forward", "k", 10)
        with comm.count_bytes() as bwd:
            comm.record("backward", "q", 5)
    comm.record("forward", "k", 1000)  # nothing is open: nobody counts
    assert fwd == {("forward", "k"): 10} and bwd == {("backward", "q"): 5}
    assert step == {("forward", "k"): 10, ("backward", "q"): 5}
    assert not comm._active


def _nested_phases() -> dict:
    from burst_impl import volume

    rank, G = comm.world()
    q, k, v, do = make_inputs(1, 4 * G, 4, 4, 8)
    q, k, v, do = (shard(t, "contiguous", rank, G) for t in (q, k, v, do))
    q.requires_grad_()
    with comm.count_bytes() as step:
        with comm.count_bytes() as fwd:
            out = burst_attn_func(q, k, v, causal=True, backward="burst")
        with comm.count_bytes() as bwd:
            out.backward(do)
    burst_attn_func(q, k, v)  # after every counter closed: counted by none
    expect = volume.expected_bytes(AttnShape(1, 4 * G, 4, 4, 8, G, dtype="float32"), backward="burst")
    assert dict(step) == expect
    assert dict(fwd) == {key: b for key, b in expect.items() if key[0] == "forward"}
    assert dict(bwd) == {key: b for key, b in expect.items() if key[0] == "backward"}
    assert not comm._active
    return dict(step)


@pytest.mark.parametrize("world_size", [1, 3])
def test_nested_counters_on_every_rank(pools, world_size):
    pools.run(world_size, _nested_phases)


# ---------------------------------------------------------------- 6. uneven shards


def _uneven(lengths: list[int]) -> list[str]:
    """Rank r holds ``lengths[r]`` tokens, a split the layout does not make (N=10 over 3 contiguous ranks is
    4/3/3 since issue 22; 3/4/3 is no layout's split), with the check on (the default)."""
    rank, G = comm.world()
    q, k, v, _ = make_inputs(1, sum(lengths), 6, 3, 8)
    lo = sum(lengths[:rank])
    q, k, v = (t[:, lo:lo + lengths[rank]] for t in (q, k, v))
    msgs = []
    with comm.check_shapes(True), comm.count_bytes() as counts:
        for method in sp_methods("contiguous"):
            try:
                get(method).call(q, k, v, causal=True)
            except ValueError as e:
                msgs.append(str(e))
            else:
                raise AssertionError(f"{method}: no ValueError for shards of lengths {lengths}")
        # bad input on one rank only (here the last) is a ValueError on every rank, not a hang
        even = [t[:, :3] for t in (q, k, v)]
        try:
            burst_attn_func(*even, softmax_scale=-1.0 if rank == G - 1 else None)
        except ValueError as e:
            msgs.append(str(e))
    assert counts.total() == 0
    assert comm.shape_check_enabled()   # on by default since issue 22
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == G
    return msgs


def test_uneven_shards_raise_on_every_rank_with_the_shape_check(pools):
    for rank, msgs in enumerate(pools.run(3, _uneven, [3, 4, 3])):
        assert len(msgs) == len(sp_methods("contiguous")) + 1
        for m in msgs[:-1]:
            assert "the ranks hold (3, 4, 3) tokens" in m and "as (4, 3, 3)" in m, m
        needle = "softmax_scale=-1.0" if rank == 2 else "inputs rejected on rank(s) [2]"
        assert needle in msgs[-1], msgs[-1]


def _checked_call_counts() -> dict:
    rank, G = comm.world()
    q, k, v, do = make_inputs(1, 4 * G, 4, 4, 8)
    q, k, v, do = (shard(t, "zigzag", rank, G) for t in (q, k, v, do))
    q.requires_grad_()
    with comm.check_shapes(True):
        with comm.count_bytes() as counts:
            burst_attn_func(q, k, v, causal=True, layout="zigzag", backward="burst").backward(do)
    return dict(counts)


@pytest.mark.parametrize("world_size", [1, 3])
def test_shape_check_sends_nothing_counted_and_passes_even_shards(pools, world_size):
    from burst_impl import volume

    expect = volume.expected_bytes(AttnShape(1, 4 * world_size, 4, 4, 8, world_size, dtype="float32"),
                                   backward="burst")
    assert pools.run(world_size, _checked_call_counts) == [expect] * world_size


def test_shape_check_switch():
    assert comm.shape_check_enabled()   # on by default since issue 22; check_shapes(False) is the opt-out
    with comm.check_shapes(False):
        assert not comm.shape_check_enabled()
        q = torch.randn(1, 4, 2, 8)
        burst_attn_func(q, q, q)  # world size 1: nothing to compare, no collective
    assert comm.shape_check_enabled()
    comm.check_shapes(False)
    try:
        assert not comm.shape_check_enabled()
    finally:
        comm.check_shapes(True)


# ---------------------------------------------------------------- 7. a worker killed mid-sweep


@pytest.mark.slow
def test_a_killed_worker_is_recorded_and_the_sweep_goes_on(tmp_path, monkeypatch):
    """Rank 1 is SIGKILLed at the start of the second case. Rank 0 then fails in gloo with a message
    that holds "[/__w/pytorch/.../pair.cc:...]", which rich used to read as a closing markup tag and
    crash the driver on. Now: the case is recorded as failed with that text and the killed rank's name, the
    other three cases run (the executor's relaunch; through a SLURM job: tests/test_executor.py), and the
    figures are drawn."""
    from experiments.harness import results as R
    from experiments.run import main as run_main

    spec = {"name": "t_kill", "methods": ["burst", "ring"], "baseline": "ring",
            "sweep": {"seqlen": [32, 64], "world_size": 2, "heads": 2, "head_dim": 8, "layout": "zigzag"},
            "measure": {"modes": ["fwd_bwd"], "level": "op"}, "warmup": 0, "repeats": 1, "seed": 1,
            "cluster": "cpu", "timeouts": {"case_s": 60, "pg_s": 20}}
    path = tmp_path / "t_kill.yaml"
    path.write_text(yaml.safe_dump(spec))
    monkeypatch.setenv("EXPERIMENTS_INJECT_FAULT", "ring.op.fwd_bwd.N32.:kill:1")
    assert run_main([str(path), "--results", str(tmp_path / "results"), "--plots", str(tmp_path / "plots")]) == 0
    recs = R.latest_by_case(R.read_records(tmp_path / "results" / "t_kill" / "results.jsonl"))
    status = {cid.split(".G")[0]: r["status"] for cid, r in recs.items()}
    assert status == {"burst.op.fwd_bwd.N32": "ok", "ring.op.fwd_bwd.N32": "failed",
                      "burst.op.fwd_bwd.N64": "ok", "ring.op.fwd_bwd.N64": "ok"}, status
    reason = next(r["reason"] for r in recs.values() if r["status"] == "failed")
    assert "[/" in reason, reason  # text rich would read as markup (gloo: "[/__w/pytorch/...]")
    # the killed rank is named (torchrun may have stopped the other before it saw the loss: then both)
    who = reason.split(" ended while running this case")[0]
    assert who == "rank 1" or (who.startswith("ranks ") and "1" in who), who
    figures = {p.name for p in (tmp_path / "plots" / "t_kill").glob("*.png")}
    assert {"speedup_vs_seqlen.png", "comm_volume.png"} <= figures, figures
