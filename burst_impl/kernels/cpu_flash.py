"""``cpu_flash``: PyTorch's fused tiled CPU kernels (``aten._scaled_dot_product_flash_attention_for_cpu``
and its backward); GQA natively, any float dtype. Tiles with a partial mask run on row segments of the
same kernel with an additive mask (``kernels.masked``)."""
from __future__ import annotations

import torch

from . import masked
from .common import FLOAT_DTYPES, Backend, surrogate_out


def forward(q, k, v, causal, scale, attn_mask=None):
    """``attn_mask``: an additive (Sq, Sk) mask (0 / -inf), as the exact path's segments pass it."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.0, causal, attn_mask=attn_mask, scale=scale
    )
    return out.transpose(1, 2), lse


def backward(dout, q, k, v, lse, delta, causal, scale, attn_mask=None):
    out_s = surrogate_out(dout, delta)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout.transpose(1, 2), q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
        out_s.transpose(1, 2), lse, 0.0, causal, attn_mask=attn_mask, scale=scale,
    )
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


def masked_forward(q, k, v, tm, scale):
    return masked.forward(q, k, v, tm, scale, fused=forward)


def masked_backward(dout, q, k, v, lse, delta, tm, scale):
    return masked.backward(dout, q, k, v, lse, delta, tm, scale, fused=backward)


BACKEND = Backend("cpu_flash", forward, backward, devices=("cpu",), dtypes=FLOAT_DTYPES,
                  masked_forward=masked_forward, masked_backward=masked_backward)
