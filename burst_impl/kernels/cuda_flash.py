"""``cuda_flash``: PyTorch's own FlashAttention-2 CUDA kernels (``aten._flash_attention_forward`` / ``_backward``).

The FlashAttention-2 code PyTorch ships, reached without the flash-attn package through the two ops
that SDPA's flash backend and ``torch.nn.attention.varlen.varlen_attn`` both call. They take the
suite's (B, S, Z, d) layout as it is (no transposes) and GQA natively (Zkv dividing Z: no repeated
kv heads, and the backward sums dK, dV over each group itself). The forward returns the lse (B, Z, Sq)
in fp32; the backward recomputes the probabilities from a given lse and takes ``delta`` through the
surrogate ``out`` (``common.py``), so a ring can pass the merged (global) lse. Causal tiles are
square (the plans' rule), where top-left and bottom-right alignment agree.

Partial-mask tiles, as the flash-attn backend runs them (``flash_tiles.py``): a band (sliding window)
as the kernels' bottom-right ``window_size_left/right``, a document diagonal as the varlen form
(``cum_seq_q/k``; q, k, v packed to (B x S, heads, d), lse (Z, B x S)); dense tiles, and bands the
window cannot express, in the exact path's math (``kernels.masked``).
"""
from __future__ import annotations

import functools

import torch

from .common import Backend, head_dim_rule, stats_dtype, surrogate_out
from .flash_tiles import UNBOUNDED, flash_lse, masked_pair, our_lse, varlen_args


def _aten():
    """The op namespace (one place, so tests can put a CPU fake here)."""
    return torch.ops.aten


@functools.lru_cache(maxsize=None)
def _rng(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(rng_state, unused) for the backward: dropout is 0, so neither is read, but the op takes tensors;
    made once per device, not per tile of every ring step."""
    return torch.zeros(2, dtype=torch.uint64, device=device), torch.empty(0, device=device)


def _window(window: tuple[int, int]) -> dict:
    """The window keywords, given only for a bounded window (the dense call is the one SDPA makes)."""
    return {} if window == UNBOUNDED else dict(window_size_left=window[0], window_size_right=window[1])


def forward(q, k, v, causal, scale, window: tuple[int, int] = UNBOUNDED):
    """``window``: the kernels' (left, right) window (``flash_tiles.flash_window``; -1: unbounded)."""
    out, lse, *_ = _aten()._flash_attention_forward(
        q, k, v, None, None, q.shape[1], k.shape[1], 0.0, causal, False, scale=scale, **_window(window))
    return out, (lse if window == UNBOUNDED else our_lse(lse))


def backward(dout, q, k, v, lse, delta, causal, scale, window: tuple[int, int] = UNBOUNDED):
    rng, unused = _rng(q.device)
    # cum_seq None: the dense (non-varlen) path
    return _aten()._flash_attention_backward(
        dout, q, k, v, surrogate_out(dout, delta), lse if window == UNBOUNDED else flash_lse(lse),
        None, None, q.shape[1], k.shape[1], 0.0, causal, rng, unused, scale=scale, **_window(window))


def _packed(t):
    """(B, S, heads, d) -> (B x S, heads, d), the varlen form."""
    return t.reshape(t.shape[0] * t.shape[1], *t.shape[2:])


def _varlen_forward(q, k, v, tm, scale):
    b, s, z, d = q.shape
    cu, longest = varlen_args(tm, b, s, q.device)
    out, lse, *_ = _aten()._flash_attention_forward(
        _packed(q), _packed(k), _packed(v), cu, cu, longest, longest, 0.0, tm.kind == "varlen", False, scale=scale)
    if lse.shape != (z, b * s):
        raise RuntimeError(f"PyTorch's varlen flash forward returned lse of shape {tuple(lse.shape)}; this backend "
                           f"knows the (heads, total) = {(z, b * s)} of torch >= 2.4")
    return out.reshape(b, s, z, d), lse.reshape(z, b, s).permute(1, 0, 2).to(stats_dtype(q.dtype))


def _varlen_backward(dout, q, k, v, lse, delta, tm, scale):
    b, s, z, d = q.shape
    cu, longest = varlen_args(tm, b, s, q.device)
    rng, unused = _rng(q.device)
    lse_v = lse.permute(1, 0, 2).reshape(z, b * s).contiguous()   # (B, Z, S) -> (Z, B x S), as the forward's
    dq, dk, dv = _aten()._flash_attention_backward(
        _packed(dout), _packed(q), _packed(k), _packed(v), _packed(surrogate_out(dout, delta)), lse_v, cu, cu,
        longest, longest, 0.0, tm.kind == "varlen", rng, unused, scale=scale)
    return dq.reshape(q.shape), dk.reshape(k.shape), dv.reshape(v.shape)


masked_forward, masked_backward = masked_pair(forward, backward, _varlen_forward, _varlen_backward)


BACKEND = Backend("cuda_flash", forward, backward, devices=("cuda",), dtypes=(torch.float16, torch.bfloat16),
                  check=head_dim_rule("cuda_flash", 256), masked_forward=masked_forward,
                  masked_backward=masked_backward)
