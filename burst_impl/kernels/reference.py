"""``reference``: plain attention math in fp64, for tests; materialises the scores (any device, any dtype,
every tile mask: it builds the tile's dense boolean mask)."""
from __future__ import annotations

import torch

from ..heads import expand_kv, fold_kv
from .common import FLOAT_DTYPES, Backend


def _scores(q, k, causal, scale, tile_mask=None):
    # (B, Z, Sq, Sk) in fp64; GQA by repeating kv heads.
    qh = q.double().transpose(1, 2)
    kh = expand_kv(k.double().transpose(1, 2), q.shape[2], dim=1)
    s = qh @ kh.transpose(-1, -2) * scale
    sq, sk = s.shape[-2:]
    if tile_mask is not None:
        s = s.masked_fill(~tile_mask.dense().to(s.device), float("-inf"))
    elif causal:
        mask = torch.ones(sq, sk, dtype=torch.bool, device=s.device).tril()
        s = s.masked_fill(~mask, float("-inf"))
    return s


def forward(q, k, v, causal, scale, tile_mask=None):
    s = _scores(q, k, causal, scale, tile_mask)
    lse = torch.logsumexp(s, dim=-1)  # (B, Z, Sq); -inf for a row with no live key
    # such a row: P = 0, out = 0 (out of place: exp saves its output for autograd)
    p = torch.exp(s - lse.unsqueeze(-1)).nan_to_num(nan=0.0)
    vh = expand_kv(v.double().transpose(1, 2), q.shape[2], dim=1)
    out = (p @ vh).transpose(1, 2)
    return out.to(q.dtype), lse


def backward(dout, q, k, v, lse, delta, causal, scale, tile_mask=None):
    z, zkv = q.shape[2], k.shape[2]
    s = _scores(q, k, causal, scale, tile_mask)
    lse = lse.double()
    lse = torch.where(torch.isneginf(lse), torch.full_like(lse, float("inf")), lse)  # no live key: P = 0
    p = torch.exp(s - lse.unsqueeze(-1))  # (B, Z, Sq, Sk)
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


def masked_forward(q, k, v, tm, scale):
    return forward(q, k, v, False, scale, tm)


def masked_backward(dout, q, k, v, lse, delta, tm, scale):
    return backward(dout, q, k, v, lse, delta, False, scale, tm)


BACKEND = Backend("reference", forward, backward, devices=None, dtypes=FLOAT_DTYPES,
                  masked_forward=masked_forward, masked_backward=masked_backward)
