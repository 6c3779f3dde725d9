"""Attention blocks: every method behind one interface, so experiments compare like for like.

TP splits weights, not the sequence, so "attention" alone is not comparable
across TP and sequence-parallel (SP) methods. A *block* is: hidden states in,
QKV projection, attention, output projection, hidden states out, with the same
full weights for every method (drawn from ``seed``); each rank slices what it
needs.

    from baselines.block import make_block, block_input, block_forward, block_output
    blk = make_block("ring", shape, group=None, seed=0)   # shape: registry.AttnShape; H = heads * head_dim
    x = block_input(blk, x_full)        # this rank's input, cut from the full (B, N, H) hidden states
    y = block_forward(blk, x)           # same distribution as x
    y.backward(dy)                      # dy distributed like y; weight grads in blk.params[name].grad
    y_full = block_output(blk, [y of every rank])   # test helper: the full (B, N, H) output

Inputs, by ``blk.input``:
* ``"sequence"`` (every SP method: burst, burst_qring, ring, ring_rsa,
  ulysses, usp, ...; and tp_v3): the ``shape.layout`` shard (B, N/G, H);
* ``"replicated"`` (tp_v1): the whole (B, N, H) on every rank.

Weights (full shapes, H = Z*d): ``wq`` (H, Z*d), ``wk``/``wv`` (H, Zkv*d),
``wo`` (Z*d, H). ``blk.params`` holds this rank's trainable tensors and
``blk.index[name]`` = (dim, indices) says which slice of the full weight each
one is (``None``: the whole weight). SP methods hold full weights, and their
weight gradients are partial sums over this rank's tokens: training sums them
over the group with the data-parallel gradient reduction, outside the block
(not counted here). TP ranks hold disjoint head slices (kv heads may be
replicated, see ``baselines.tp``); summing every rank's scattered slices gives
the full gradient in both cases (``full_grads``).

Bytes: the projections are local, so a block sends exactly what its attention
method sends: ``registry.get(name).bytes(shape, **options)``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from burst_impl import comm
from burst_impl.layout import shard, unshard

from .registry import AttnShape, Method, get
from .tp import head_columns, tp_heads

Tensor = torch.Tensor
WEIGHTS = ("wq", "wk", "wv", "wo")
_DIM = {"wq": 1, "wk": 1, "wv": 1, "wo": 0}   # which dim of the full weight a TP rank slices


@dataclass
class AttnBlock:
    method: Method
    shape: AttnShape
    group: object
    rank: int
    params: dict[str, torch.nn.Parameter]
    index: dict[str, tuple[int, Tensor] | None]
    options: dict = field(default_factory=dict)

    @property
    def input(self) -> str:
        return self.method.block_input


def full_weights(shape: AttnShape, seed: int = 0) -> dict[str, Tensor]:
    """The full block weights for ``shape`` (identical on every rank for the same seed)."""
    g = torch.Generator().manual_seed(seed)
    z, zkv, d = shape.heads, shape.kv_heads, shape.head_dim
    h = z * d
    std = h ** -0.5
    w = {"wq": torch.randn(h, z * d, generator=g), "wk": torch.randn(h, zkv * d, generator=g),
         "wv": torch.randn(h, zkv * d, generator=g), "wo": torch.randn(z * d, h, generator=g)}
    return {k: (v * std).to(shape.torch_dtype) for k, v in w.items()}


def make_block(method_name: str, shape: AttnShape, group=None, seed: int = 0,
               device: torch.device | str = "cpu", **options) -> AttnBlock:
    """This rank's block for ``method_name`` with weights on ``device``;
    ValueError (before any communication) if it cannot run."""
    method = get(method_name)
    method.validate(shape, **options)
    rank, G = comm.world(group)
    if G != shape.world_size:
        raise ValueError(f"shape.world_size={shape.world_size} must equal the group size {G}")
    full = full_weights(shape, seed)
    if method.level == "block":   # tensor parallel: slice heads
        qh, kvh = tp_heads(shape.heads, shape.kv_heads, G, rank)
        cols = {"wq": head_columns(qh, shape.head_dim), "wk": head_columns(kvh, shape.head_dim),
                "wv": head_columns(kvh, shape.head_dim), "wo": head_columns(qh, shape.head_dim)}
        index = {n: (_DIM[n], cols[n]) for n in WEIGHTS}
        local = {n: full[n].index_select(_DIM[n], cols[n]) for n in WEIGHTS}
    else:
        index = {n: None for n in WEIGHTS}
        local = full
    params = {n: torch.nn.Parameter(t.to(device).contiguous()) for n, t in local.items()}
    return AttnBlock(method, shape, group, rank, params, index, options)


def block_input(block: AttnBlock, x_full: Tensor) -> Tensor:
    """This rank's input from the full hidden states (B, N, H)."""
    if block.input == "replicated":
        return x_full
    return shard(x_full, block.shape.layout, block.rank, block.shape.world_size)


def block_output(block: AttnBlock, outputs: list[Tensor]) -> Tensor:
    """The full (B, N, H) output from every rank's ``block_forward`` result (rank order)."""
    if block.input == "replicated":
        return outputs[0]
    return unshard(outputs, block.shape.layout)


def block_forward(block: AttnBlock, x: Tensor, softmax_scale: float | None = None) -> Tensor:
    """Hidden states in, hidden states out, distributed as ``block.input`` says."""
    s, p = block.shape, block.params
    if block.method.level == "block":
        return block.method.call(x, p["wq"], p["wk"], p["wv"], p["wo"], head_dim=s.head_dim, causal=s.causal,
                                 softmax_scale=softmax_scale, group=block.group, layout=s.layout,
                                 **block.options)
    b, n, _ = x.shape
    q = (x @ p["wq"]).view(b, n, s.heads, s.head_dim)       # (B, N/G, Z, d)
    k = (x @ p["wk"]).view(b, n, s.kv_heads, s.head_dim)    # (B, N/G, Zkv, d)
    v = (x @ p["wv"]).view(b, n, s.kv_heads, s.head_dim)
    o = block.method.call(q, k, v, causal=s.causal, softmax_scale=softmax_scale, group=block.group,
                          layout=s.layout, **block.options)
    return o.reshape(b, n, s.heads * s.head_dim) @ p["wo"]   # (B, N/G, H)


def scatter_grad(block_index: tuple[int, Tensor] | None, grad: Tensor, full_shape) -> Tensor:
    """A rank's weight gradient placed into a zero tensor of the full weight's shape (fp64)."""
    if block_index is None:
        return grad.double()
    dim, idx = block_index
    out = torch.zeros(full_shape, dtype=torch.float64)
    return out.index_add_(dim, idx, grad.double())


def full_grads(per_rank: list[dict], shape: AttnShape) -> dict[str, Tensor]:
    """Sum of every rank's scattered weight gradients: the full-weight gradients.

    ``per_rank[r]`` = ``{name: (index, grad)}`` as returned by ``local_grads``.
    """
    full = full_weights(shape)
    return {n: sum(scatter_grad(r[n][0], r[n][1], full[n].shape) for r in per_rank) for n in WEIGHTS}


def local_grads(block: AttnBlock) -> dict:
    """``{name: (index, grad)}`` of this rank, picklable, for ``full_grads``."""
    return {n: (block.index[n], block.params[n].grad.detach().clone()) for n in WEIGHTS}
