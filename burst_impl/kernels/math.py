"""``math``: attention with materialised scores in the inputs' dtype (any device).

The paper's "Burst without LAO" and "TP without FlashAttention" (docs/papers.md §3,
Tables 2/3): every local block's (B, Z, Sq, Sk) scores and probabilities are
written out, as a plain matmul implementation does, instead of tiled in a
fused kernel. The matmuls run in the inputs' dtype (bf16 on GPU, as the
papers' baselines do); the softmax statistics (max, log-sum-exp, delta) in
``stats_dtype`` (fp32, fp64 for fp64 inputs), like every other backend, so the
numbers match the fused kernels' to the inputs' rounding. Unlike
``reference`` it does not compute in fp64: it is a timing row, not a test oracle.
"""
from __future__ import annotations

import torch

from ..heads import expand_kv, fold_kv
from .common import FLOAT_DTYPES, Backend, stats_dtype


def _scores(q, k, causal, scale):
    """(B, Z, Sq, Sk) scores in the statistics dtype, computed by one matmul in the inputs' dtype."""
    qh = q.transpose(1, 2)                                            # (B, Z, Sq, d)
    kh = expand_kv(k.transpose(1, 2), q.shape[2], dim=1)             # (B, Z, Sk, d)
    s = (qh @ kh.transpose(-1, -2)).to(stats_dtype(q.dtype)) * scale
    if causal:
        sq, sk = s.shape[-2:]
        keep = torch.ones(sq, sk, dtype=torch.bool, device=s.device).tril()
        s = s.masked_fill(~keep, float("-inf"))
    return s


def forward(q, k, v, causal, scale):
    s = _scores(q, k, causal, scale)
    lse = torch.logsumexp(s, dim=-1)                                  # (B, Z, Sq)
    p = torch.exp(s - lse.unsqueeze(-1)).to(v.dtype)                  # (B, Z, Sq, Sk) materialised
    vh = expand_kv(v.transpose(1, 2), q.shape[2], dim=1)
    return (p @ vh).transpose(1, 2), lse


def backward(dout, q, k, v, lse, delta, causal, scale):
    z, zkv = q.shape[2], k.shape[2]
    s = _scores(q, k, causal, scale)
    p = torch.exp(s - lse.unsqueeze(-1))                              # (B, Z, Sq, Sk), stats dtype
    do = dout.transpose(1, 2)                                         # (B, Z, Sq, d)
    vh = expand_kv(v.transpose(1, 2), z, dim=1)
    kh = expand_kv(k.transpose(1, 2), z, dim=1)
    dv = p.to(do.dtype).transpose(-1, -2) @ do                        # (B, Z, Sk, d)
    dp = (do @ vh.transpose(-1, -2)).to(p.dtype)
    ds = (p * (dp - delta.unsqueeze(-1)) * scale).to(q.dtype)
    dq = ds @ kh
    dk = ds.transpose(-1, -2) @ q.transpose(1, 2)
    return dq.transpose(1, 2), fold_kv(dk, zkv, dim=1).transpose(1, 2), fold_kv(dv, zkv, dim=1).transpose(1, 2)


BACKEND = Backend("math", forward, backward, devices=None, dtypes=FLOAT_DTYPES)
