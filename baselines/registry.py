"""One registry of every attention method, keyed by the names used in experiment YAML.

Each ``Method`` carries the function to run and the closed-form models the
experiments print next to measurements:

* ``comm_bytes(shape, **options)``: bytes ONE rank sends for one forward +
  backward, ``{(phase, kind): bytes}``, exactly what
  ``burst_impl.comm.count_bytes`` must count (tests assert equality);
* ``memory_bytes(shape, **options)``: activation bytes per rank that one
  attention layer keeps for backward (a model, printed beside the measured peak);
* ``check(shape, **options)``: ``ValueError`` if the method cannot run that shape.

``options`` are the method's keyword arguments (e.g. ``ulysses_degree`` for
``usp``); call ``method.bytes(shape, **options)``, ``method.memory(shape,
**options)`` and ``method.validate(shape, **options)``, which merge them with
the registered defaults.

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

# Methods support these unless they list more ("striped" needs position-generic masks).
CHUNKED_LAYOUTS = ("contiguous", "zigzag")

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
    layouts: tuple[str, ...] = CHUNKED_LAYOUTS
    check: Callable[..., None] = lambda shape, **_: None
    available: Callable[[], bool] = lambda: True  # external adapters: is the package importable?
    external: str | None = None                   # peer package it wraps or is checked against
    # True for adapters whose sends happen inside another package: their counters
    # record the formula at the points the sends happen, they do not measure.
    bytes_by_formula: bool = False
    options: dict = field(default_factory=dict)   # fixed keyword arguments for fn
    # What the attention block of this method takes (baselines.block): "sequence" = the
    # layout shard (B, N/G, H) of the hidden states; "replicated" = all of (B, N, H).
    block_input: str = "sequence"

    def _opts(self, options: dict) -> dict:
        return {**self.options, **options}

    def validate(self, shape: AttnShape, **options) -> None:
        shape.validate()
        if shape.layout not in self.layouts:
            raise ValueError(f"layout={shape.layout!r} is not supported by method {self.name!r}; "
                             f"it supports {self.layouts}")
        self.check(shape, **self._opts(options))

    def bytes(self, shape: AttnShape, **options) -> dict:
        """``{(phase, kind): bytes}`` one rank sends for one forward + backward."""
        return self.comm_bytes(shape, **self._opts(options))

    def memory(self, shape: AttnShape, **options) -> int:
        return self.memory_bytes(shape, **self._opts(options))

    def call(self, *args, **kwargs):
        """``fn`` with the registered options as defaults."""
        return self.fn(*args, **self._opts(kwargs))


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
    def f(s: AttnShape, **_) -> dict:
        chosen = backward
        if backward == "auto":
            chosen = volume.cheaper_backward(s.batch, s.seqlen, s.heads, s.kv_heads, s.head_dim,
                                             s.world_size, s.elem_size)
        return volume.expected_bytes(s.batch, s.seqlen, s.heads, s.kv_heads, s.head_dim, s.world_size,
                                     s.elem_size, backward=chosen)
    return f


def _burst_memory(s: AttnShape, **_) -> int:
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
    name="burst", layouts=LAYOUTS, level="op", fn=_burst_fn("auto"), comm_bytes=_burst_bytes("auto"),
    memory_bytes=_burst_memory,
    description="BurstAttention: K/V ring forward; backward circulates whichever side is cheaper",
    travels="fwd: K, V; bwd: Q, dO, lse, delta + dQ ring (or K, V + dK, dV ring if cheaper)",
))
register(Method(
    name="burst_qring", layouts=LAYOUTS, level="op", fn=_burst_fn("burst"), comm_bytes=_burst_bytes("burst"),
    memory_bytes=_burst_memory,
    description="BurstAttention with the query-circulating backward forced",
    travels="fwd: K, V; bwd: Q, dO, lse, delta + dQ ring",
))


# ---------------------------------------------------------------- sequence-parallel baselines

from . import external  # noqa: E402  (after the BurstAttention entries, which need nothing of these)
from .ring import ring_attn_func, ring_comm_bytes  # noqa: E402
from .ring_rsa import ring_rsa_attn_func, ring_rsa_comm_bytes, ring_rsa_memory_bytes  # noqa: E402
from .tp import tp_comm_bytes, tp_heads, tp_memory_bytes, tp_v1_forward, tp_v3_forward  # noqa: E402
from .ulysses import kv_replication, ulysses_attn_func, ulysses_comm_bytes, ulysses_memory_bytes  # noqa: E402
from .usp import check_degrees, usp_attn_func, usp_comm_bytes, usp_memory_bytes  # noqa: E402


def default_ulysses_degree(world_size: int, heads: int, kv_heads: int) -> int:
    """USP's Ulysses degree when none is given: the largest divisor u of G with
    u <= min(8, G/2) (at most one 8-GPU node of all-to-all, at least a 2-way
    ring) for which the heads split (``kv_replication``); 1 if none."""
    best = 1
    for u in range(1, min(8, world_size // 2) + 1):
        if world_size % u == 0:
            try:
                kv_replication(heads, kv_heads, u)
            except ValueError:
                continue
            best = u
    return best


def _ulysses_check(s: AttnShape) -> None:
    kv_replication(s.heads, s.kv_heads, s.world_size)


def _deepspeed_check(s: AttnShape) -> None:
    if s.heads % s.world_size or s.kv_heads % s.world_size:
        raise ValueError(f"heads={s.heads} and kv_heads={s.kv_heads} must be divisible by "
                         f"world_size={s.world_size} for deepspeed_ulysses (no kv replication there)")


def _usp_fn(q, k, v, *, group=None, ulysses_degree=None, **kw):
    from burst_impl import comm

    if ulysses_degree is None:  # q, k that are not 4-D tensors are left to usp_attn_func's checks
        four_d = all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (q, k))
        ulysses_degree = default_ulysses_degree(comm.world(group)[1], q.shape[2], k.shape[2]) if four_d else 1
    return usp_attn_func(q, k, v, group=group, ulysses_degree=ulysses_degree, **kw)


def _usp_degree(s: AttnShape, ulysses_degree=None) -> int:
    return default_ulysses_degree(s.world_size, s.heads, s.kv_heads) if ulysses_degree is None else ulysses_degree


def _usp_check(s: AttnShape, ulysses_degree=None, **_) -> None:
    u, _r = check_degrees(s.world_size, _usp_degree(s, ulysses_degree))
    kv_replication(s.heads, s.kv_heads, u)


register(Method(
    name="ring", layouts=LAYOUTS, level="op", fn=ring_attn_func, comm_bytes=lambda s, **_: ring_comm_bytes(s),
    memory_bytes=_burst_memory,
    description="Blockwise ring attention (ring-flash-attn / Megatron CP style), = Burst forward + K/V-circulating backward",
    travels="fwd: K, V; bwd: K, V + dK, dV ring (fp32)",
    external="PyTorch context parallel (_templated_ring_attention), forward",
))
register(Method(
    name="ring_rsa", layouts=LAYOUTS, level="op", fn=ring_rsa_attn_func, comm_bytes=lambda s, **_: ring_rsa_comm_bytes(s),
    memory_bytes=lambda s, **_: ring_rsa_memory_bytes(s),
    description="RingAttention as in the BurstAttention paper: Li et al. 2021 ring self-attention, "
                "materialises the (B, Z, N/G, N) scores",
    travels="fwd: K ring then V ring; bwd: V ring, K ring, all-reduce of full-length dK, dV (fp32)",
))
register(Method(
    name="ulysses", layouts=LAYOUTS, level="op", fn=ulysses_attn_func, comm_bytes=lambda s, **_: ulysses_comm_bytes(s),
    memory_bytes=lambda s, **_: ulysses_memory_bytes(s),
    check=lambda s, **_: _ulysses_check(s),
    description="DeepSpeed-Ulysses: all-to-all sequence->heads, local attention over N, all-to-all back",
    travels="fwd: all-to-all of Q, K, V, O; bwd: all-to-all of dO, dQ, dK, dV",
    external="DeepSpeed DistributedAttention (deepspeed.sequence.layer)",
))
register(Method(
    name="usp", level="op", fn=_usp_fn,
    comm_bytes=lambda s, ulysses_degree=None, backward="auto", **_: usp_comm_bytes(
        s, _usp_degree(s, ulysses_degree), backward),
    memory_bytes=lambda s, ulysses_degree=None, **_: usp_memory_bytes(s, _usp_degree(s, ulysses_degree)),
    check=_usp_check,
    description="USP / Burst-USP: Ulysses all-to-all inside groups of ulysses_degree ranks, Burst ring across them",
    travels="Ulysses all-to-alls (a2a_*) within u ranks + Burst ring bytes over G/u ranks",
))


def _tp_check(s: AttnShape, **_) -> None:
    tp_heads(s.heads, s.kv_heads, s.world_size, 0)


register(Method(
    name="tp_v1", layouts=LAYOUTS, level="block", fn=tp_v1_forward, comm_bytes=lambda s, **_: tp_comm_bytes(s, "v1"),
    memory_bytes=lambda s, **_: tp_memory_bytes(s, "v1"), check=_tp_check, block_input="replicated",
    description="Megatron TP V1 attention block: column-parallel QKV, row-parallel output, all-reduce",
    travels="fwd: all-reduce of the block output (B, N, H); bwd: all-reduce of dX",
))
register(Method(
    name="tp_v3", layouts=LAYOUTS, level="block", fn=tp_v3_forward, comm_bytes=lambda s, **_: tp_comm_bytes(s, "v3"),
    memory_bytes=lambda s, **_: tp_memory_bytes(s, "v3"), check=_tp_check,
    description="Megatron TP V3 (sequence parallel) attention block: all-gather before, reduce-scatter after",
    travels="fwd: all-gather of X, reduce-scatter of the output; bwd: reduce-scatter of dX, all-gather of dY",
))

# ---------------------------------------------------------------- external adapters

register(Method(
    name="ring_flash_attn", level="op", fn=external.ring_flash_attn_adapter,
    comm_bytes=external.ring_flash_attn_comm_bytes, memory_bytes=_burst_memory,
    available=external.ring_flash_attn_available, external="ring-flash-attn", bytes_by_formula=True,
    description="The ring-flash-attn package (CUDA); bytes recorded by formula, not instrumented",
    travels="fwd: K, V; bwd: K, V + dK, dV (fp32, G sends)",
))
register(Method(
    name="deepspeed_ulysses", level="op", fn=external.deepspeed_ulysses_adapter,
    comm_bytes=external.deepspeed_ulysses_comm_bytes, memory_bytes=lambda s, **_: ulysses_memory_bytes(s),
    available=external.deepspeed_available, external="deepspeed", layouts=("contiguous",),
    bytes_by_formula=True,
    check=lambda s, **_: _deepspeed_check(s),
    description="DeepSpeed's DistributedAttention around our local kernel; bytes recorded by formula",
    travels="as ulysses",
))
