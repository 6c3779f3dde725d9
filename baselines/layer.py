"""Attention layers: every method behind one interface, so experiments compare like for like.

TP splits weights, not the sequence, so "attention" alone is not comparable
across TP and sequence-parallel (SP) methods. An *attention layer* is: hidden states in,
QKV projection, attention, output projection, hidden states out, with the same
full weights for every method (drawn from ``seed``); each rank slices what it
needs.

    from baselines.layer import make_layer, layer_input, layer_forward, layer_output
    lay = make_layer("ring", shape, group=None, seed=0)   # shape: registry.AttnShape; H = heads * head_dim
    x = layer_input(lay, x_full)        # this rank's input, cut from the full (B, N, H) hidden states
    y = layer_forward(lay, x)           # same distribution as x
    y.backward(dy)                      # dy distributed like y; weight grads in lay.params[name].grad
    y_full = layer_output(lay, [y of every rank])   # test helper: the full (B, N, H) output

Inputs, by ``lay.input``:
* ``"sequence"`` (every SP method: burst, burst_qring, ring, ring_rsa,
  ulysses, usp, ...; and tp_v3): the ``shape.layout`` shard (B, N/G, H);
* ``"replicated"`` (tp_v1): the whole (B, N, H) on every rank.

Weights (full shapes, H = Z*d): ``wq`` (H, Z*d), ``wk``/``wv`` (H, Zkv*d),
``wo`` (Z*d, H). ``lay.params`` holds this rank's trainable tensors and
``lay.index[name]`` = (dim, indices) says which slice of the full weight each
one is (``None``: the whole weight). SP methods hold full weights, and their
weight gradients are partial sums over this rank's tokens: training sums them
over the group with the data-parallel gradient reduction, outside the layer
(not counted here). TP ranks hold disjoint head slices (kv heads may be
replicated, see ``baselines.tp``); summing every rank's scattered slices gives
the full gradient in both cases (``full_grads``).

Bytes: the projections are local, so a layer sends exactly what its attention
method sends: ``registry.get(name).bytes(shape, **options)``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from burst_impl import comm
from burst_impl.layout import shard, unshard

from burst_impl.shape import AttnShape

from burst_impl.method import Method
from .methods.tp import head_columns, tp_heads
from .registry import get

Tensor = torch.Tensor
WEIGHTS = ("wq", "wk", "wv", "wo")
_DIM = {"wq": 1, "wk": 1, "wv": 1, "wo": 0}   # which dim of the full weight a TP rank slices


@dataclass
class AttnLayer:
    method: Method
    shape: AttnShape
    group: object
    rank: int
    params: dict[str, torch.nn.Parameter]
    index: dict[str, tuple[int, Tensor] | None]
    options: dict = field(default_factory=dict)

    @property
    def input(self) -> str:
        return self.method.layer_input


def full_weights(shape: AttnShape, seed: int = 0) -> dict[str, Tensor]:
    """The full layer weights for ``shape`` (identical on every rank for the same seed)."""
    g = torch.Generator().manual_seed(seed)
    z, zkv, d = shape.heads, shape.kv_heads, shape.head_dim
    h = z * d
    std = h ** -0.5
    w = {"wq": torch.randn(h, z * d, generator=g), "wk": torch.randn(h, zkv * d, generator=g),
         "wv": torch.randn(h, zkv * d, generator=g), "wo": torch.randn(z * d, h, generator=g)}
    return {k: (v * std).to(shape.torch_dtype) for k, v in w.items()}


def make_layer(method_name: str, shape: AttnShape, group=None, seed: int = 0,
               device: torch.device | str = "cpu", **options) -> AttnLayer:
    """This rank's layer for ``method_name`` with weights on ``device``;
    ValueError (before any communication) if it cannot run."""
    method = get(method_name)
    method.validate(shape, **options)
    rank, G = comm.world(group)
    if G != shape.world_size:
        raise ValueError(f"shape.world_size={shape.world_size} must equal the group size {G}")
    full = full_weights(shape, seed)
    if method.level == "layer":   # tensor parallel: slice heads
        qh, kvh = tp_heads(shape.heads, shape.kv_heads, G, rank)
        cols = {"wq": head_columns(qh, shape.head_dim), "wk": head_columns(kvh, shape.head_dim),
                "wv": head_columns(kvh, shape.head_dim), "wo": head_columns(qh, shape.head_dim)}
        index = {n: (_DIM[n], cols[n]) for n in WEIGHTS}
        local = {n: full[n].index_select(_DIM[n], cols[n]) for n in WEIGHTS}
    else:
        index = {n: None for n in WEIGHTS}
        local = full
    params = {n: torch.nn.Parameter(t.to(device).contiguous()) for n, t in local.items()}
    return AttnLayer(method, shape, group, rank, params, index, options)


def layer_input(layer: AttnLayer, x_full: Tensor) -> Tensor:
    """This rank's input from the full hidden states (B, N, H)."""
    if layer.input == "replicated":
        return x_full
    return shard(x_full, layer.shape.resolved_layout, layer.rank, layer.shape.world_size)


def layer_output(layer: AttnLayer, outputs: list[Tensor]) -> Tensor:
    """The full (B, N, H) output from every rank's ``layer_forward`` result (rank order)."""
    if layer.input == "replicated":
        return outputs[0]
    return unshard(outputs, layer.shape.resolved_layout)


def layer_forward(layer: AttnLayer, x: Tensor, softmax_scale: float | None = None) -> Tensor:
    """Hidden states in, hidden states out, distributed as ``layer.input`` says."""
    s, p = layer.shape, layer.params
    if layer.method.level == "layer":
        return layer.method.call(x, p["wq"], p["wk"], p["wv"], p["wo"], head_dim=s.head_dim, causal=s.causal,
                                 mask=s.mask, softmax_scale=softmax_scale, group=layer.group, layout=s.layout,
                                 **layer.options)
    b, n, _ = x.shape
    q = (x @ p["wq"]).view(b, n, s.heads, s.head_dim)       # (B, N/G, Z, d)
    k = (x @ p["wk"]).view(b, n, s.kv_heads, s.head_dim)    # (B, N/G, Zkv, d)
    v = (x @ p["wv"]).view(b, n, s.kv_heads, s.head_dim)
    o = layer.method.call(q, k, v, causal=s.causal, mask=s.mask, softmax_scale=softmax_scale, group=layer.group,
                          layout=s.layout, **layer.options)
    return o.reshape(b, n, s.heads * s.head_dim) @ p["wo"]   # (B, N/G, H)


def scatter_grad(layer_index: tuple[int, Tensor] | None, grad: Tensor, full_shape) -> Tensor:
    """A rank's weight gradient placed into a zero tensor of the full weight's shape (fp64)."""
    if layer_index is None:
        return grad.double()
    dim, idx = layer_index
    out = torch.zeros(full_shape, dtype=torch.float64)
    return out.index_add_(dim, idx, grad.double())


def full_grads(per_rank: list[dict], shape: AttnShape) -> dict[str, Tensor]:
    """Sum of every rank's scattered weight gradients: the full-weight gradients.

    ``per_rank[r]`` = ``{name: (index, grad)}`` as returned by ``local_grads``.
    """
    full = full_weights(shape)
    return {n: sum(scatter_grad(r[n][0], r[n][1], full[n].shape) for r in per_rank) for n in WEIGHTS}


def local_grads(layer: AttnLayer) -> dict:
    """``{name: (index, grad)}`` of this rank, picklable, for ``full_grads``."""
    return {n: (layer.index[n], layer.params[n].grad.detach().clone()) for n in WEIGHTS}
