"""The suite's single FLOP convention (PAPER.md, end of section 3; flash-attn's benchmarks).

forward attention = 4 * B * N^2 * Z * d   (two matmuls, QK^T and PV, 2 FLOP per MAC)
halved when causal (only the lower triangle is computed);
backward = 2.5 x forward (five matmuls against two, where the paper rounds);
forward + backward = 3.5 x forward.

Every TFLOP/s number in results and figures comes from here, so methods that
do extra work (recomputation, materialised scores) are NOT credited for it:
the FLOPs are those of the attention problem, not of the implementation.
"""
from __future__ import annotations

MODES = ("forward", "backward", "fwd_bwd")
_FACTOR = {"forward": 1.0, "backward": 2.5, "fwd_bwd": 3.5}


def attention_flops(batch: int, seqlen: int, heads: int, head_dim: int, *, causal: bool,
                    mode: str = "forward") -> float:
    """FLOPs of one attention layer for the whole (global) sequence, all ranks together."""
    if mode not in _FACTOR:
        raise ValueError(f"mode={mode!r} is unknown; choose one of {MODES}")
    fwd = 4.0 * batch * seqlen * seqlen * heads * head_dim
    if causal:
        fwd /= 2.0
    return fwd * _FACTOR[mode]


def tflops_per_s(flops: float, seconds: float) -> float:
    """TFLOP/s for ``flops`` done in ``seconds`` (nan when the time is not positive)."""
    return flops / seconds / 1e12 if seconds > 0 else float("nan")


def tokens_per_s(batch: int, seqlen: int, seconds: float) -> float:
    return batch * seqlen / seconds if seconds > 0 else float("nan")
