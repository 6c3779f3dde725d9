"""``flash_attn``: the flash-attn package's kernels on CUDA (fp16/bf16, head_dim a multiple of 8 up to 256)."""
from __future__ import annotations

import functools
import inspect

import torch

from .common import Backend, surrogate_out


@functools.lru_cache(maxsize=None)
def available() -> bool:
    try:
        import flash_attn  # noqa: F401
        from flash_attn import flash_attn_interface  # noqa: F401
    except Exception:
        return False
    return True


def _window_kwargs(fn) -> dict:
    """flash-attn >= 2.6 takes window_size_left/right and softcap; 2.4-2.5 a window_size tuple."""
    params = inspect.signature(fn).parameters
    if "window_size_left" in params:
        kw = dict(window_size_left=-1, window_size_right=-1)
    else:
        kw = dict(window_size=(-1, -1))
    if "softcap" in params:
        kw["softcap"] = 0.0
    return kw


def forward(q, k, v, causal, scale):
    from flash_attn import flash_attn_interface as fai

    # flash-attn 2.x: returns (out, softmax_lse (B, Z, Sq) fp32, S_dmask, rng_state)
    res = fai._flash_attn_forward(
        q.contiguous(), k.contiguous(), v.contiguous(), dropout_p=0.0, softmax_scale=scale,
        causal=causal, alibi_slopes=None, return_softmax=False,
        **_window_kwargs(fai._flash_attn_forward),
    )
    return res[0], res[1]


def backward(dout, q, k, v, lse, delta, causal, scale):
    from flash_attn import flash_attn_interface as fai

    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    out_s = surrogate_out(dout, delta)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    fai._flash_attn_backward(
        dout.contiguous(), q, k, v, out_s, lse, dq, dk, dv, dropout_p=0.0, softmax_scale=scale,
        causal=causal, alibi_slopes=None, deterministic=False, rng_state=None,
        **_window_kwargs(fai._flash_attn_backward),
    )
    return dq, dk, dv


def _check(head_dim: int | None) -> str | None:
    if head_dim is not None and (head_dim % 8 or head_dim > 256):
        return f"backend='flash_attn' needs head_dim a multiple of 8 up to 256, got {head_dim}"
    return None


BACKEND = Backend("flash_attn", forward, backward, devices=("cuda",), dtypes=(torch.float16, torch.bfloat16),
                  available=available, requirement="pip install flash-attn", check=_check)
