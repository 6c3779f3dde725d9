"""``reference``: plain attention math in fp64, for tests; materialises the scores (any device, any dtype)."""
from __future__ import annotations

import torch

from ..heads import expand_kv, fold_kv
from .common import FLOAT_DTYPES, Backend


def _scores(q, k, causal, scale):
    # (B, Z, Sq, Sk) in fp64; GQA by repeating kv heads.
    qh = q.double().transpose(1, 2)
    kh = expand_kv(k.double().transpose(1, 2), q.shape[2], dim=1)
    s = qh @ kh.transpose(-1, -2) * scale
    if causal:
        sq, sk = s.shape[-2:]
        mask = torch.ones(sq, sk, dtype=torch.bool, device=s.device).tril()
        s = s.masked_fill(~mask, float("-inf"))
    return s


def forward(q, k, v, causal, scale):
    s = _scores(q, k, causal, scale)
    lse = torch.logsumexp(s, dim=-1)  # (B, Z, Sq)
    p = torch.exp(s - lse.unsqueeze(-1))
    vh = expand_kv(v.double().transpose(1, 2), q.shape[2], dim=1)
    out = (p @ vh).transpose(1, 2)
    return out.to(q.dtype), lse


def backward(dout, q, k, v, lse, delta, causal, scale):
    z, zkv = q.shape[2], k.shape[2]
    s = _scores(q, k, causal, scale)
    p = torch.exp(s - lse.double().unsqueeze(-1))  # (B, Z, Sq, Sk)
    do = dout.double().transpose(1, 2)  # (B, Z, Sq, d)
    vh = expand_kv(v.double().transpose(1, 2), z, dim=1)
    kh = expand_kv(k.double().transpose(1, 2), z, dim=1)
    qh = q.double().transpose(1, 2)
    dv = p.transpose(-1, -2) @ do  # (B, Z, Sk, d)
    dp = do @ vh.transpose(-1, -2)
    ds = p * (dp - delta.double().unsqueeze(-1))
    dq = ds @ kh * scale
    dk = ds.transpose(-1, -2) @ qh * scale
    # sum the query heads that share one kv head: (B, Z, S, d) -> (B, S, Zkv, d)
    return (dq.transpose(1, 2).to(q.dtype), fold_kv(dk, zkv, dim=1).transpose(1, 2).to(k.dtype),
            fold_kv(dv, zkv, dim=1).transpose(1, 2).to(v.dtype))


BACKEND = Backend("reference", forward, backward, devices=None, dtypes=FLOAT_DTYPES)
