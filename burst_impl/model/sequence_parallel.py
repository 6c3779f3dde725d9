"""Sequence parallelism through the whole model, as a function applied to a built model.

    model = sequence_parallel(build_model(cfg), get("burst"), group=g, layout="zigzag")

(``get`` is ``baselines.registry.get``: the caller resolves a name, the model takes the ``Method``.)

Each of the G ranks of ``group`` holds N/G tokens of every sequence in
``layout`` (``burst_impl.layout``: contiguous, zigzag, striped, or ``"balanced[:K]"``,
the balanced chunks of the model's mask, ``burst_impl.balance``). Embedding,
norms, projections, RoPE and MLP are per token, so they run on the local
tokens unchanged (RoPE at each token's *global* position, which the step
functions pass in). Only attention mixes tokens: every block's
``attention.core`` becomes the attention method ``method`` (a ``burst_impl.method.Method``,
e.g. an entry of the ``baselines`` registry) called on the local
shards (B, N/G, Z, d) with the layout, group and the model's mask
(``ModelConfig.mask``, intersected with causal; a method that takes no
mask is a ValueError naming it and the mask). Weights are replicated and
their gradients are partial sums over the rank's tokens: ``sync_grads``
all-reduces them (or ``fsdp.shard_weights`` switches to FSDP2).

Bytes per layer are exactly the method's: ``layer_comm_bytes``.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from burst_impl import comm
from burst_impl.balance import chunks_of
from burst_impl.layout import chunks_per_rank, is_balanced_name
from burst_impl.method import Method
from burst_impl.shape import AttnShape

from .config import ModelConfig
from .parallel import ParallelPlan

Tensor = torch.Tensor


@dataclass
class RegistryAttention:
    """A block's attention core: the attention method ``method`` on local shards."""

    method: Method
    group: object
    layout: str
    causal: bool = True
    options: dict = field(default_factory=dict)
    mask: str = ""                     # ModelConfig.mask; "" = the causal mask alone

    def __call__(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return self.method.call(q, k, v, causal=self.causal, group=self.group, layout=self.layout,
                                mask=self.mask, **self.options)


def attn_shape(cfg: ModelConfig, batch: int, seqlen: int, world_size: int, layout: str,
               dtype: str = "bfloat16", causal: bool = True) -> AttnShape:
    """The attention problem of one layer of ``cfg`` (global sizes, the model's mask)."""
    return AttnShape(batch, seqlen, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, world_size, dtype=dtype,
                     causal=causal, layout=layout, mask=cfg.mask)


def check_method(cfg: ModelConfig, m: Method, world_size: int, layout: str, seqlen: int | None = None,
                 **options) -> Method:
    """``m``, or ValueError if it cannot run ``cfg`` over ``world_size`` ranks in ``layout`` (heads
    that do not split, an unsupported layout, a sequence that does not split)."""
    if not isinstance(m, Method):
        raise ValueError(f"method={m!r} must be a burst_impl.method.Method (resolve a name with "
                         "baselines.registry.get)")
    if m.level != "op":
        raise ValueError(f"method={m.name!r} is a {m.level}-level method; sequence parallelism needs an "
                         f"op-level attention method (tensor parallelism is baselines.tensor_parallel)")
    if not m.available():
        raise ValueError(f"method={m.name!r} is not available here (needs {m.external})")
    if cfg.mask and not m.masks:
        raise ValueError(f"mask={cfg.mask!r} (model {cfg.name!r}): method {m.name!r} takes only the causal mask, "
                         "not masks (Method.masks)")
    if seqlen is None:
        # Without a sequence length yet, the shortest one the layout splits checks the head and layout
        # rules; the mask's sizes (a window wider than that N) wait for the step's N.
        per_rank = chunks_of(layout) if is_balanced_name(layout) else chunks_per_rank(layout)
        cfg, seqlen = replace(cfg, mask=""), per_rank * world_size
    m.validate(attn_shape(cfg, 1, seqlen, world_size, layout), **options)
    return m


def sequence_parallel(model, method: Method, *, group=None, layout: str = "contiguous", **options):
    """Turn ``model`` (single-device, weights identical on every rank) into this rank's sequence-parallel
    model. ``options`` go to the method (e.g. ``ulysses_degree`` for usp). In place; returns ``model``."""
    if model.parallel is not None:
        raise ValueError(f"model is already parallel ({model.parallel.kind}); apply one transform")
    rank, G = comm.world(group)
    m = check_method(model.cfg, method, G, layout, **options)
    for block in model.layers:
        block.attention.core = RegistryAttention(m, group, layout, options=dict(options), mask=model.cfg.mask)
    model.parallel = ParallelPlan("sp", group=group, layout=layout, method=m, options=dict(options),
                                  reduce_grads=tuple(n for n, _ in model.named_parameters()),
                                  rank=rank, world_size=G, mask=model.cfg.mask)
    return model


def check_sequence(model, seqlen: int) -> None:
    """ValueError unless the model's plan can run a global sequence of ``seqlen`` (before any comm)."""
    plan = model.parallel
    if plan is None:
        return
    plan.check_seqlen(seqlen)
    if plan.kind == "sp":
        check_method(model.cfg, plan.method, plan.world_size, plan.layout, seqlen, **plan.options)


def layer_comm_bytes(cfg: ModelConfig, method: Method, batch: int, seqlen: int, world_size: int,
                     layout: str = "contiguous", dtype: str = "bfloat16", **options) -> dict:
    """``{(phase, kind): bytes}`` one rank sends per layer for one forward + backward
    (the attention method's closed form; the projections and MLP send nothing; a mask changes no byte:
    a fully masked block pair is skipped, not its transfer, docs/masks.md)."""
    return method.bytes(attn_shape(cfg, batch, seqlen, world_size, layout, dtype), **options)
