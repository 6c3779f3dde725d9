"""One registry of every attention method, keyed by the names used in experiment YAML.

Each ``Method`` carries the function to run and the closed-form models the
experiments print next to measurements:

* ``comm_bytes(shape)``: bytes ONE rank sends for one forward + backward,
  ``{(phase, kind): bytes}``, exactly what ``burst_impl.comm.count_bytes``
  must count (tests assert equality);
* ``memory_bytes(shape)``: activation bytes per rank that one attention layer
  keeps for backward (a model, printed beside the measured peak);
* ``check(shape)``: ``ValueError`` if the method cannot run that shape.

``level="op"`` methods have the operator signature
``fn(q, k, v, *, causal=False, softmax_scale=None, group=None, layout=..., **kw)``
on local shards (B, N/G, Z, d). ``level="block"`` methods (tensor parallelism)
are attention blocks; every op method is also usable as a block through
``baselines.block`` so experiments compare blocks like for like.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from burst_impl import burst_attn_func, volume
from burst_impl.layout import LAYOUTS, check_seqlen

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class AttnShape:
    """One attention problem: global sizes and how it is split."""

    batch: int
    seqlen: int          # N, global
    heads: int           # Z
    kv_heads: int        # Zkv
    head_dim: int        # d
    world_size: int      # G
    dtype: str = "bfloat16"
    causal: bool = True
    layout: str = "contiguous"

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def elem_size(self) -> int:
        return torch.empty((), dtype=self.torch_dtype).element_size()

    @property
    def local_seqlen(self) -> int:
        return self.seqlen // self.world_size

    def validate(self) -> None:
        for name in ("batch", "seqlen", "heads", "kv_heads", "head_dim", "world_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)} must be positive")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r} is unknown; choose one of {sorted(DTYPES)}")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads={self.heads} must be a multiple of kv_heads={self.kv_heads}")
        check_seqlen(self.seqlen, self.layout, self.world_size)


@dataclass(frozen=True)
class Method:
    name: str
    level: str                                   # "op" or "block"
    fn: Callable
    comm_bytes: Callable[[AttnShape], dict]
    memory_bytes: Callable[[AttnShape], int]
    description: str
    travels: str                                 # what moves, for the README table
    layouts: tuple[str, ...] = LAYOUTS
    check: Callable[[AttnShape], None] = lambda shape: None
    available: Callable[[], bool] = lambda: True  # external adapters: is the package importable?
    external: str | None = None                   # peer package it wraps or is checked against
    options: dict = field(default_factory=dict)   # fixed keyword arguments for fn

    def validate(self, shape: AttnShape) -> None:
        shape.validate()
        if shape.layout not in self.layouts:
            raise ValueError(f"layout={shape.layout!r} is not supported by method {self.name!r}; "
                             f"it supports {self.layouts}")
        self.check(shape)


METHODS: dict[str, Method] = {}


def register(method: Method) -> Method:
    if method.name in METHODS:
        raise ValueError(f"method {method.name!r} registered twice")
    METHODS[method.name] = method
    return method


def get(name: str) -> Method:
    if name not in METHODS:
        raise ValueError(f"method={name!r} is unknown; registered: {sorted(METHODS)}")
    return METHODS[name]


# ---------------------------------------------------------------- BurstAttention


def _burst_bytes(backward: str):
    def f(s: AttnShape) -> dict:
        chosen = backward
        if backward == "auto":
            chosen = volume.cheaper_backward(s.batch, s.seqlen, s.heads, s.kv_heads, s.head_dim,
                                             s.world_size, s.elem_size)
        return volume.expected_bytes(s.batch, s.seqlen, s.heads, s.kv_heads, s.head_dim, s.world_size,
                                     s.elem_size, backward=chosen)
    return f


def _burst_memory(s: AttnShape) -> int:
    # Saved for backward per rank: q, out (Z heads), k, v (Zkv heads) in the
    # input dtype and lse (fp32): about 4BZNd/G + 4BZN/G bytes (PAPER.md Table 1).
    rows = s.batch * s.local_seqlen
    return rows * ((2 * s.heads + 2 * s.kv_heads) * s.head_dim * s.elem_size + 4 * s.heads)


def _burst_fn(backward: str):
    def fn(q, k, v, *, causal=False, softmax_scale=None, group=None, layout="contiguous", **kw):
        return burst_attn_func(q, k, v, causal=causal, softmax_scale=softmax_scale, group=group,
                               layout=layout, backward=backward, **kw)
    fn.__name__ = f"burst_{backward}"
    return fn


register(Method(
    name="burst", level="op", fn=_burst_fn("auto"), comm_bytes=_burst_bytes("auto"),
    memory_bytes=_burst_memory,
    description="BurstAttention: K/V ring forward; backward circulates whichever side is cheaper",
    travels="fwd: K, V; bwd: Q, dO, lse, delta + dQ ring (or K, V + dK, dV ring if cheaper)",
))
register(Method(
    name="burst_qring", level="op", fn=_burst_fn("burst"), comm_bytes=_burst_bytes("burst"),
    memory_bytes=_burst_memory,
    description="BurstAttention with the query-circulating backward forced",
    travels="fwd: K, V; bwd: Q, dO, lse, delta + dQ ring",
))
