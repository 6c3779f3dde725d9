"""LLaMA decoder layers: RMSNorm, RoPE at explicit global positions, SwiGLU MLP, attention block.

Shapes: x (B, S, H) where S is the number of tokens this rank holds (N, or
N/G under sequence parallelism); q (B, S, Z, d), k/v (B, S, Zkv, d).

The attention block does the projections and RoPE and hands (q, k, v) to its
``core``, a callable ``core(q, k, v) -> o`` (B, S, Z, d). The core is what
parallelisation swaps (``sequence_parallel`` puts a registry method there,
issue 11's selective checkpointing can wrap it per layer). The default core
is single-device causal attention, intersected with ``cfg.mask`` when the config has
one (a sliding window, documents, block-sparse: ``burst_impl.masks``): the fused local
kernels (``burst_impl.local.local_attn``: flash on GPU, PyTorch's fused CPU kernel
here, the mask's live tiles) or, with ``fused=False``, plain math that materialises
the scores and masks them with ``Mask.allowed`` alone (the paper's "without
FlashAttention" rows, and the fp64 reference).

RoPE (Su et al. 2021, rotate-half form as in GPT-NeoX / HF LLaMA): channel
pairs (i, i + d/2) of a head at position p are rotated by angle
p * theta^(-2i/d). The positions are the tokens' *global* positions, given
explicitly, so a rank holding a zigzag or striped shard rotates each token as
the single-device model would.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from burst_impl import masks
from burst_impl.local import local_attn   # the same kernels every distributed method uses

from .config import ModelConfig

Tensor = torch.Tensor


def _compute_dtype(x: Tensor) -> torch.dtype:
    """At least fp32 for reductions (bf16 in, fp32 math; fp64 stays fp64 for references)."""
    return torch.promote_types(x.dtype, torch.float32)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, device=None, dtype=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.to(_compute_dtype(x))
        y = x32 * torch.rsqrt(x32.square().mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.to(y.dtype)).to(x.dtype)


# ---------------------------------------------------------------- RoPE


@dataclass(frozen=True)
class Rope:
    """cos/sin tables (S, d/2) for the tokens a rank holds, at their global ``positions`` (S,)."""

    positions: Tensor
    cos: Tensor
    sin: Tensor


def rope_tables(positions: Tensor, head_dim: int, theta: float, dtype: torch.dtype = torch.float32) -> Rope:
    """Angles in fp64 (position * frequency loses digits in fp32 at 1M positions), then cast."""
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64, device=positions.device) / head_dim)
    angles = positions.to(torch.float64)[:, None] * inv_freq[None, :]           # (S, d/2)
    return Rope(positions, angles.cos().to(dtype), angles.sin().to(dtype))


def apply_rope(x: Tensor, rope: Rope) -> Tensor:
    """x (B, S, heads, d) rotated at ``rope.positions``; computed in at least fp32."""
    d2 = x.shape[-1] // 2
    xc = x.to(_compute_dtype(x))
    cos = rope.cos.to(xc.dtype)[None, :, None, :]                               # (1, S, 1, d/2)
    sin = rope.sin.to(xc.dtype)[None, :, None, :]
    x1, x2 = xc[..., :d2], xc[..., d2:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


# ---------------------------------------------------------------- attention cores


def math_attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = True,
                   softmax_scale: float | None = None, mask: str = "") -> Tensor:
    """Attention with materialised (B, Z, S, S) scores, in the inputs' dtype (GQA by repeating kv).
    ``mask``: a ``burst_impl.masks`` spec over positions 0..S-1, intersected with causal when ``causal``;
    applied through ``Mask.allowed`` only (the definition, not the plans). A row with no live key
    would be NaN here: causal masks always keep the diagonal."""
    z, zkv, d = q.shape[2], k.shape[2], q.shape[3]
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else softmax_scale
    qh = q.transpose(1, 2)                                                      # (B, Z, S, d)
    kh = k.transpose(1, 2).repeat_interleave(z // zkv, dim=1)
    vh = v.transpose(1, 2).repeat_interleave(z // zkv, dim=1)
    s = (qh @ kh.transpose(-1, -2)) * scale                                     # (B, Z, S, S)
    if mask:
        pos = torch.arange(s.shape[-1])
        live = masks.resolve(causal, mask, s.shape[-1]).allowed(pos, pos).to(s.device)      # (S, S) bool
        s = s.masked_fill(~live, float("-inf"))
    elif causal:
        live = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril()
        s = s.masked_fill(~live, float("-inf"))
    p = torch.softmax(s.to(_compute_dtype(s)), dim=-1).to(v.dtype)
    return (p @ vh).transpose(1, 2)                                             # (B, S, Z, d)


@dataclass
class LocalAttention:
    """Single-device causal attention on the whole (local) sequence in position order, intersected
    with ``mask`` (a ``burst_impl.masks`` spec string; "" = none)."""

    fused: bool = True
    causal: bool = True
    backend: str | None = None      # burst_impl.kernels name for the fused path; None: automatic
    mask: str = ""

    def __call__(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        if not self.fused:
            return math_attention(q, k, v, causal=self.causal, mask=self.mask)
        return local_attn(q, k, v, causal=self.causal, backend=self.backend, mask=self.mask or None)


# ---------------------------------------------------------------- blocks


class Attention(nn.Module):
    """Projections + RoPE around ``self.core``; wq (Z*d, H), wk/wv (Zkv*d, H), wo (H, Z*d)."""

    def __init__(self, cfg: ModelConfig, device=None, dtype=None):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        h, q, kv = cfg.hidden, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
        self.wq = nn.Linear(h, q, bias=False, device=device, dtype=dtype)
        self.wk = nn.Linear(h, kv, bias=False, device=device, dtype=dtype)
        self.wv = nn.Linear(h, kv, bias=False, device=device, dtype=dtype)
        self.wo = nn.Linear(q, h, bias=False, device=device, dtype=dtype)
        self.core = LocalAttention(mask=cfg.mask)

    def forward(self, x: Tensor, rope: Rope) -> Tensor:
        b, s, _ = x.shape
        q = apply_rope(self.wq(x).view(b, s, -1, self.head_dim), rope)          # (B, S, Z, d)
        k = apply_rope(self.wk(x).view(b, s, -1, self.head_dim), rope)          # (B, S, Zkv, d)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        o = self.core(q, k, v)                                                  # (B, S, Z, d)
        return self.wo(o.reshape(b, s, -1))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x); w1/w3 (F, H), w2 (H, F)."""

    def __init__(self, cfg: ModelConfig, device=None, dtype=None):
        super().__init__()
        self.w1 = nn.Linear(cfg.hidden, cfg.ffn_hidden, bias=False, device=device, dtype=dtype)
        self.w3 = nn.Linear(cfg.hidden, cfg.ffn_hidden, bias=False, device=device, dtype=dtype)
        self.w2 = nn.Linear(cfg.ffn_hidden, cfg.hidden, bias=False, device=device, dtype=dtype)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """Pre-norm decoder block: x + attn(norm(x)), then + mlp(norm(.)). ``forward(x, rope)``;
    a per-block wrapper (activation checkpointing) must keep that signature."""

    def __init__(self, cfg: ModelConfig, device=None, dtype=None):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.hidden, cfg.norm_eps, device, dtype)
        self.attention = Attention(cfg, device, dtype)
        self.ffn_norm = RMSNorm(cfg.hidden, cfg.norm_eps, device, dtype)
        self.feed_forward = FeedForward(cfg, device, dtype)

    def forward(self, x: Tensor, rope: Rope) -> Tensor:
        h = x + self.attention(self.attention_norm(x), rope)
        return h + self.feed_forward(self.ffn_norm(h))
