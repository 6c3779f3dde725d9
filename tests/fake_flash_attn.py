"""Fakes of flash-attn's private interface (``flash_attn.flash_attn_interface``) in three generations,
computing in fp64 with flash-attn's own mask and lse conventions, for tests/test_kernels_flash_attn.py.

What they reproduce, from flash-attn's source at the release tags:

* 2.7+: the four entry points are ``torch.library.custom_op`` objects (``inspect.signature`` gives
  ``(*args, **kwargs)``; the wrapped function is ``_init_fn``); ``window_size_left``,
  ``window_size_right`` and ``softcap`` have no default in the dense pair; the forward returns
  (out, softmax_lse, S_dmask, rng_state); the backward writes dq/dk/dv and returns softmax_d.
* 2.6: plain functions taking ``window_size=(left, right)`` and ``softcap``; the forward returns 8
  values (out, q, k, v, out_padded, softmax_lse, S_dmask, rng_state).
* 2.4-2.5: as 2.6 without ``softcap``.
* The window is bottom-right aligned; in the forward a size >= Sk becomes -1 and a -1 beside a
  bounded side becomes Sk; in the backward (``BWD_SEMANTICS``) a size >= Sk becomes -1, meaning
  unbounded. A row with no live key: out 0, lse = +inf (so the backward's exp(s - lse) is 0); an
  lse of -inf handed to the backward gives NaN, as the kernel's exp would.
* The backward forms delta = rowsum(dout * out) from ``out`` (what every stock backward does).

``ATEN`` fakes PyTorch's own copy of the kernels the same way (``aten._flash_attention_forward`` and
``_backward``, the ``cuda_flash`` backend's ops, for tests/test_kernels_cuda_flash.py): the same window
and empty-row conventions, an optional window (None: unbounded), the varlen form's lse (Z, total).
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import Optional

import torch

from burst_impl.heads import expand_kv, fold_kv

CALLS: list[dict] = []   # every call of every fake: entry point, window, data pointers


def live(sq: int, sk: int, causal: bool, left: int, right: int, backward: bool = False) -> torch.Tensor:
    """(Sq, Sk) bool: which keys flash-attn lets each query see."""
    left, right = (-1 if left >= sk else left), (-1 if right >= sk else right)
    if causal:
        right = 0
    if not backward:
        if left < 0 <= right:
            left = sk
        if right < 0 <= left:
            right = sk
    i, j = torch.arange(sq).unsqueeze(1), torch.arange(sk).unsqueeze(0)
    ok = torch.ones(sq, sk, dtype=torch.bool)
    shift = sk - sq
    if left >= 0:
        ok &= j >= i + shift - left
    if right >= 0:
        ok &= j <= i + shift + right
    return ok


def _scores(q, k, scale, ok):
    qh = q.double().transpose(1, 2)
    kh = expand_kv(k.double().transpose(1, 2), q.shape[2], dim=1)
    return (qh @ kh.transpose(-1, -2) * scale).masked_fill(~ok, float("-inf"))


def _fwd(q, k, v, scale, ok):
    s = _scores(q, k, scale, ok)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.unsqueeze(-1)).nan_to_num(nan=0.0)
    out = (p @ expand_kv(v.double().transpose(1, 2), q.shape[2], dim=1)).transpose(1, 2)
    return out.to(q.dtype), lse.masked_fill(torch.isneginf(lse), float("inf")).float()


def _bwd(dout, q, k, v, out, lse, scale, ok, dq, dk, dv):
    z, zkv = q.shape[2], k.shape[2]
    s = _scores(q, k, scale, ok)
    p = torch.exp(s - lse.double().unsqueeze(-1))       # -inf lse on an empty row: NaN, as the kernel
    do = dout.double().transpose(1, 2)
    delta = (dout.double() * out.double()).sum(-1).transpose(1, 2)
    vh = expand_kv(v.double().transpose(1, 2), z, dim=1)
    kh = expand_kv(k.double().transpose(1, 2), z, dim=1)
    ds = p * (do @ vh.transpose(-1, -2) - delta.unsqueeze(-1))
    dq.copy_((ds @ kh * scale).transpose(1, 2))
    dk.copy_(fold_kv(ds.transpose(-1, -2) @ q.double().transpose(1, 2) * scale, zkv, dim=1).transpose(1, 2))
    dv.copy_(fold_kv(p.transpose(-1, -2) @ do, zkv, dim=1).transpose(1, 2))


def _record(name, left, right, *tensors, **extra):
    CALLS.append(dict(name=name, window=(left, right), ptrs=[t.data_ptr() for t in tensors], **extra))


def _docs(cu):
    return list(zip(cu[:-1].tolist(), cu[1:].tolist()))


def _varlen_fwd(q, k, v, cu, scale, causal=True):
    out, lse = torch.empty_like(q), torch.empty(q.shape[1], q.shape[0], dtype=torch.float32)
    for a, b in _docs(cu):
        ok = live(b - a, b - a, causal, -1, -1)
        o, l_ = _fwd(q[None, a:b], k[None, a:b], v[None, a:b], scale, ok)
        out[a:b], lse[:, a:b] = o[0], l_[0]
    return out, lse


def _varlen_bwd(dout, q, k, v, out, lse, dq, dk, dv, cu, scale, causal=True):
    for a, b in _docs(cu):
        ok = live(b - a, b - a, causal, -1, -1, backward=True)
        _bwd(dout[None, a:b], q[None, a:b], k[None, a:b], v[None, a:b], out[None, a:b], lse[None, :, a:b],
             scale, ok, dq[None, a:b], dk[None, a:b], dv[None, a:b])


# ---------------------------------------------------------------- 2.7+: custom ops

@torch.library.custom_op("fakeflash::fwd", mutates_args=())
def _fwd27(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float, softmax_scale: float, causal: bool,
           window_size_left: int, window_size_right: int, softcap: float, alibi_slopes: Optional[torch.Tensor],
           return_softmax: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    _record("fwd", window_size_left, window_size_right, q, k, v)
    ok = live(q.shape[1], k.shape[1], causal, window_size_left, window_size_right)
    out, lse = _fwd(q, k, v, softmax_scale, ok)
    return out, lse, torch.empty(0), torch.empty(2, dtype=torch.int64)


@torch.library.custom_op("fakeflash::bwd", mutates_args=("dq", "dk", "dv"))
def _bwd27(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
           softmax_lse: torch.Tensor, dq: Optional[torch.Tensor], dk: Optional[torch.Tensor],
           dv: Optional[torch.Tensor], dropout_p: float, softmax_scale: float, causal: bool,
           window_size_left: int, window_size_right: int, softcap: float, alibi_slopes: Optional[torch.Tensor],
           deterministic: bool, rng_state: Optional[torch.Tensor] = None) -> torch.Tensor:
    _record("bwd", window_size_left, window_size_right, q, k, v)
    ok = live(q.shape[1], k.shape[1], causal, window_size_left, window_size_right, backward=True)
    _bwd(dout, q, k, v, out, softmax_lse, softmax_scale, ok, dq, dk, dv)
    return torch.empty(0)


@torch.library.custom_op("fakeflash::varlen_fwd", mutates_args=())
def _varlen_fwd27(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                  cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, dropout_p: float,
                  softmax_scale: float, causal: bool, window_size_left: int = -1, window_size_right: int = -1,
                  softcap: float = 0.0, alibi_slopes: Optional[torch.Tensor] = None, return_softmax: bool = False,
                  block_table: Optional[torch.Tensor] = None, leftpad_k: Optional[torch.Tensor] = None,
                  seqused_k: Optional[torch.Tensor] = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    _record("varlen_fwd", window_size_left, window_size_right, q, cu=cu_seqlens_q.data_ptr())
    out, lse = _varlen_fwd(q, k, v, cu_seqlens_q, softmax_scale, causal)
    return out, lse, torch.empty(0), torch.empty(2, dtype=torch.int64)


@torch.library.custom_op("fakeflash::varlen_bwd", mutates_args=("dq", "dk", "dv"))
def _varlen_bwd27(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                  softmax_lse: torch.Tensor, dq: Optional[torch.Tensor], dk: Optional[torch.Tensor],
                  dv: Optional[torch.Tensor], cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                  max_seqlen_q: int, max_seqlen_k: int, dropout_p: float, softmax_scale: float, causal: bool,
                  window_size_left: int, window_size_right: int, softcap: float,
                  alibi_slopes: Optional[torch.Tensor], deterministic: bool,
                  rng_state: Optional[torch.Tensor] = None) -> torch.Tensor:
    _record("varlen_bwd", window_size_left, window_size_right, q, cu=cu_seqlens_q.data_ptr())
    _varlen_bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, softmax_scale, causal)
    return torch.empty(0)


V27 = SimpleNamespace(_flash_attn_forward=_fwd27, _flash_attn_backward=_bwd27,
                      _flash_attn_varlen_forward=_varlen_fwd27, _flash_attn_varlen_backward=_varlen_bwd27)


# ---------------------------------------------------------------- 2.4-2.6: plain functions, 8-tuple forward

def _fwd25(q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes, return_softmax):
    _record("fwd", *window_size, q, k, v)
    out, lse = _fwd(q, k, v, softmax_scale, live(q.shape[1], k.shape[1], causal, *window_size))
    return out, q, k, v, out, lse, None, None


def _bwd25(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal, window_size,
           alibi_slopes, deterministic, rng_state=None):
    _record("bwd", *window_size, q, k, v)
    ok = live(q.shape[1], k.shape[1], causal, *window_size, backward=True)
    _bwd(dout, q, k, v, out, softmax_lse, softmax_scale, ok, dq, dk, dv)
    return dq, dk, dv, None


def _varlen_fwd25(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                  causal, window_size=(-1, -1), alibi_slopes=None, return_softmax=False):
    _record("varlen_fwd", *window_size, q, cu=cu_seqlens_q.data_ptr())
    out, lse = _varlen_fwd(q, k, v, cu_seqlens_q, softmax_scale, causal)
    return out, q, k, v, out, lse, None, None


def _varlen_bwd25(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                  max_seqlen_k, dropout_p, softmax_scale, causal, window_size, alibi_slopes, deterministic,
                  rng_state=None):
    _record("varlen_bwd", *window_size, q, cu=cu_seqlens_q.data_ptr())
    _varlen_bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, softmax_scale, causal)
    return dq, dk, dv, None


V25 = SimpleNamespace(_flash_attn_forward=_fwd25, _flash_attn_backward=_bwd25,
                      _flash_attn_varlen_forward=_varlen_fwd25, _flash_attn_varlen_backward=_varlen_bwd25)


# 2.6: the same with softcap, a parameter without default in the dense pair
def _fwd26(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, return_softmax):
    assert softcap == 0.0
    return _fwd25(q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes, return_softmax)


def _bwd26(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal, window_size, softcap,
           alibi_slopes, deterministic, rng_state=None):
    assert softcap == 0.0
    return _bwd25(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal, window_size,
                  alibi_slopes, deterministic, rng_state)


def _varlen_fwd26(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                  causal, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, return_softmax=False):
    return _varlen_fwd25(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                         softmax_scale, causal, window_size, alibi_slopes, return_softmax)


def _varlen_bwd26(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                  max_seqlen_k, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                  rng_state=None):
    return _varlen_bwd25(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                         max_seqlen_k, dropout_p, softmax_scale, causal, window_size, alibi_slopes, deterministic,
                         rng_state)


V26 = SimpleNamespace(_flash_attn_forward=_fwd26, _flash_attn_backward=_bwd26,
                      _flash_attn_varlen_forward=_varlen_fwd26, _flash_attn_varlen_backward=_varlen_bwd26)
INTERFACES = {"2.7+": V27, "2.6": V26, "2.4-2.5": V25}


# ---------------------------------------------------------------- PyTorch's copy: aten._flash_attention_*

def _aten_window(left, right):
    """The ops' optional window keywords: None is unbounded (-1)."""
    return (-1 if left is None else left), (-1 if right is None else right)


def _aten_fwd(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, return_debug_mask, *,
              scale=None, window_size_left=None, window_size_right=None):
    """``aten._flash_attention_forward``: (B, S, heads, d), lse (B, Z, Sq); varlen: (total, heads, d), lse
    (Z, total)."""
    left, right = _aten_window(window_size_left, window_size_right)
    _record("aten_fwd", left, right, query, key, value, cu=None if cum_seq_q is None else cum_seq_q.data_ptr(),
            windowed=window_size_left is not None)
    if cum_seq_q is None:
        out, lse = _fwd(query, key, value, scale, live(query.shape[1], key.shape[1], is_causal, left, right))
    else:
        out, lse = _varlen_fwd(query, key, value, cum_seq_q, scale, is_causal)
    return out, lse, torch.zeros(2, dtype=torch.uint64), torch.empty(0), torch.empty(0)


def _aten_bwd(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
              rng_state, unused, *, scale=None, window_size_left=None, window_size_right=None):
    left, right = _aten_window(window_size_left, window_size_right)
    _record("aten_bwd", left, right, query, key, value, cu=None if cum_seq_q is None else cum_seq_q.data_ptr(),
            rng=rng_state.data_ptr())
    dq, dk, dv = torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)
    if cum_seq_q is None:
        ok = live(query.shape[1], key.shape[1], is_causal, left, right, backward=True)
        _bwd(grad_out, query, key, value, out, logsumexp, scale, ok, dq, dk, dv)
    else:
        _varlen_bwd(grad_out, query, key, value, out, logsumexp, dq, dk, dv, cum_seq_q, scale, is_causal)
    return dq, dk, dv


ATEN = SimpleNamespace(_flash_attention_forward=_aten_fwd, _flash_attention_backward=_aten_bwd)
