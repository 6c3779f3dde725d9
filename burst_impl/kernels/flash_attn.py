"""``flash_attn``: the flash-attn package's kernels on CUDA (fp16/bf16, head_dim a multiple of 8 up to 256).

Partial-mask tiles: a band (sliding window) runs as flash-attn's ``window_size`` and a document
diagonal as its varlen entry point (``_flash_attn_varlen_forward``/``_backward``, every batch row
packed with the same boundaries); dense tiles, and bands flash-attn's bottom-right window cannot
express, run in the exact path's math (``kernels.masked``). Written to flash-attn 2.4-2.7's
internal API; not run here (no GPU; ``tests/test_cuda_path.py`` checks them against the fp64
reference on a GPU machine).
"""
from __future__ import annotations

import functools
import inspect

import torch

from . import masked
from .common import Backend, stats_dtype, surrogate_out


@functools.lru_cache(maxsize=None)
def available() -> bool:
    try:
        import flash_attn  # noqa: F401, PLC0415 (optional dependency)
        from flash_attn import flash_attn_interface  # noqa: F401, PLC0415 (optional dependency)
    except Exception:  # noqa: BLE001 - any import failure means "not here"
        return False
    return True


@functools.lru_cache(maxsize=None)
def _params(fn) -> frozenset[str]:
    """The parameter names of a flash-attn entry point (inspected once: every tile of every ring step asks)."""
    return frozenset(inspect.signature(fn).parameters)


def _window_kwargs(fn, left: int = -1, right: int = -1) -> dict:
    """flash-attn >= 2.6 takes window_size_left/right and softcap; 2.4-2.5 a window_size tuple."""
    params = _params(fn)
    if "window_size_left" in params:
        kw = dict(window_size_left=left, window_size_right=right)
    else:
        kw = dict(window_size=(left, right))
    if "softcap" in params:
        kw["softcap"] = 0.0
    return kw


def flash_window(n_rows: int, n_cols: int, lo: int | None, hi: int | None) -> tuple[int, int] | None:
    """flash-attn's (left, right) window for the band ``lo <= j - i <= hi`` on an (n_rows, n_cols) tile.

    flash-attn aligns the window to the bottom-right corner: key j is live for query i iff
    i + (Sk - Sq) - left <= j <= i + (Sk - Sq) + right, -1 meaning unbounded. None when the band
    needs a negative size (not expressible)."""
    shift = n_cols - n_rows
    left = -1 if lo is None else shift - lo
    right = -1 if hi is None else hi - shift
    if (lo is not None and left < 0) or (hi is not None and right < 0):
        return None
    return left, right


def forward(q, k, v, causal, scale, window: tuple[int, int] = (-1, -1)):
    """``window``: flash-attn's (left, right) window (``flash_window``; -1: unbounded)."""
    from flash_attn import flash_attn_interface as fai  # noqa: PLC0415 (optional dependency)

    # flash-attn 2.x: returns (out, softmax_lse (B, Z, Sq) fp32, S_dmask, rng_state)
    res = fai._flash_attn_forward(
        q.contiguous(), k.contiguous(), v.contiguous(), dropout_p=0.0, softmax_scale=scale,
        causal=causal, alibi_slopes=None, return_softmax=False,
        **_window_kwargs(fai._flash_attn_forward, *window),
    )
    return res[0], res[1]


def backward(dout, q, k, v, lse, delta, causal, scale, window: tuple[int, int] = (-1, -1)):
    from flash_attn import flash_attn_interface as fai  # noqa: PLC0415 (optional dependency)

    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    out_s = surrogate_out(dout, delta)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    fai._flash_attn_backward(
        dout.contiguous(), q, k, v, out_s, lse, dq, dk, dv, dropout_p=0.0, softmax_scale=scale,
        causal=causal, alibi_slopes=None, deterministic=False, rng_state=None,
        **_window_kwargs(fai._flash_attn_backward, *window),
    )
    return dq, dk, dv


def _varlen_args(tm, b: int, s: int, device):
    """Every batch row packed after the previous one, with the tile's document boundaries."""
    cu = torch.tensor(tm.cu, dtype=torch.int32)
    packed = torch.cat([cu[:-1] + i * s for i in range(b)] + [torch.tensor([b * s], dtype=torch.int32)])
    return packed.to(device), int((cu[1:] - cu[:-1]).max())


def masked_forward(q, k, v, tm, scale):
    from flash_attn import flash_attn_interface as fai  # noqa: PLC0415 (optional dependency)

    window = flash_window(tm.n_rows, tm.n_cols, tm.lo, tm.hi) if tm.kind == "band" else None
    if window is not None:
        return forward(q, k, v, False, scale, window)
    if tm.kind == "varlen":
        b, s, z, d = q.shape
        cu, longest = _varlen_args(tm, b, s, q.device)
        res = fai._flash_attn_varlen_forward(
            q.reshape(b * s, z, d).contiguous(), k.reshape(b * s, k.shape[2], d).contiguous(),
            v.reshape(b * s, k.shape[2], d).contiguous(), cu, cu, longest, longest, dropout_p=0.0,
            softmax_scale=scale, causal=True, alibi_slopes=None, return_softmax=False,
            **_window_kwargs(fai._flash_attn_varlen_forward))
        lse = res[1].reshape(z, b, s).permute(1, 0, 2)          # (Z, B*S) -> (B, Z, S)
        return res[0].reshape(b, s, z, d), lse.to(stats_dtype(q.dtype))
    return masked.forward(q, k, v, tm, scale, fused=False)


def masked_backward(dout, q, k, v, lse, delta, tm, scale):
    from flash_attn import flash_attn_interface as fai  # noqa: PLC0415 (optional dependency)

    window = flash_window(tm.n_rows, tm.n_cols, tm.lo, tm.hi) if tm.kind == "band" else None
    if window is not None:
        return backward(dout, q, k, v, lse, delta, False, scale, window)
    if tm.kind == "varlen":
        b, s, z, d = q.shape
        zkv = k.shape[2]
        cu, longest = _varlen_args(tm, b, s, q.device)
        flat = [t.reshape(b * s, t.shape[2], d).contiguous() for t in (dout, q, k, v, surrogate_out(dout, delta))]
        dq, dk, dv = torch.empty_like(flat[1]), torch.empty_like(flat[2]), torch.empty_like(flat[3])
        lse_v = lse.permute(1, 0, 2).reshape(z, b * s).contiguous()
        fai._flash_attn_varlen_backward(
            flat[0], flat[1], flat[2], flat[3], flat[4], lse_v, dq, dk, dv, cu, cu, longest, longest,
            dropout_p=0.0, softmax_scale=scale, causal=True, alibi_slopes=None, deterministic=False,
            rng_state=None, **_window_kwargs(fai._flash_attn_varlen_backward))
        return dq.reshape(b, s, z, d), dk.reshape(b, s, zkv, d), dv.reshape(b, s, zkv, d)
    return masked.backward(dout, q, k, v, lse, delta, tm, scale, fused=False)


def _check(head_dim: int | None) -> str | None:
    if head_dim is not None and (head_dim % 8 or head_dim > 256):
        return f"backend='flash_attn' needs head_dim a multiple of 8 up to 256, got {head_dim}"
    return None


BACKEND = Backend("flash_attn", forward, backward, devices=("cuda",), dtypes=(torch.float16, torch.bfloat16),
                  available=available, requirement="pip install flash-attn", check=_check,
                  masked_forward=masked_forward, masked_backward=masked_backward)
