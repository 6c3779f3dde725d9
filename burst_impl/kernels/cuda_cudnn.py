"""``cuda_cudnn``: cuDNN's fused flash attention through PyTorch (``aten._scaled_dot_product_cudnn_attention``).

SDPA's cuDNN backend (Hopper and later), reached directly: the forward asked for its lse
(``compute_log_sumexp``), the backward recomputes the probabilities from a given lse and takes
``delta`` through the surrogate ``out`` (``common.py``), so a ring can pass the merged lse. cuDNN
keeps the lse as (B, Z, Sq, 1); the suite's (B, Z, Sq) goes back in that shape. GQA by repeating kv
heads (``burst_impl.heads``). Causal tiles are square (the plans' rule).
"""
from __future__ import annotations

import functools

import torch

from ..heads import expand_kv, fold_kv
from .common import Backend, head_dim_rule, surrogate_out


def _bhsd(x):
    """(B, S, Z, d) -> the (B, Z, S, d) view the op takes."""
    return x.transpose(1, 2)


@functools.lru_cache(maxsize=None)
def _rng(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(seed, offset) for the backward: dropout is 0, so neither is read, but the op takes tensors; made
    once per device, not per tile of every ring step."""
    return torch.zeros((), dtype=torch.int64, device=device), torch.zeros((), dtype=torch.int64, device=device)


def forward(q, k, v, causal, scale):
    z = q.shape[2]
    out, lse, *_ = torch.ops.aten._scaled_dot_product_cudnn_attention(
        _bhsd(q), _bhsd(expand_kv(k, z)), _bhsd(expand_kv(v, z)), None, True, 0.0, causal, False, scale=scale,
    )
    return out.transpose(1, 2), lse.reshape(lse.shape[:3]).float()


def backward(dout, q, k, v, lse, delta, causal, scale):
    z, sq, sk = q.shape[2], q.shape[1], k.shape[1]
    ke, ve = expand_kv(k, z), expand_kv(v, z)
    # cuDNN wants dO and O in one layout: both contiguous (B, S, Z, d), viewed as (B, Z, S, d)
    dout = dout.contiguous()
    out_s = surrogate_out(dout, delta).contiguous()
    seed, offset = _rng(q.device)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        _bhsd(dout), _bhsd(q), _bhsd(ke), _bhsd(ve), _bhsd(out_s), lse.float().unsqueeze(-1).contiguous(),
        seed, offset, None, None, None, sq, sk, 0.0, causal, scale=scale,
    )
    zkv = k.shape[2]
    return dq.transpose(1, 2), fold_kv(dk.transpose(1, 2), zkv), fold_kv(dv.transpose(1, 2), zkv)


def _available() -> bool:
    return bool(torch.backends.cudnn.is_available())


BACKEND = Backend("cuda_cudnn", forward, backward, devices=("cuda",), dtypes=(torch.float16, torch.bfloat16),
                  available=_available, requirement="a CUDA build of torch with cuDNN",
                  check=head_dim_rule("cuda_cudnn", 128))
