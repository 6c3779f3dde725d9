"""The double ring (burst_impl.topology) against the fp64 reference, bytes per link class, bad input.

Nodes are emulated with ``node_size=`` on the pool's gloo groups: world 4 =
2 nodes x 2 ranks, world 6 = 2 x 3 (odd inner ring) and 3 x 2. Every case
of one world size runs inside one pool call (a list of configurations), so
the suite pays the pool round trip once per grid.
"""
from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist

from burst_impl import burst_attn_func, comm, volume
from burst_impl.layout import shard
from burst_impl.nodes import Nodes
from burst_impl.shape import AttnShape
from burst_impl.topology import DoubleRing, transport
from tests.refs import attention_reference, make_inputs, max_err

B, D, CHUNK = 2, 8, 3       # 3 tokens per layout chunk (odd); zigzag has 2G chunks: N = 2*G*CHUNK
HEADS = {"mha": (4, 4), "gqa": (4, 2)}
# fp32 against fp64, relative to the largest reference value: as tests/test_burst_attention.py
# (N <= 36 keys here, one merge per ring step; worst case ~N*eps = 4e-6, a real mistake ~1e-1).
FP32_RTOL = 2e-5
GRIDS = [(2, 2), (2, 3), (3, 2)]     # (nodes E, ranks per node I)


def _configs(G: int) -> list[dict]:
    out = []
    for causal, layout, heads, backward in itertools.product(
            (False, True), ("contiguous", "zigzag", "striped"), ("mha", "gqa"), ("burst", "ring")):
        if layout == "striped" and not causal:
            continue   # striped only changes causal block masks; non-causal is covered by the others
        out.append(dict(causal=causal, layout=layout, heads=heads, backward=backward, overlap=True))
    # overlap off (serialised) and the auto choice, on a few cases
    out += [dict(causal=True, layout="zigzag", heads="mha", backward="burst", overlap=False),
            dict(causal=True, layout="striped", heads="gqa", backward="ring", overlap=False),
            dict(causal=False, layout="contiguous", heads="gqa", backward="auto", overlap=True)]
    return out


def _run_all(node_size: int, configs: list[dict], topology: str = "double") -> list[dict]:
    rank, G = dist.get_rank(), dist.get_world_size()
    results = []
    for cfg in configs:
        z, zkv = HEADS[cfg["heads"]]
        q, k, v, do = make_inputs(B, 2 * G * CHUNK, z, zkv, D, torch.float32)
        ql, kl, vl = (shard(t, cfg["layout"], rank, G).requires_grad_() for t in (q, k, v))
        with comm.count_bytes() as counts:
            out, lse = burst_attn_func(ql, kl, vl, causal=cfg["causal"], layout=cfg["layout"],
                                       backward=cfg["backward"], return_lse=True, topology=topology,
                                       node_size=node_size, overlap=cfg["overlap"])
            out.backward(shard(do, cfg["layout"], rank, G))
        results.append(dict(out=out.detach(), lse=lse, dq=ql.grad, dk=kl.grad, dv=vl.grad, counts=dict(counts),
                            links=counts.link_dict(), notes=dict(counts.notes)))
    return results


def _check_against_reference(results, configs, G, node_size, topology="double"):
    for i, cfg in enumerate(configs):
        z, zkv = HEADS[cfg["heads"]]
        ref = attention_reference(*make_inputs(B, 2 * G * CHUNK, z, zkv, D, torch.float64), cfg["causal"])
        shape = AttnShape(B, 2 * G * CHUNK, z, zkv, D, G, dtype="float32")
        chosen = results[0][i]["notes"]["burst.backward"]
        assert cfg["backward"] == "auto" or chosen == cfg["backward"]
        for rank in range(G):
            res = results[rank][i]
            for name in ("out", "lse", "dq", "dk", "dv"):
                expect = shard(ref[name], cfg["layout"], rank, G, dim=2 if name == "lse" else 1)
                err, tol = max_err(res[name], expect), FP32_RTOL * max(ref[name].abs().max().item(), 1.0)
                assert err <= tol, f"rank {rank} {name}: error {err:.3g} > {tol:.3g} ({cfg}, node_size={node_size})"
            assert res["counts"] == volume.expected_bytes(shape, chosen), (rank, cfg)
            expect = volume.expected_link_bytes(shape, chosen, topology=topology, node_size=node_size, rank=rank)
            assert res["links"] == expect, f"rank {rank} ({cfg}): per link {res['links']} != formula {expect}"
            assert res["notes"]["burst.topology"].startswith("double ring" if topology == "double" else "flat")


@pytest.mark.parametrize("grid", GRIDS, ids=lambda g: f"{g[0]}x{g[1]}")
def test_double_ring_matches_fp64_reference(pools, grid):
    """Forward, burst backward, ring backward and auto; causal and not; MHA and GQA; every layout;
    overlap on and off: out, lse, dq, dk, dv on every rank, bytes per (phase, kind) and per link class."""
    E, I = grid
    G = E * I
    configs = _configs(G)
    results = pools.run(G, _run_all, I, configs, timeout=240)
    _check_against_reference(results, configs, G, I)
