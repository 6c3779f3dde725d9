"""Megatron TP at model level (TP-V1 all-reduce, TP-V3 sequence parallel; fused and materialised
attention) against the single-process fp64 model, and its bytes against the closed forms.

Each rank's gradient slices are placed into the full weights; the replicated
weights' gradients (after the V3 all-reduce) must each be complete. Same
tolerances and reasoning as test_model_parity (fp32 vs fp64; the TP sums over
G partial outputs add G roundings). Bytes: what one rank sends in one step =
n_layers x ``tensor_parallel.layer_comm_bytes`` (4 c BNHe forward and backward
each, attention and MLP together) + the loss all-reduce and the gradient
all-reduce of the replicated weights (V3 only).
"""
from __future__ import annotations

import pytest
import torch

from burst_impl.model import get_config
from baselines.tensor_parallel import layer_comm_bytes
from tests.model_refs import BATCH, SEQLEN, grad_errors, reference, tp_run
from tests.test_model_parity import GRAD_RTOL, LOSS_RTOL


def _full(per_rank: list[dict], ref_grads: dict) -> list[dict]:
    """Per rank, the full gradients: sharded slices summed over ranks, replicated ones as held."""
    out = []
    for res in per_rank:
        full = {}
        for name, (index, grad) in res.items():
            if index is None:
                full[name] = grad
            else:
                full[name] = torch.zeros_like(ref_grads[name])
                for other in per_rank:
                    dim, idx = other[name][0]
                    full[name].index_add_(dim, idx, other[name][1].double())
        out.append(full)
    return out


@pytest.mark.parametrize("version,world_size", [("v1", 1), ("v3", 1), ("v1", 2), ("v1", 3), ("v1", 4),
                                                 ("v3", 2), ("v3", 3), ("v3", 4)])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "materialised"])
def test_tp_parity_and_bytes(pools, version, world_size, fused):
    cfg = get_config("tiny")
    layouts = ["contiguous", "zigzag", "striped"] if version == "v3" and world_size > 1 else ["contiguous"]
    ref = reference("tiny")
    results = pools.run(world_size, tp_run, "tiny", version, layouts, fused)
    G = world_size
    for layout in layouts:
        grads = _full([r[layout]["grads"] for r in results], ref["grads"])
        for rank, res in enumerate(r[layout] for r in results):
            what = f"tp_{version} G={G} {layout} fused={fused} rank {rank}"
            assert abs(res["loss"] - ref["loss"]) <= LOSS_RTOL * abs(ref["loss"]), f"{what}: loss {res['loss']}"
            errs = grad_errors(grads[rank], ref["grads"])
            worst = max(errs, key=errs.get)
            assert errs[worst] <= GRAD_RTOL, f"{what}: {worst} gradient error {errs[worst]:.1e}"
            assert torch.equal(res["ids"], ref["next_ids"]), f"{what}: next tokens"

            per_layer = layer_comm_bytes(cfg, version, BATCH, SEQLEN, G, elem_size=4)
            expect = {k: v * cfg.n_layers for k, v in per_layer.items()}
            if version == "v3" and G > 1:
                expect[("forward", "loss")] = 2 * 16 * (G - 1) // G
            for k, v in res["sync_bytes"].items():
                expect[k] = expect.get(k, 0) + v
            assert res["step_bytes"] == expect, f"{what}: counted {res['step_bytes']} != formula {expect}"
            fwd = {k: v for k, v in expect.items() if k[0] == "forward" and k[1] != "loss"}
            if version == "v3" and G > 1:
                fwd[("forward", "next_token")] = 2 * 8 * BATCH * (G - 1) // G
            assert res["prefill_bytes"] == fwd, f"{what}: prefill counted {res['prefill_bytes']} != {fwd}"


def test_tp_bytes_are_the_papers_4bznd():
    """Per layer and direction, both versions send 4 (G-1)/G B N H e: docs/papers.md §1's 4BZNd per rank."""
    cfg = get_config("llama2_7b")
    B, N, G, e = 1, 32768, 8, 2
    four_bznd = 4 * B * N * cfg.hidden * e * (G - 1) // G
    for version in ("v1", "v3"):
        got = layer_comm_bytes(cfg, version, B, N, G, elem_size=e)
        for phase in ("forward", "backward"):
            assert sum(v for (p, _), v in got.items() if p == phase) == four_bznd, (version, phase, got)
