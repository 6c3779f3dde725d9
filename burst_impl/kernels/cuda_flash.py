"""``cuda_flash``: PyTorch's own FlashAttention-2 CUDA kernels (``aten._scaled_dot_product_flash_attention``).

The FlashAttention-2 code PyTorch ships for SDPA's flash backend, reached without the flash-attn
package: forward returns the lse (B, Z, Sq) in fp32, backward recomputes the probabilities from a
given lse and takes ``delta`` through the surrogate ``out`` (``common.py``), so a ring can pass the
merged (global) lse. Equal query and kv head counts: kv heads are repeated for GQA and their
gradients summed back (``burst_impl.heads``). Causal tiles are square (the plans' rule), where
top-left and bottom-right alignment agree.
"""
from __future__ import annotations

import torch

from ..heads import expand_kv, fold_kv
from .common import Backend, head_dim_rule, surrogate_out


def forward(q, k, v, causal, scale):
    z = q.shape[2]
    out, lse, *_ = torch.ops.aten._scaled_dot_product_flash_attention(
        q.transpose(1, 2), expand_kv(k, z).transpose(1, 2), expand_kv(v, z).transpose(1, 2),
        0.0, causal, False, scale=scale,
    )
    return out.transpose(1, 2), lse.float()


def backward(dout, q, k, v, lse, delta, causal, scale):
    z, sq, sk = q.shape[2], q.shape[1], k.shape[1]
    out_s = surrogate_out(dout, delta)
    ke, ve = expand_kv(k, z), expand_kv(v, z)
    # dropout is 0: the rng state is never read, but the op takes tensors; no cumulative lengths
    # (None: the dense, non-varlen path)
    seed = torch.zeros(2, dtype=torch.uint64, device=q.device)
    offset = torch.empty(0, dtype=torch.uint64, device=q.device)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
        dout.transpose(1, 2), q.transpose(1, 2), ke.transpose(1, 2), ve.transpose(1, 2),
        out_s.transpose(1, 2), lse.contiguous(), None, None, sq, sk, 0.0, causal, seed, offset, scale=scale,
    )
    zkv = k.shape[2]
    return dq.transpose(1, 2), fold_kv(dk.transpose(1, 2), zkv), fold_kv(dv.transpose(1, 2), zkv)


BACKEND = Backend("cuda_flash", forward, backward, devices=("cuda",), dtypes=(torch.float16, torch.bfloat16),
                  check=head_dim_rule("cuda_flash", 256))
