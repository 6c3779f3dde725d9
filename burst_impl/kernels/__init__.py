"""Local attention kernels (docs/papers.md §1, "Local attention optimisation").

Every ring method computes, at each ring step, attention of a query block
against one key/value block. Two entry points, shared by BurstAttention and
all baselines:

* ``attn_forward(q, k, v, causal, scale, mask=None)  -> (out, lse)``
* ``attn_backward(dout, q, k, v, lse, delta, causal, scale, mask=None) -> (dq, dk, dv)``

Shapes follow ``flash_attn_func``: q (B, Sq, Z, d), k/v (B, Sk, Zkv, d) with
Z a multiple of Zkv (GQA/MQA); out (B, Sq, Z, d) in q's dtype; lse (B, Z, Sq),
natural log, and delta (B, Z, Sq) = rowsum(dout * out), both in the
statistics dtype ``stats_dtype(q.dtype)``: fp64 for fp64 inputs (so that
``torch.autograd.gradcheck`` works end to end), fp32 otherwise.
``causal`` on a block means the top-left aligned mask k_pos <= q_pos, used
only on diagonal blocks where Sq == Sk. ``mask`` (a ``TileMask``: causal,
band, documents or dense, in tile indices) is the mask of a tile of a plan
(``burst_impl.plan``); a backend runs it natively where it can
(``Backend.masked_forward``), else the exact path of ``masked.py`` does (row
segments restricted to their live columns, plain math). A row with no live
key gives out = 0, lse = -inf and zero gradients.

Inputs of any strides are accepted: the fused kernels index every dimension
through its stride except the last, which must be unit-stride (a view with a
strided head dim, e.g. ``x.transpose(2, 3).contiguous().transpose(2, 3)``,
would be read as garbage), so the entry points copy exactly those tensors and
pass every other view through untouched (``unit_last``).

Backends (``backend=`` name, or ``None`` for automatic):

* ``"cpu_flash"``: PyTorch's fused tiled CPU kernels
  (``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward).
* ``"flash_attn"``: the flash-attn package on CUDA.
* ``"xformers"``: xFormers' memory-efficient attention on CUDA (``xformers.ops.fmha``).
* ``"cuda_sdpa"``: PyTorch's CUDA efficient-attention kernels (return lse).
* ``"cuda_flash"``: PyTorch's own FlashAttention-2 CUDA kernels (SDPA's flash backend, fp16/bf16).
* ``"cuda_cudnn"``: cuDNN's fused attention through PyTorch (SDPA's cuDNN backend, fp16/bf16).
* ``"reference"``: plain math in fp64, for tests; materialises the scores.
* ``"math"``: materialised scores in the inputs' dtype (fp32 statistics): the papers'
  "without LAO" / "without FlashAttention" rows. Never chosen automatically.

What each backend runs on is in its ``Backend`` entry; ``check_backend`` turns a
mismatch (a CUDA backend on CPU tensors, flash-attn with fp32 or fp64, a
package that is not installed) into a ValueError before any communication.

The backends live one per file in this package (``reference.py``, ``cpu_flash.py``,
``flash_attn.py``, ``xformers.py``, ``cuda_sdpa.py``, ``cuda_flash.py``, ``cuda_cudnn.py``, ``math.py``;
what the two FlashAttention-2 backends share about mask tiles, ``flash_tiles.py``); the shared helpers
(statistics dtype, strides, ``delta`` and the surrogate ``out`` fed to stock backward kernels) are in
``common.py``.
"""
from __future__ import annotations

import torch

from . import cpu_flash, cuda_cudnn, cuda_flash, cuda_sdpa, flash_attn, masked, math, reference, xformers
from .common import (FLOAT_DTYPES, Backend, TileMask, compute_delta, default_scale, stats_dtype, surrogate_out,
                     unit_last)

Tensor = torch.Tensor

# name -> backend, in the order the automatic choice and the docs list them
BACKENDS: dict[str, Backend] = {m.BACKEND.name: m.BACKEND for m in (
    reference, cpu_flash, flash_attn, xformers, cuda_sdpa, cuda_flash, cuda_cudnn, math)}

__all__ = ["BACKENDS", "FLOAT_DTYPES", "Backend", "TileMask", "attn_backward", "attn_forward", "check_backend",
           "compute_delta", "default_scale", "resolve_backend", "stats_dtype", "surrogate_out", "unit_last"]


def _names(dtypes) -> str:
    return ", ".join(str(d).removeprefix("torch.") for d in dtypes)


def check_backend(name: str, device: torch.device, dtype: torch.dtype | None = None,
                  head_dim: int | None = None) -> None:
    """ValueError (parameter, value, rule) unless backend ``name`` can run on ``device`` with ``dtype``."""
    if name not in BACKENDS:
        raise ValueError(f"backend={name!r} is unknown; choose one of {sorted(BACKENDS)}")
    b = BACKENDS[name]
    if b.devices is not None and device.type not in b.devices:
        raise ValueError(f"backend={name!r} runs on {'/'.join(b.devices)} tensors, but the inputs are on "
                         f"{device}; pass backend=None to choose automatically")
    if dtype is not None and dtype not in b.dtypes:
        raise ValueError(f"backend={name!r} does not take dtype {dtype}; it takes {_names(b.dtypes)}"
                         + ("; use backend='reference' (fp64 math) or None" if dtype == torch.float64 else ""))
    if not b.available():
        raise ValueError(f"backend={name!r} needs a package that is not importable here "
                         f"({b.requirement or 'see burst_impl/kernels'}), or pass backend=None")
    why = b.check(head_dim)
    if why:
        raise ValueError(why)


def cuda_capability(device: torch.device) -> tuple[int, int]:
    """The device's compute capability, (0, 0) where CUDA is not usable (choices made off a GPU)."""
    return torch.cuda.get_device_capability(device) if torch.cuda.is_available() else (0, 0)


# Below this many query rows a call goes to PyTorch's FlashAttention-2 rather than cuDNN on Hopper: on an H200
# (results/gpu_check/nvidia-h200/decode_queries.json, 65536 keys, bf16, d 128) cuda_flash took 0.05-0.64x cuDNN's
# time from 1 to 256 rows at GQA 32:8 and 64:8 (cuDNN's kv heads are repeated, a copy of the whole K and V per call)
# and 0.35-1.11x at MHA, and cuDNN 0.55-0.89x flash's from 1024 rows. A decode step's new tokens are a few rows.
CUDNN_MIN_ROWS = 512


def resolve_backend(device: torch.device, backend: str | None = None,
                    dtype: torch.dtype | None = None, head_dim: int | None = None, *, masked: bool = False,
                    rows: int | None = None) -> str:
    """The backend name for tensors on ``device``: ``backend`` if given (checked), else automatic.

    On CUDA, the first of these that is importable and suits the inputs:
    flash-attn (fp16/bf16, head_dim a multiple of 8 up to 256: the FlashAttention-2
    kernels the papers' LAO is), then xformers (fp16/bf16/fp32; its dispatcher
    picks its own flash kernels where built with them, else cutlass, through a
    public forward/backward API that takes lse), then the kernels PyTorch ships,
    reached through private aten ops whose argument lists change between releases:
    cuDNN's on Hopper and later (``cuda_cudnn``, fp16/bf16, head_dim up to 128),
    PyTorch's FlashAttention-2 (``cuda_flash``, fp16/bf16), and its efficient
    attention (``cuda_sdpa``, also fp32: the fallback). fp64 gets the ``reference``
    math (no fused CUDA kernel takes fp64). On CPU, PyTorch's fused flash kernels.
    The packages come first because the papers' runs used them; on an H200 the
    GPU check measured cuda_cudnn at 1.6-1.7x FlashAttention-2 and cuda_sdpa at
    0.45x (docs/gpu_check.md): ``backend="cuda_cudnn"`` asks for it by name.
    ``masked``: the choice for a tile with a partial mask (band, documents), where a backend without a
    native masked path (``Backend.masked_forward``: cuDNN's here) would run the exact path's row-block
    math; automatic choice then skips it for the next that has one (FlashAttention-2's window and
    varlen forms), so one call may run its unmasked tiles in cuDNN and its masked ones in cuda_flash.
    ``rows``: the call's query rows; under ``CUDNN_MIN_ROWS`` (a decode step's few new tokens) automatic
    choice skips cuDNN too, for the same reason measured (its GQA copies the cache; see the constant).
    """
    if backend is not None:
        check_backend(backend, device, dtype, head_dim)
        return backend
    if device.type == "cuda":
        if dtype == torch.float64:
            return "reference"
        hopper = cuda_capability(device) >= (9, 0)
        for name in ("flash_attn", "xformers", *(("cuda_cudnn",) if hopper else ()), "cuda_flash"):
            b = BACKENDS[name]
            if (masked and b.masked_forward is None) or (name == "cuda_cudnn" and rows is not None
                                                         and rows < CUDNN_MIN_ROWS):
                continue
            if head_dim is not None and dtype in b.dtypes and b.check(head_dim) is None and b.available():
                return name
        return "cuda_sdpa"
    return "cpu_flash"


def _split(causal: bool, mask: TileMask | None) -> tuple[bool, TileMask | None]:
    """A causal TileMask is the kernels' own ``causal=True``."""
    if mask is not None and mask.kind == "causal":
        return True, None
    return causal, mask


def attn_forward(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False, scale: float,
                 backend: str | None = None, mask: TileMask | None = None) -> tuple[Tensor, Tensor]:
    """Attention of one q block against one k/v block -> (out (B,Sq,Z,d), lse (B,Z,Sq)).

    Any strides; lse in ``stats_dtype(q.dtype)``. ``mask``: the tile's mask (``TileMask``).
    """
    causal, mask = _split(causal, mask)
    name = resolve_backend(q.device, backend, q.dtype, q.shape[-1], masked=mask is not None, rows=q.shape[1])
    b = BACKENDS[name]
    q, k, v = unit_last(q), unit_last(k), unit_last(v)
    if mask is None:
        out, lse = b.forward(q, k, v, causal, scale)
    elif b.masked_forward is not None:
        out, lse = b.masked_forward(q, k, v, mask, scale)
    else:
        out, lse = masked.forward(q, k, v, mask, scale, fused=False)
    return out, lse.to(stats_dtype(q.dtype))


def attn_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, lse: Tensor, delta: Tensor, *,
                  causal: bool = False, scale: float, backend: str | None = None,
                  mask: TileMask | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Block backward from the global lse and delta of q's rows -> (dq, dk, dv) in input dtypes.

    Because lse and delta are the *global* row statistics, P = exp(S - lse) is
    the exact probability block and the block gradients sum to the full ones.
    Any strides; lse and delta are used in ``stats_dtype(q.dtype)``.
    """
    causal, mask = _split(causal, mask)
    name = resolve_backend(q.device, backend, q.dtype, q.shape[-1], masked=mask is not None, rows=q.shape[1])
    acc = stats_dtype(q.dtype)
    b = BACKENDS[name]
    args = (unit_last(dout), unit_last(q), unit_last(k), unit_last(v), lse.to(acc).contiguous(),
            delta.to(acc).contiguous())
    if mask is None:
        return b.backward(*args, causal, scale)
    if b.masked_backward is not None:
        return b.masked_backward(*args, mask, scale)
    return masked.backward(*args, mask, scale, fused=False)
