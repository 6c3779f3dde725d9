"""``cuda_sdpa``: PyTorch's CUDA efficient-attention kernels (they return lse; no fp64 kernels).

They take equal query and kv head counts: kv heads are repeated for GQA and
their gradients summed back (``burst_impl.heads``).
"""
from __future__ import annotations

import torch

from ..heads import expand_kv, fold_kv
from .common import Backend, surrogate_out


def forward(q, k, v, causal, scale):
    z = q.shape[2]
    out, lse, *_ = torch.ops.aten._scaled_dot_product_efficient_attention(
        q.transpose(1, 2), expand_kv(k, z).transpose(1, 2), expand_kv(v, z).transpose(1, 2),
        None, True, 0.0, causal, scale=scale,
    )
    return out.transpose(1, 2), lse[..., : q.shape[1]].float()


def backward(dout, q, k, v, lse, delta, causal, scale):
    z = q.shape[2]
    out_s = surrogate_out(dout, delta)
    ke, ve = expand_kv(k, z), expand_kv(v, z)
    # The forward returns lse padded to a multiple of 32 rows; hand back that shape.
    sq = q.shape[1]
    lse = torch.nn.functional.pad(lse, (0, (-sq) % 32)).contiguous()
    seed = offset = torch.zeros((), dtype=torch.int64)  # dropout is 0: never read
    dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        dout.transpose(1, 2), q.transpose(1, 2), ke.transpose(1, 2), ve.transpose(1, 2), None,
        out_s.transpose(1, 2), lse, seed, offset, 0.0, [True, True, True, False],
        causal, scale=scale,
    )
    zkv = k.shape[2]
    return dq.transpose(1, 2), fold_kv(dk.transpose(1, 2), zkv), fold_kv(dv.transpose(1, 2), zkv)


BACKEND = Backend("cuda_sdpa", forward, backward, devices=("cuda",),
                  dtypes=(torch.float16, torch.bfloat16, torch.float32))
