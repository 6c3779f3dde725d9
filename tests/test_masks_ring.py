"""Every mask through every sequence-parallel method against the fp64 reference, on real gloo process groups.

The methods are the registry's (``mask_methods``: level op, takes ``mask=``, no timing variant
or peer adapter), each with every layout of ``LAYOUTS`` it accepts, so a new method is covered
without an edit. One pool call per world size runs the whole cross product of that world size
(masks x methods x layouts x MHA/GQA) at tiny sizes, so the suite pays for process start-up
and plan building once. Each case: out, lse (methods bound to the BurstAttention operator,
``operator_backward``, which returns it), dq, dk, dv of every rank against the shard of the fp64
reference, which applies nothing but the mask's dense definition (``Mask.allowed``) over the
N x N positions; counted bytes against the method's formula (masks do not change what travels);
skipped pairs noted. A method that cannot run here (``available()``) is left out of the batch;
its own tests (tests/test_cuda_path.py, the peers') run it where it can.
"""
from __future__ import annotations

import itertools
from functools import lru_cache

import pytest
import torch
import torch.distributed as dist

from baselines import AttnShape, get
from baselines.registry import methods_with
from burst_impl import burst_attn_func, comm, masks, volume
from burst_impl.balance import resolve_layout
from burst_impl.layout import BALANCED, is_balanced_name, shard
from burst_impl.plan import step_plan
from tests.refs import attention_reference, make_inputs, max_err

B, D = 1, 8
# fp32 against fp64: as tests/test_burst_attention.py (softmax-weighted sums over at most
# N = 96 keys in fp32, eps 1.2e-7, one merge per tile: worst case ~N*eps ~ 1e-5); 2e-5 of the
# largest reference value, and 1000x below a wrong mask (which moves values at the 1e-1 level).
FP32_RTOL = 2e-5
LAYOUTS = ("contiguous", "zigzag", "striped", "balanced:2")
# ring_rsa builds its own dense mask from global positions, so two layouts suffice for it (contiguous and
# striped, the most scattered positions); about that method alone, so kept by name.
FEWER_LAYOUTS = {"ring_rsa": ("contiguous", "striped")}


def mask_methods() -> tuple[str, ...]:
    """Every sequence-parallel method we implement that takes masks and runs here, from the registry
    (timing variants: their method's numerics; peer adapters: tests/test_baselines_peers.py)."""
    return methods_with(level="op", masks=True, variants=False, adapters=False, available=True)


def method_layouts(method: str) -> tuple[str, ...]:
    """The layouts of ``LAYOUTS`` that ``method`` accepts (the registry's ``layouts``; usp cannot form striped)."""
    accepted = get(method).layouts
    return tuple(lay for lay in FEWER_LAYOUTS.get(method, LAYOUTS)
                 if (BALANCED if is_balanced_name(lay) else lay) in accepted)


def seqlen(world: int) -> int:
    return 24 * world            # zigzag/balanced:2 chunks of 12 tokens; block size 4 divides them


def mask_cases(n: int) -> dict[str, tuple[bool, object]]:
    """name -> (causal, mask): the issue's edge cases at N = n."""
    empty_rows = masks.random_block_mask(n // 4, 0.3, seed=5)
    empty_rows[2] = False                                    # block row 2 (diagonal too): fully masked rows
    return {
        "causal": (True, None),
        "window_lt_chunk": (True, "window:3:0"),             # causal window smaller than one rank's chunk
        "window_bidir": (False, "window:5:7"),
        "docs_edge": (True, masks.Documents((0, 1, 2, 5, 6, n - 1, n))),   # length-1 docs; one spans all ranks
        "docs_seeded": (True, "docs:9:1"),
        "docs_full": (False, "docs:9:1"),                    # varlen-full: whole documents, nothing across
        "bsparse_empty_rows": (True, masks.BlockSparse(4, empty_rows)),
        "bsparse_bidir": (False, "bsparse:4:0.3:2"),
    }


def heads(world: int, kind: str) -> tuple[int, int]:
    z = 6 if world == 3 else 4
    return (z, z) if kind == "mha" else (z, z // 2)


def _options(method: str, world: int) -> dict | None:
    """A double ring (``topology='double'``) runs as one at W = 4, 2 nodes x 2 ranks; below that it would be
    its flat fallback, the code of the flat methods already in the batch, so it is left out there (None)."""
    if get(method).options.get("topology") != "double":
        return {}
    return {"node_size": 2} if world == 4 else None


def cases(world: int) -> list[dict]:
    """masks x methods x their layouts; MHA and GQA alternate over (mask, layout) so every (mask, method)
    sees both. At W = 1 every layout is the identity: contiguous only there."""
    out = []
    for (m, (name, (causal, mask))), method, (l, layout) in itertools.product(
            enumerate(mask_cases(seqlen(world)).items()), mask_methods(), enumerate(LAYOUTS)):
        if layout not in method_layouts(method) or world == 1 and layout != "contiguous":
            continue
        options = _options(method, world)
        if options is None:
            continue
        hk = ("mha", "gqa")[(m + l) % 2]
        out.append(dict(name=name, causal=causal, mask=mask, method=method, layout=layout, heads=heads(world, hk),
                        options=options))
    return out


def _layout(layout: str, causal: bool, mask, world: int):
    """The layout as the operator resolves it for this mask at N = seqlen(world) (balanced:* needs the mask)."""
    n = seqlen(world)
    return resolve_layout(layout, masks.resolve(causal, mask, n), n, world)


def _local_inputs(heads: tuple[int, int], layout: str, causal: bool, mask) -> list:
    """This rank's shards of the seeded fp32 q, k, v, dout; q, k, v require grad."""
    rank, G = dist.get_rank(), dist.get_world_size()
    q, k, v, do = make_inputs(B, seqlen(G), *heads, D, torch.float32, seed=7)
    lay = _layout(layout, causal, mask, G)
    return [shard(t, lay, rank, G).requires_grad_(i < 3) for i, t in enumerate((q, k, v, do))]


def _run_cases(batch: list[dict]) -> list[dict]:
    results = []
    for cfg in batch:
        ql, kl, vl, dol = _local_inputs(cfg["heads"], cfg["layout"], cfg["causal"], cfg["mask"])
        lse = None
        method = get(cfg["method"])
        with comm.count_bytes() as counts:
            if method.operator_backward is not None:   # the operator itself, with the backward it binds: its lse too
                out, lse = burst_attn_func(ql, kl, vl, causal=cfg["causal"], mask=cfg["mask"], layout=cfg["layout"],
                                           **{**method.options, "backward": method.operator_backward},
                                           **cfg["options"], return_lse=True)
                lse = lse.detach()
            else:
                out = get(cfg["method"]).call(ql, kl, vl, causal=cfg["causal"], mask=cfg["mask"],
                                              layout=cfg["layout"], **cfg["options"])
            out.backward(dol)
        results.append(dict(out=out.detach(), lse=lse, dq=ql.grad, dk=kl.grad, dv=vl.grad, counts=dict(counts),
                            notes=dict(counts.notes)))
    return results


@lru_cache(maxsize=None)
def _reference(world: int, name: str, z: int, zkv: int) -> dict:
    n = seqlen(world)
    causal, mask = mask_cases(n)[name]
    inputs = make_inputs(B, n, z, zkv, D, torch.float64, seed=7)
    return attention_reference(*inputs, causal, mask=mask)


def _bytes_formula(cfg: dict, world: int) -> dict:
    z, zkv = cfg["heads"]
    s = AttnShape(B, seqlen(world), z, zkv, D, world, dtype="float32", causal=cfg["causal"])
    return get(cfg["method"]).bytes(s)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_every_mask_every_method_every_layout(pools, world):
    batch = cases(world)
    per_rank = pools.run(world, _run_cases, batch, timeout=900)
    n = seqlen(world)
    failures = []
    for i, cfg in enumerate(batch):
        z, zkv = cfg["heads"]
        ref = _reference(world, cfg["name"], z, zkv)
        causal, mask = mask_cases(n)[cfg["name"]]
        lay = _layout(cfg["layout"], causal, mask, world)
        tol = {k: FP32_RTOL * max(ref[k][torch.isfinite(ref[k])].abs().max().item(), 1.0) for k in ref}
        want_bytes = _bytes_formula(cfg, world)
        for rank in range(world):
            res = per_rank[rank][i]
            for key in ("out", "lse", "dq", "dk", "dv"):
                if res[key] is None:
                    continue
                got = res[key]
                assert not torch.isnan(got).any(), (cfg, rank, key)
                err = max_err(got, shard(ref[key], lay, rank, world, dim=2 if key == "lse" else 1))
                if err > tol[key]:
                    failures.append(f"{cfg['name']}/{cfg['method']}/{cfg['layout']}/{cfg['heads']} rank {rank} "
                                    f"{key}: {err:.3g} > {tol[key]:.3g}")
            if res["counts"] != want_bytes:
                failures.append(f"{cfg['name']}/{cfg['method']}/{cfg['layout']} rank {rank}: bytes {res['counts']} "
                                f"!= formula {want_bytes}")
            if get(cfg["method"]).operator_backward is not None:
                # every fully masked pair is skipped and counted (its block travelled anyway: bytes above);
                # the query-side backward ("burst") skips the pairs of the blocks it visits
                the_mask = masks.resolve(causal, mask, n)
                empty = sum(step_plan(the_mask, lay, rank, b, n, world).empty for b in range(world))
                empty_bwd = sum(step_plan(the_mask, lay, a, rank, n, world).empty for a in range(world))
                assert res["notes"]["burst.skipped_blocks.forward"] == empty
                assert res["notes"]["burst.skipped_blocks.backward"] == (
                    empty_bwd if res["notes"]["burst.backward"] == "burst" else empty), (cfg["method"], res["notes"])
    assert not failures, "\n".join(failures[:20]) + f"\n({len(failures)} failures of {len(batch)} cases)"


def test_fully_masked_rows_give_zeros_not_nan():
    """Single process: rows with no live key give out 0, lse -inf, zero dq (and finite dk, dv)."""
    n = 32
    blocks = masks.random_block_mask(n // 4, 0.5, seed=1)
    blocks[1] = False
    m = masks.BlockSparse(4, blocks, causal=True)
    q, k, v, do = (t.requires_grad_(i < 3) for i, t in enumerate(make_inputs(1, n, 4, 2, D)))
    out, lse = burst_attn_func(q, k, v, mask=m, return_lse=True)
    out.backward(do)
    dead = slice(4, 8)
    assert (out[:, dead] == 0).all() and torch.isneginf(lse[:, :, dead]).all()
    assert (q.grad[:, dead] == 0).all()
    for t in (out, q.grad, k.grad, v.grad):
        assert torch.isfinite(t).all()
    ref = attention_reference(*(t.detach().double() for t in (q, k, v, do)), False, mask=m)
    assert max_err(out, ref["out"]) < 1e-5 and max_err(q.grad, ref["dq"]) < 1e-5


# ---------------------------------------------------------------- the double ring (burst_impl.topology)
# About the operator's double-ring topology itself (every method on it is in the cross product above):
# its two backward schemes are named here.

# (nodes E, ranks per node I): the smallest double ring, and one with an odd intra-node ring
DOUBLE_GRIDS = [(2, 2), (2, 3)]
# per backward, two layouts: every layout meets every mask once over the two backwards
DOUBLE_LAYOUTS = {"burst": ("zigzag", "balanced:2"), "ring": ("contiguous", "striped")}


def double_cases(world: int) -> list[dict]:
    out = []
    for m, (name, (causal, mask)) in enumerate(mask_cases(seqlen(world)).items()):
        for backward, layouts in DOUBLE_LAYOUTS.items():
            for l, layout in enumerate(layouts):
                hk = ("mha", "gqa")[(m + l) % 2]
                out.append(dict(name=name, causal=causal, mask=mask, backward=backward, layout=layout,
                                heads=heads(world, hk)))
    return out


def _run_double(batch: list[dict], node_size: int) -> list[dict]:
    results = []
    for cfg in batch:
        ql, kl, vl, dol = _local_inputs(cfg["heads"], cfg["layout"], cfg["causal"], cfg["mask"])
        with comm.count_bytes() as counts:
            out, lse = burst_attn_func(ql, kl, vl, causal=cfg["causal"], mask=cfg["mask"], layout=cfg["layout"],
                                       backward=cfg["backward"], topology="double", node_size=node_size,
                                       return_lse=True)
            out.backward(dol)
        results.append(dict(out=out.detach(), lse=lse.detach(), dq=ql.grad, dk=kl.grad, dv=vl.grad,
                            counts=dict(counts), links=counts.link_dict(), notes=dict(counts.notes)))
    return results


@pytest.mark.parametrize("grid", DOUBLE_GRIDS, ids=lambda g: f"{g[0]}x{g[1]}")
def test_every_mask_on_the_double_ring(pools, grid):
    """burst_double_ring (intra-node rings, the next round's block crossing nodes meanwhile) with every
    mask: out, lse, dq, dk, dv of every rank against the fp64 reference; bytes per (phase, kind) and per
    link class as without a mask (a fully masked block still travels); skipped pairs as the plans say."""
    E, I = grid
    world = E * I
    n = seqlen(world)
    batch = double_cases(world)
    per_rank = pools.run(world, _run_double, batch, I, timeout=600)
    failures = []
    for i, cfg in enumerate(batch):
        z, zkv = cfg["heads"]
        ref = _reference(world, cfg["name"], z, zkv)
        the_mask = masks.resolve(cfg["causal"], cfg["mask"], n)
        lay = _layout(cfg["layout"], cfg["causal"], cfg["mask"], world)
        tol = {k: FP32_RTOL * max(ref[k][torch.isfinite(ref[k])].abs().max().item(), 1.0) for k in ref}
        s = AttnShape(B, n, z, zkv, D, world, dtype="float32", causal=cfg["causal"])
        for rank in range(world):
            res = per_rank[rank][i]
            what = f"{cfg['name']}/{cfg['backward']}/{cfg['layout']}/{cfg['heads']} rank {rank}"
            assert res["notes"]["burst.topology"].startswith("double ring"), (what, res["notes"])
            for key in ("out", "lse", "dq", "dk", "dv"):
                assert not torch.isnan(res[key]).any(), (what, key)
                err = max_err(res[key], shard(ref[key], lay, rank, world, dim=2 if key == "lse" else 1))
                if err > tol[key]:
                    failures.append(f"{what} {key}: {err:.3g} > {tol[key]:.3g}")
            want = volume.expected_bytes(s, cfg["backward"])
            links = volume.expected_link_bytes(s, cfg["backward"], topology="double", node_size=I, rank=rank)
            if res["counts"] != want or res["links"] != links:
                failures.append(f"{what}: bytes {res['counts']} / {res['links']} != formula {want} / {links}")
            empty = sum(step_plan(the_mask, lay, rank, b, n, world).empty for b in range(world))
            empty_bwd = sum(step_plan(the_mask, lay, a, rank, n, world).empty for a in range(world))
            assert res["notes"]["burst.skipped_blocks.forward"] == empty, what
            assert res["notes"]["burst.skipped_blocks.backward"] == (empty_bwd if cfg["backward"] == "burst"
                                                                     else empty), what
    assert not failures, "\n".join(failures[:20]) + f"\n({len(failures)} failures of {len(batch)} cases)"


USP_DOUBLE_MASKS = ("window_lt_chunk", "docs_edge", "bsparse_empty_rows")


def _run_usp_double(names: tuple[str, ...]) -> list[dict]:
    """World 8 as 2 nodes x 4 ranks, usp with u = 2: its ring (4 ranks, 2 per node) is a double ring."""
    n = seqlen(dist.get_world_size())
    results = []
    for name, layout in itertools.product(names, ("zigzag", "balanced:2")):
        causal, mask = mask_cases(n)[name]
        ql, kl, vl, dol = _local_inputs((4, 2), layout, causal, mask)
        with comm.count_bytes() as counts:
            out = get("usp").call(ql, kl, vl, causal=causal, mask=mask, layout=layout, ulysses_degree=2,
                                  node_size=4)
            out.backward(dol)
        results.append(dict(name=name, layout=layout, out=out.detach(), dq=ql.grad, dk=kl.grad, dv=vl.grad,
                            notes=dict(counts.notes)))
    return results


@pytest.mark.slow
def test_masks_through_usp_with_a_double_ring_inside(pools):
    """usp at 2 nodes x 4 ranks, u = 2: a window smaller than a chunk, documents with length-1 docs and
    one spanning all ranks, block-sparse with fully masked rows; zigzag and the balanced layout (the
    ring level gets the union of each Ulysses group's chunks). out, dq, dk, dv against fp64."""
    world = 8
    n = seqlen(world)
    per_rank = pools.run(world, _run_usp_double, USP_DOUBLE_MASKS, timeout=600)
    failures = []
    for i, res0 in enumerate(per_rank[0]):
        ref = _reference(world, res0["name"], 4, 2)
        causal, mask = mask_cases(n)[res0["name"]]
        lay = _layout(res0["layout"], causal, mask, world)
        assert res0["notes"]["burst.topology"].startswith("double ring over 2 nodes x 2 ranks"), res0["notes"]
        for rank in range(world):
            res = per_rank[rank][i]
            for key in ("out", "dq", "dk", "dv"):
                tol = FP32_RTOL * max(ref[key].abs().max().item(), 1.0)
                err = max_err(res[key], shard(ref[key], lay, rank, world))
                if not err <= tol:
                    failures.append(f"{res['name']}/{res['layout']} rank {rank} {key}: {err:.3g} > {tol:.3g}")
    assert not failures, "\n".join(failures[:20])
