"""``cpu_flash``: PyTorch's fused tiled CPU kernels (``aten._scaled_dot_product_flash_attention_for_cpu``
and its backward); GQA natively, any float dtype."""
from __future__ import annotations

import torch

from .common import FLOAT_DTYPES, Backend, surrogate_out


def forward(q, k, v, causal, scale):
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.0, causal, scale=scale
    )
    return out.transpose(1, 2), lse


def backward(dout, q, k, v, lse, delta, causal, scale):
    out_s = surrogate_out(dout, delta)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout.transpose(1, 2), q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
        out_s.transpose(1, 2), lse, 0.0, causal, scale=scale,
    )
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


BACKEND = Backend("cpu_flash", forward, backward, devices=("cpu",), dtypes=FLOAT_DTYPES)
