"""Every mask through every ring method against the fp64 reference, on real gloo process groups.

One pool call per world size runs the whole cross product of that world size
(masks x methods x layouts x MHA/GQA) at tiny sizes, so the suite pays for
process start-up and plan building once. Each case: out, lse (burst and ring,
which return it), dq, dk, dv of every rank against the shard of the fp64
reference, which applies nothing but the mask's dense definition
(``Mask.allowed``) over the N x N positions; counted bytes against the
method's formula (masks do not change what travels); skipped pairs noted.
"""
from __future__ import annotations

import itertools
from functools import lru_cache

import pytest
import torch
import torch.distributed as dist

from baselines import AttnShape, get
from burst_impl import burst_attn_func, comm, masks
from burst_impl.balance import resolve_layout
from burst_impl.layout import shard
from burst_impl.plan import step_plan
from tests.refs import attention_reference, make_inputs, max_err

B, D = 1, 8
# fp32 against fp64: as tests/test_burst_attention.py (softmax-weighted sums over at most
# N = 96 keys in fp32, eps 1.2e-7, one merge per tile: worst case ~N*eps ~ 1e-5); 2e-5 of the
# largest reference value, and 1000x below a wrong mask (which moves values at the 1e-1 level).
FP32_RTOL = 2e-5
METHODS = ("burst", "ring", "usp", "ulysses", "ring_rsa")
LAYOUTS = ("contiguous", "zigzag", "striped", "balanced:2")


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
        "bsparse_empty_rows": (True, masks.BlockSparse(4, empty_rows)),
        "bsparse_bidir": (False, "bsparse:4:0.3:2"),
    }


def heads(world: int, kind: str) -> tuple[int, int]:
    z = 6 if world == 3 else 4
    return (z, z) if kind == "mha" else (z, z // 2)


def cases(world: int) -> list[dict]:
    """masks x methods x layouts; MHA and GQA alternate over (mask, layout) so every (mask, method)
    sees both. ring_rsa builds its own dense mask from global positions, so two layouts suffice for
    it (contiguous and striped, the most scattered positions)."""
    out = []
    for (m, (name, (causal, mask))), method, (l, layout) in itertools.product(
            enumerate(mask_cases(seqlen(world)).items()), METHODS, enumerate(LAYOUTS)):
        if method == "usp" and layout == "striped":
            continue                                         # USP's 2-D split cannot form striped (registry)
        if method == "ring_rsa" and layout not in ("contiguous", "striped"):
            continue
        hk = ("mha", "gqa")[(m + l) % 2]
        out.append(dict(name=name, causal=causal, mask=mask, method=method, layout=layout, heads=heads(world, hk)))
    return out


def _run_cases(batch: list[dict]) -> list[dict]:
    rank, G = dist.get_rank(), dist.get_world_size()
    n = seqlen(G)
    results = []
    for cfg in batch:
        z, zkv = cfg["heads"]
        q, k, v, do = make_inputs(B, n, z, zkv, D, torch.float32, seed=7)
        lay = resolve_layout(cfg["layout"], masks.resolve(cfg["causal"], cfg["mask"], n), n, G)
        ql, kl, vl, dol = [shard(t, lay, rank, G).requires_grad_(i < 3) for i, t in enumerate((q, k, v, do))]
        lse = None
        with comm.count_bytes() as counts:
            if cfg["method"] in ("burst", "ring"):   # ring = the same operator with the K/V backward
                out, lse = burst_attn_func(ql, kl, vl, causal=cfg["causal"], mask=cfg["mask"], layout=cfg["layout"],
                                           backward="burst" if cfg["method"] == "burst" else "ring",
                                           return_lse=True)
                lse = lse.detach()
            else:
                out = get(cfg["method"]).call(ql, kl, vl, causal=cfg["causal"], mask=cfg["mask"],
                                              layout=cfg["layout"])
            out.backward(dol)
        results.append(dict(out=out.detach(), lse=lse, dq=ql.grad, dk=kl.grad, dv=vl.grad, counts=dict(counts),
                            notes=dict(counts.notes)))
    return results


@lru_cache(maxsize=None)
def _reference(world: int, name: str, z: int, zkv: int) -> dict:
    n = seqlen(world)
    causal, mask = mask_cases(n)[name]
    inputs = make_inputs(B, n, z, zkv, D, torch.float64, seed=7)
    return attention_reference(*inputs, causal, mask=mask if mask is not None else None)


def _bytes_formula(cfg: dict, world: int, backward: str | None) -> dict:
    z, zkv = cfg["heads"]
    s = AttnShape(B, seqlen(world), z, zkv, D, world, dtype="float32", causal=cfg["causal"])
    if cfg["method"] == "burst":
        return get("burst_qring").bytes(s)
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
        lay = resolve_layout(cfg["layout"], masks.resolve(causal, mask, n), n, world)
        tol = {k: FP32_RTOL * max(ref[k][torch.isfinite(ref[k])].abs().max().item(), 1.0) for k in ref}
        want_bytes = _bytes_formula(cfg, world, None)
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
            if cfg["method"] in ("burst", "ring"):
                # every fully masked pair is skipped and counted (its block travelled anyway: bytes above)
                the_mask = masks.resolve(causal, mask, n)
                empty = sum(step_plan(the_mask, lay, rank, b, n, world).empty for b in range(world))
                empty_bwd = sum(step_plan(the_mask, lay, a, rank, n, world).empty for a in range(world))
                assert res["notes"]["burst.skipped_blocks.forward"] == empty
                assert res["notes"]["burst.skipped_blocks.backward"] == (empty_bwd if cfg["method"] == "burst"
                                                                         else empty)
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
