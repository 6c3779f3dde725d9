"""What a decode step's two kinds of work cost: attention of a few new tokens over a cache, and a small GEMM
against a weight matrix. Both are memory-bound on an accelerator, which the hardware cost model's
compute-bound kernel and GEMM rates do not say (their efficiencies are measured on square problems).

* ``decode_attention(q, keys, heads, kv_heads, head_dim, batch)``: one sequence's q new tokens over ``keys``
  cached keys: 4 q keys Z d FLOPs (every cached key is live) at the profile's flash efficiency, or the
  K and V read (2 keys Zkv d e bytes) and q, out (2 q Z d e) at the HBM rate, whichever is longer (the
  roofline of a flash-decoding kernel);
* ``weight_gemm(m, n, k)``: (m x k) @ (k x n) at the GEMM efficiency, or the (k x n) weight's read from
  HBM, whichever is longer (a GEMV at decode's m = B x q is bound by the weight's bytes).

``DecodeCosts`` adds them to a hardware profile's ``CostModel``; the emulated cluster's twin
(``emulated/decode_costs.py``) answers both from times measured here instead. Nothing is fitted.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from burst_impl.shape import DTYPES
import torch

from .costs import CostModel


def elem_size(dtype: str) -> int:
    return torch.empty((), dtype=DTYPES[dtype]).element_size()


@dataclass(frozen=True)
class DecodeCosts(CostModel):
    def decode_attention(self, q: int, keys: int, heads: int, kv_heads: int, head_dim: int,
                         batch: int = 1) -> tuple[float, float]:
        """(seconds, FLOPs) of ``q`` new tokens of one sequence over ``keys`` cached keys (module docstring), in a
        step that attends ``batch`` sequences in turn (an accelerator reads each one's K and V from HBM whatever
        the batch; the emulated twin times the rotation)."""
        if q <= 0 or keys <= 0:
            return 0.0, 0.0
        e = elem_size(self.dtype)
        flops = 4.0 * q * keys * heads * head_dim
        compute = flops / (self.peak * self.attn_efficiency(math.sqrt(q * keys), "forward"))
        memory = self.hbm(2 * keys * kv_heads * head_dim * e + 2 * q * heads * head_dim * e)
        return max(compute, memory), flops

    def weight_gemm(self, m: int, n: int, k: int) -> tuple[float, float]:
        """(seconds, FLOPs) of (m x k) @ (k x n) where the (k x n) operand is a weight read from HBM."""
        t, f = self.gemm(m, n, k)
        return max(t, self.hbm(k * n * elem_size(self.dtype))), f
