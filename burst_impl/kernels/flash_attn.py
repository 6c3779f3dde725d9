"""``flash_attn``: the flash-attn package's kernels on CUDA (fp16/bf16, head_dim a multiple of 8 up to 256).

Partial-mask tiles: a band (sliding window) runs as flash-attn's ``window_size`` and a document
diagonal as its varlen entry point (``_flash_attn_varlen_forward``/``_backward``, every batch row
packed with the same boundaries); dense tiles, and bands flash-attn's bottom-right window cannot
express, run in the exact path's math (``kernels.masked``).

Written to the private entry points of flash-attn 2.4-2.8 (``flash_attn/flash_attn_interface.py``
read at the release tags): from 2.7 they are ``torch.library.custom_op`` objects (their signature
is read from ``_init_fn``) taking ``window_size_left/right`` and ``softcap``, and the forward returns
(out, lse, S_dmask, rng_state); 2.6 takes a ``window_size`` tuple and ``softcap``, 2.4-2.5 the tuple
only, and their forward returns 8 values with the lse sixth. tests/test_kernels_flash_attn.py fakes
each interface on CPU and checks the calls; tests/test_cuda_path.py checks the real kernels against
the fp64 reference on a GPU machine (not yet run: no GPU has been lent).
"""
from __future__ import annotations

import functools
import inspect

import torch

from .common import Backend, head_dim_rule, stats_dtype, surrogate_out
from .flash_tiles import UNBOUNDED, flash_lse, masked_pair, our_lse, varlen_args


@functools.lru_cache(maxsize=None)
def available() -> bool:
    try:
        import flash_attn  # noqa: F401, PLC0415 (optional dependency)
        from flash_attn import flash_attn_interface  # noqa: F401, PLC0415 (optional dependency)
    except Exception:  # noqa: BLE001 - any import failure means "not here"
        return False
    return True


def _fai():
    """flash-attn's interface module (one place, so tests can put a fake here)."""
    from flash_attn import flash_attn_interface as fai  # noqa: PLC0415 (optional dependency)

    return fai


@functools.lru_cache(maxsize=None)
def _params(fn) -> frozenset[str]:
    """The parameter names of a flash-attn entry point (inspected once: every tile of every ring step asks).

    From 2.7 the entry points are ``torch.library.custom_op`` objects, whose own signature is
    ``(*args, **kwargs)``; the function they wrap, ``_init_fn``, keeps the real one."""
    return frozenset(inspect.signature(getattr(fn, "_init_fn", fn)).parameters)


def _window_kwargs(fn, left: int = -1, right: int = -1) -> dict:
    """flash-attn >= 2.7 takes window_size_left/right and softcap; 2.6 a window_size tuple and softcap;
    2.4-2.5 a window_size tuple."""
    params = _params(fn)
    if "window_size_left" in params:
        kw = dict(window_size_left=left, window_size_right=right)
    else:
        kw = dict(window_size=(left, right))
    if "softcap" in params:
        kw["softcap"] = 0.0
    return kw


def _out_lse(res) -> tuple:
    """(out, softmax_lse) of a private forward: >= 2.7 returns (out, lse, S_dmask, rng_state),
    2.4-2.6 (out, q, k, v, out_padded, lse, S_dmask, rng_state)."""
    if len(res) == 4:
        return res[0], res[1]
    if len(res) == 8:
        return res[0], res[5]
    raise RuntimeError(f"flash-attn's private forward returned {len(res)} values; this backend knows the "
                       "4 of flash-attn >= 2.7 and the 8 of 2.4-2.6")


def forward(q, k, v, causal, scale, window: tuple[int, int] = UNBOUNDED):
    """``window``: flash-attn's (left, right) window (``flash_tiles.flash_window``; -1: unbounded). The entry points
    pass tensors with a unit-stride last dim, all flash-attn asks for: no copies here."""
    fai = _fai()
    res = fai._flash_attn_forward(
        q, k, v, dropout_p=0.0, softmax_scale=scale, causal=causal, alibi_slopes=None, return_softmax=False,
        **_window_kwargs(fai._flash_attn_forward, *window))
    out, lse = _out_lse(res)
    return out, (lse if window == UNBOUNDED else our_lse(lse))


def backward(dout, q, k, v, lse, delta, causal, scale, window: tuple[int, int] = UNBOUNDED):
    fai = _fai()
    out_s = surrogate_out(dout, delta)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    fai._flash_attn_backward(
        dout, q, k, v, out_s, lse if window == UNBOUNDED else flash_lse(lse), dq, dk, dv, dropout_p=0.0,
        softmax_scale=scale, causal=causal, alibi_slopes=None, deterministic=False, rng_state=None,
        **_window_kwargs(fai._flash_attn_backward, *window))
    return dq, dk, dv


def _varlen_forward(q, k, v, tm, scale):
    fai = _fai()
    b, s, z, d = q.shape
    cu, longest = varlen_args(tm, b, s, q.device)
    res = fai._flash_attn_varlen_forward(
        q.reshape(b * s, z, d), k.reshape(b * s, k.shape[2], d), v.reshape(b * s, k.shape[2], d), cu, cu,
        longest, longest, dropout_p=0.0, softmax_scale=scale, causal=tm.kind == "varlen", alibi_slopes=None,
        return_softmax=False, **_window_kwargs(fai._flash_attn_varlen_forward))
    out, lse = _out_lse(res)
    lse = lse.reshape(z, b, s).permute(1, 0, 2)          # (Z, B*S) -> (B, Z, S)
    return out.reshape(b, s, z, d), lse.to(stats_dtype(q.dtype))


def _varlen_backward(dout, q, k, v, lse, delta, tm, scale):
    fai = _fai()
    b, s, z, d = q.shape
    zkv = k.shape[2]
    cu, longest = varlen_args(tm, b, s, q.device)
    flat = [t.reshape(b * s, t.shape[2], d) for t in (dout, q, k, v, surrogate_out(dout, delta))]
    dq, dk, dv = torch.empty_like(flat[1]), torch.empty_like(flat[2]), torch.empty_like(flat[3])
    lse_v = lse.permute(1, 0, 2).reshape(z, b * s).contiguous()   # flash-attn reads (Z, total) contiguous
    fai._flash_attn_varlen_backward(
        flat[0], flat[1], flat[2], flat[3], flat[4], lse_v, dq, dk, dv, cu, cu, longest, longest,
        dropout_p=0.0, softmax_scale=scale, causal=tm.kind == "varlen", alibi_slopes=None, deterministic=False,
        rng_state=None, **_window_kwargs(fai._flash_attn_varlen_backward))
    return dq.reshape(b, s, z, d), dk.reshape(b, s, zkv, d), dv.reshape(b, s, zkv, d)


masked_forward, masked_backward = masked_pair(forward, backward, _varlen_forward, _varlen_backward)


BACKEND = Backend("flash_attn", forward, backward, devices=("cuda",), dtypes=(torch.float16, torch.bfloat16),
                  available=available, requirement="pip install flash-attn", check=head_dim_rule("flash_attn", 256),
                  masked_forward=masked_forward, masked_backward=masked_backward)
