"""What every kernel backend shares: the statistics dtype, strides, delta and the surrogate ``out``.

Feeding ``delta`` to stock kernels
----------------------------------
Burst's backward circulates ``delta = rowsum(dO * O)`` (one float per row)
instead of O (d floats per row), but stock flash backward kernels take ``out``
and compute ``delta`` themselves; they use ``out`` for nothing else. We pass a
surrogate ``out_s`` that lies along dO and reproduces delta exactly:

    out_s = dO * delta / ||dO||^2   (row-wise; 0 where dO's row is 0)

so ``rowsum(dO * out_s) = delta`` (when dO's row is zero, delta is zero too,
since delta = dO . O). The surrogate is built in fp32 and cast to the kernel's
dtype, so in bf16 the recovered delta carries one bf16 rounding, the same order
as the rounding of O itself in a stock backward.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch

Tensor = torch.Tensor

# Input dtypes every backend path accepts (the fused kernels of each backend accept a subset).
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclass(frozen=True)
class Backend:
    """One local-kernel backend: ``forward(q, k, v, causal, scale) -> (out, lse)`` and
    ``backward(dout, q, k, v, lse, delta, causal, scale) -> (dq, dk, dv)`` (see ``burst_impl.kernels``);
    optionally ``masked_forward(q, k, v, tile_mask, scale)`` and ``masked_backward(dout, q, k, v, lse,
    delta, tile_mask, scale)`` for tiles with a partial mask (``TileMask``); without them such tiles
    run in the exact path's plain math (``kernels.masked``)."""

    name: str
    forward: Callable
    backward: Callable
    devices: tuple[str, ...] | None          # device types it runs on; None: any
    dtypes: tuple[torch.dtype, ...]           # input dtypes its kernels take
    available: Callable[[], bool] = lambda: True   # is its package importable here?
    requirement: str = ""                     # what to install when it is not
    check: Callable[[int | None], str | None] = lambda head_dim: None   # shape rule, e.g. head_dim
    masked_forward: Callable | None = None
    masked_backward: Callable | None = None


@dataclass(frozen=True, eq=False)
class TileMask:
    """The mask of one kernel call on an (Sq, Sk) tile, in tile indices (i query row, j key column).

    ``kind``:
    * ``"causal"``: j <= i (top-left; the plans only make square causal tiles);
    * ``"band"``: ``lo <= j - i <= hi`` (None: unbounded), e.g. a sliding window;
    * ``"varlen"``: square, documents with boundaries ``cu`` (0 = cu[0] < ... < cu[-1] = Sq),
      causal within each document (flash-attn's varlen entry point);
    * ``"varlen_full"``: the same documents, each query attending to its whole document (the
      varlen entry point with ``causal=False``);
    * ``"dense"``: ``rows_fn(a, b)`` -> the (b - a, Sk) bool mask of rows a:b.
    ``restrict=False`` asks the exact path to compute every row against every column (the
    no-skipping baseline of the benchmark). ``cache`` holds what a backend derives once per tile
    (row segments, additive masks per dtype and device).
    """

    kind: str
    n_rows: int
    n_cols: int
    lo: int | None = None
    hi: int | None = None
    cu: tuple[int, ...] | None = None
    rows_fn: Callable[[int, int], "torch.Tensor"] | None = None
    restrict: bool = True
    cache: dict = field(default_factory=dict, repr=False, compare=False)

    def rows(self, a: int, b: int) -> Tensor:
        """(b - a, n_cols) bool: True where query row i in [a, b) attends to key column j."""
        if self.kind == "dense":
            return self.rows_fn(a, b)
        i = torch.arange(a, b).unsqueeze(1)
        j = torch.arange(self.n_cols).unsqueeze(0)
        if self.kind == "causal":
            return j <= i
        if self.kind == "band":
            ok = torch.ones(b - a, self.n_cols, dtype=torch.bool)
            if self.lo is not None:
                ok &= (j - i) >= self.lo
            if self.hi is not None:
                ok &= (j - i) <= self.hi
            return ok
        if self.kind in ("varlen", "varlen_full"):
            cu = torch.tensor(self.cu)
            doc = lambda t: torch.bucketize(t, cu, right=True)  # noqa: E731 - a one-line helper of this branch
            same = doc(i) == doc(j)
            return same & (j <= i) if self.kind == "varlen" else same
        raise ValueError(f"TileMask kind={self.kind!r} is unknown")

    def dense(self) -> Tensor:
        return self.rows(0, self.n_rows)


# TileMask kinds a varlen entry point runs (causal within each document, or whole documents)
VARLEN = ("varlen", "varlen_full")


def head_dim_rule(name: str, limit: int | None = None) -> Callable[[int | None], str | None]:
    """A backend's ``check``: head_dim a multiple of 8 (16-bit tensor-core tiles), up to ``limit`` if given."""
    rule = "a multiple of 8" + (f" up to {limit}" if limit else "")

    def check(head_dim: int | None) -> str | None:
        if head_dim is not None and (head_dim % 8 or (limit is not None and head_dim > limit)):
            return f"backend={name!r} needs head_dim {rule}, got {head_dim}"
        return None
    return check


def default_scale(head_dim: int, softmax_scale: float | None) -> float:
    return 1.0 / math.sqrt(head_dim) if softmax_scale is None else float(softmax_scale)


def stats_dtype(dtype: torch.dtype) -> torch.dtype:
    """dtype of lse, delta and the running accumulators: fp64 for fp64 inputs, else fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def unit_last(x: Tensor) -> Tensor:
    """``x`` with a unit-stride last dimension, what the fused kernels need; no copy when it has one."""
    return x if x.stride(-1) == 1 else x.contiguous()


def surrogate_out(dout: Tensor, delta: Tensor) -> Tensor:
    """An ``out`` for stock backward kernels with rowsum(dout * out) == delta.

    dout (B, S, Z, d); delta (B, Z, S) in the statistics dtype -> (B, S, Z, d) in dout's dtype.
    """
    acc = stats_dtype(dout.dtype)
    do_a = dout.to(acc)
    n2 = do_a.square().sum(-1, keepdim=True)  # (B, S, Z, 1)
    d = delta.to(acc).transpose(1, 2).unsqueeze(-1)  # (B, S, Z, 1)
    coef = torch.where(n2 > 0, d / n2.clamp_min(torch.finfo(acc).tiny), torch.zeros_like(n2))
    return (do_a * coef).to(dout.dtype)


def compute_delta(dout: Tensor, out: Tensor) -> Tensor:
    """delta = rowsum(dout * out) in the statistics dtype: (B, S, Z, d) x2 -> (B, Z, S)."""
    acc = stats_dtype(dout.dtype)
    return (dout.to(acc) * out.to(acc)).sum(-1).transpose(1, 2).contiguous()
