"""The suite's single FLOP convention (PAPER.md, end of section 3; flash-attn's benchmarks).

forward attention = 4 * B * Z * d * (live score entries)   (QK^T and PV, 2 FLOP per MAC)
  full mask: N^2 entries; causal: N^2 / 2 (flash-attn's and the papers' halving, diagonal
  not counted); every other mask (sliding window, documents, block-sparse): its live
  entries counted exactly (``Mask.area``), diagonals included;
backward = 2.5 x forward (five matmuls against two, where the paper rounds);
forward + backward = 3.5 x forward.

Every TFLOP/s number in results and figures comes from here, so methods that
do extra work (recomputation, materialised scores, masked entries computed
anyway) are NOT credited for it: the FLOPs are those of the attention problem,
not of the implementation. TFLOP/s per rank divides by the world size and
uses the slowest rank's time (the harness times the maximum over ranks).
"""
from __future__ import annotations

from burst_impl.masks import Causal, Full
from burst_impl.shape import AttnShape

MODES = ("forward", "backward", "fwd_bwd")
_FACTOR = {"forward": 1.0, "backward": 2.5, "fwd_bwd": 3.5}


def _factor(mode: str) -> float:
    if mode not in _FACTOR:
        raise ValueError(f"mode={mode!r} is unknown; choose one of {MODES}")
    return _FACTOR[mode]


def entries_flops(batch: int, heads: int, head_dim: int, entries: float, mode: str = "forward") -> float:
    """FLOPs of ``entries`` live (query, key) score entries for ``batch`` x ``heads`` heads of ``head_dim``."""
    return 4.0 * batch * heads * head_dim * entries * _factor(mode)


def mask_area(shape: AttnShape) -> float:
    """Live score entries of the whole N x N problem under the convention above."""
    m, n = shape.attn_mask, shape.seqlen
    if isinstance(m, Full):
        return float(n) * n
    if isinstance(m, Causal):
        return float(n) * n / 2.0
    return float(m.area(n))


def attention_flops(shape: AttnShape, mode: str = "forward") -> float:
    """FLOPs of one attention layer for the whole (global) sequence, all ranks together."""
    _factor(mode)
    return entries_flops(shape.batch, shape.heads, shape.head_dim, mask_area(shape), mode)


def tflops_per_s(flops: float, seconds: float) -> float:
    """TFLOP/s for ``flops`` done in ``seconds`` (nan when the time is not positive)."""
    return flops / seconds / 1e12 if seconds > 0 else float("nan")


def tokens_per_s(batch: int, seqlen: int, seconds: float) -> float:
    return batch * seqlen / seconds if seconds > 0 else float("nan")
