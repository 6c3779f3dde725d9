"""The suite's single FLOP convention (docs/papers.md §3, "FLOP convention"; flash-attn's benchmarks).

forward attention = 4 * B * Z * d * (live score entries)   (QK^T and PV, 2 FLOP per MAC)
  full mask: N^2 entries; causal: N^2 / 2 (flash-attn's and the papers' halving, diagonal
  not counted); every other mask (sliding window, documents, block-sparse): its live
  entries counted exactly (``Mask.area``), diagonals included;
backward = 2.5 x forward (five matmuls against two, where the paper rounds);
forward + backward = 3.5 x forward.

Layer-level cases time the attention LAYER (QKV and output projections around
the attention), so their FLOPs add the projections' matmuls (``projection_flops``:
2 FLOP per MAC; backward = 2 x forward, dX and dW), and a layer's TFLOP/s is the
layer's FLOPs over the layer's time (``case_flops`` picks by level; records
name the scope, ``flops_scope``).

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
# The attention FLOPs of each mode as a multiple of the forward's (the convention above).
MODE_FACTOR = {"forward": 1.0, "backward": 2.5, "fwd_bwd": 3.5}
# The model-level modes (burst_impl.model.flops) in the attention convention.
MODEL_MODE = {"train": "fwd_bwd", "prefill": "forward"}
_PROJ_FACTOR = {"forward": 1.0, "backward": 2.0, "fwd_bwd": 3.0}
SCOPES = {"op": "attention", "layer": "attention layer (QKV + output projections + attention)"}


def _factor(mode: str) -> float:
    if mode not in MODE_FACTOR:
        raise ValueError(f"mode={mode!r} is unknown; choose one of {MODES}")
    return MODE_FACTOR[mode]


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


def projection_flops(batch: int, seqlen: int, heads: int, kv_heads: int, head_dim: int, *,
                     mode: str = "forward") -> float:
    """FLOPs of the attention layer's projections over the whole sequence: x (B, N, H) @ Wq (H, Z*d),
    Wk, Wv (H, Zkv*d), and the output (B, N, Z*d) @ Wo (Z*d, H), with H = Z*d."""
    if mode not in _PROJ_FACTOR:
        raise ValueError(f"mode={mode!r} is unknown; choose one of {MODES}")
    h = heads * head_dim
    fwd = 2.0 * batch * seqlen * h * (heads * head_dim + 2 * kv_heads * head_dim) + 2.0 * batch * seqlen * h * h
    return fwd * _PROJ_FACTOR[mode]


def case_flops(level: str, shape, mode: str) -> tuple[float, str]:
    """(FLOPs, scope) of what a case times: the attention (level "op") or the whole attention layer
    (level "layer"); ``shape`` is a ``burst_impl.shape.AttnShape``."""
    if level not in SCOPES:
        raise ValueError(f"level={level!r} is unknown; choose one of {list(SCOPES)}")
    f = attention_flops(shape, mode=mode)
    if level == "layer":
        f += projection_flops(shape.batch, shape.seqlen, shape.heads, shape.kv_heads, shape.head_dim, mode=mode)
    return f, SCOPES[level]


def tflops_per_s(flops: float, seconds: float) -> float:
    """TFLOP/s for ``flops`` done in ``seconds`` (nan when the time is not positive)."""
    return flops / seconds / 1e12 if seconds > 0 else float("nan")


def tokens_per_s(batch: int, seqlen: int, seconds: float) -> float:
    return batch * seqlen / seconds if seconds > 0 else float("nan")
