"""Attention layers (baselines.layer): every method, incl. Megatron TP V1/V3, against an fp64 layer.

Checked per rank: the layer output, the input gradient, and the full weight
gradients (every rank's slices scattered into the full weights and summed),
plus bytes == the method's formula.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from baselines import AttnShape, get
from baselines.layer import full_grads, full_weights, layer_forward, layer_input, local_grads, make_layer
from burst_impl import comm
from burst_impl.kernels import default_scale
from burst_impl.kernels.reference import forward as _reference_forward
from burst_impl.layout import shard

B, D, CHUNK = 2, 16, 4
# fp32, relative to the largest reference magnitude. On top of the attention
# error (<= ~5e-6, see test_baselines.py) the layer adds three projections
# whose fp32 dot products run over H = Z*d <= 96 features, and weight
# gradients summed over B*N <= 64 tokens: ~ (96 + 64) * 1.2e-7 = 2e-5 in the
# worst case. 1e-4 leaves a factor 5 and is far below a real mistake (a wrong
# head slice or a missing reduction is an O(1) relative error).
FP32_RTOL = 1e-4


def heads_for(world_size: int, kind: str) -> tuple[int, int]:
    z = 6 if world_size == 3 else 4
    return {"mha": (z, z), "gqa": (z, z // 2)}[kind]


def _inputs(shape: AttnShape, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    h = shape.heads * shape.head_dim
    x = torch.randn(shape.batch, shape.seqlen, h, generator=g)
    dy = torch.randn(shape.batch, shape.seqlen, h, generator=g)
    return x, dy


def _run_layer(method: str, shape: AttnShape, options: dict) -> dict:
    lay = make_layer(method, shape, group=None, seed=0, **options)
    x_full, dy_full = _inputs(shape)
    x = layer_input(lay, x_full).clone().requires_grad_()
    dy = layer_input(lay, dy_full)
    with comm.count_bytes() as counts:
        y = layer_forward(lay, x)
        y.backward(dy)
    return dict(y=y.detach(), dx=x.grad, grads=local_grads(lay), counts=dict(counts), input=lay.input)


def layer_reference(shape: AttnShape) -> dict:
    """fp64 single-process layer: output, dX and full weight gradients."""
    x, dy = (t.double() for t in _inputs(shape))
    x.requires_grad_()
    w = {n: t.double().requires_grad_() for n, t in full_weights(shape, seed=0).items()}
    b, n, _ = x.shape
    q = (x @ w["wq"]).view(b, n, shape.heads, shape.head_dim)
    k = (x @ w["wk"]).view(b, n, shape.kv_heads, shape.head_dim)
    v = (x @ w["wv"]).view(b, n, shape.kv_heads, shape.head_dim)
    o, _ = _reference_forward(q, k, v, shape.causal, default_scale(shape.head_dim, None))
    y = o.reshape(b, n, -1) @ w["wo"]
    y.backward(dy)
    return dict(y=y.detach(), dx=x.grad, grads={k_: t.grad for k_, t in w.items()})


def check_layer(pools, method, world_size, causal, layout, heads, **options):
    z, zkv = heads_for(world_size, heads)
    shape = AttnShape(B, 2 * world_size * CHUNK, z, zkv, D, world_size, dtype="float32", causal=causal,
                      layout=layout)
    results = pools.run(world_size, _run_layer, method, shape, options)
    ref = layer_reference(shape)
    tol = {k: FP32_RTOL * max(t.abs().max().item(), 1.0) for k, t in [("y", ref["y"]), ("dx", ref["dx"])]}

    def local(t, rank):
        return t if results[0]["input"] == "replicated" else shard(t, layout, rank, world_size)

    for rank, res in enumerate(results):
        for name in ("y", "dx"):
            err = (res[name].double() - local(ref[name], rank)).abs().max().item()
            assert err <= tol[name], f"{method} rank {rank} {name}: error {err:.3g} > {tol[name]:.3g}"
    grads = full_grads([r["grads"] for r in results], shape)
    for name, g in grads.items():
        t = FP32_RTOL * max(ref["grads"][name].abs().max().item(), 1.0)
        err = (g - ref["grads"][name]).abs().max().item()
        assert err <= t, f"{method} weight grad {name}: error {err:.3g} > {t:.3g}"
    expect = get(method).bytes(shape, **options)
    for rank, res in enumerate(results):
        assert res["counts"] == expect, f"{method} rank {rank}: counted {res['counts']} != formula {expect}"


@pytest.mark.parametrize("method", ["tp_v1", "tp_v3"])
@pytest.mark.parametrize("world_size,causal,heads", [(g, c, h) for g in (1, 2, 3, 4) for c in (False, True)
                                                     for h in ("mha", "gqa")])
def test_tp_layers(pools, method, world_size, causal, heads):
    # gqa at G=4 (Zkv=2 < G) replicates each kv head's W_k, W_v columns on 2 ranks.
    check_layer(pools, method, world_size, causal, "contiguous", heads)


@pytest.mark.parametrize("method,world_size,layout,heads,options", [
    ("tp_v3", 4, "zigzag", "gqa", {}), ("tp_v1", 2, "zigzag", "mha", {}),
    ("burst", 4, "zigzag", "gqa", {}), ("burst_qring", 3, "contiguous", "mha", {}),
    ("ring", 4, "zigzag", "mha", {}), ("ring_rsa", 2, "contiguous", "gqa", {}),
    ("ulysses", 4, "zigzag", "gqa", {}), ("usp", 4, "zigzag", "mha", {"ulysses_degree": 2}),
    ("usp", 4, "contiguous", "gqa", {}), ("tp_v3", 3, "striped", "mha", {}),
    ("burst", 3, "striped", "gqa", {}),
])
def test_every_method_as_a_layer(pools, method, world_size, layout, heads, options):
    check_layer(pools, method, world_size, True, layout, heads, **options)


def _bad_layer(method, shape):
    with comm.count_bytes() as counts:
        try:
            make_layer(method, shape)
        except ValueError as e:
            msg = str(e)
        else:
            msg = ""
    assert counts.total() == 0
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == dist.get_world_size()
    return msg


@pytest.mark.parametrize("method,heads,kv_heads,needle", [
    ("tp_v1", 6, 6, "heads=6"), ("tp_v3", 12, 3, "kv_heads=3"), ("ulysses", 6, 6, "heads=6"),
])
def test_bad_layer_raises_before_communication(pools, method, heads, kv_heads, needle):
    shape = AttnShape(1, 16, heads, kv_heads, 8, 4, dtype="float32")
    for m in pools.run(4, _bad_layer, method, shape):
        assert needle in m, m
