"""``xformers``: xFormers' memory-efficient attention (``xformers.ops.fmha``) on CUDA.

Written against xformers 0.0.35 (PyPI, 2026-02), from the public functions of
``xformers/ops/fmha/__init__.py`` read in facebookresearch/xformers (present
with these signatures since 0.0.2x):

* ``memory_efficient_attention_forward_requires_grad(q, k, v, attn_bias, p, scale)
  -> (out, lse)``: q/k/v in the BMHK layout (B, S, H, d), the same layout as
  ours; ``lse`` (B, H, S') fp32 with S' >= S, because the cutlass kernel pads
  the rows to a multiple of 32 (the flash kernels do not). We keep ``[..., :S]``.
* ``memory_efficient_attention_backward(grad, output, lse, q, k, v, attn_bias, p,
  scale) -> (dq, dk, dv)``: accepts lse of S or more rows (the kernels pad or
  slice it themselves, ``Context.get_padded_lse`` / ``lse[:, :, :S]``). Like
  every stock backward it takes ``output`` only to form delta = rowsum(dO * O),
  so we pass the surrogate ``out`` of ``common.surrogate_out`` and the GLOBAL
  lse of the ring.
* ``attn_bias=fmha.attn_bias.LowerTriangularMask()`` is top-left causal; we use
  it only on diagonal blocks (Sq == Sk), where top-left and bottom-right agree.
* xformers picks the kernel itself (``op=None``): its flash kernels for
  fp16/bf16 when present, else cutlass (which also takes fp32).

GQA: kv heads are expanded to the query heads and their gradients summed back
(``burst_impl.heads``), as ``cuda_sdpa`` does. The 5-D BMGHK layout would avoid
the copy in the forward, but xformers documents GQA/MQA as "experimental,
supported only for the forward pass" in the versions read, and forward and
backward must agree on one layout and one lse shape.

Guard: from 0.0.36 xformers takes its kernels from the ``mslk`` package and,
without it, falls back to PyTorch SDPA, whose backward *recomputes* the forward
and ignores ``output`` and ``lse``. That is right for a whole sequence and wrong
for a ring block (the block's own softmax instead of the global one). So
``available()`` runs a tiny probe on the GPU, once per process: the backward
with ``lse + ln 2`` must return half the dV (P = exp(S - lse) halves). A build
that fails it is reported unavailable, with that reason (``unavailable_reason``).

Not yet run on a GPU (no GPU was available when this was written): the CPU tests
check the argument mapping with fakes of the two functions (tests/test_kernels_xformers.py);
tests/test_cuda_path.py checks the real kernels against the fp64 reference.
"""
from __future__ import annotations

import functools
import math

import torch

from ..heads import expand_kv, fold_kv
from .common import Backend, compute_delta, head_dim_rule, surrogate_out

NAME = "xformers"
REQUIREMENT = ("pip install xformers (a build whose fmha backward uses the given lse: xformers <= 0.0.35, "
               "or >= 0.0.36 with mslk's kernels)")
_state = {"reason": ""}


def _fmha():
    """The ``xformers.ops.fmha`` module (one place, so tests can put a fake here)."""
    from xformers.ops import fmha  # noqa: PLC0415 (optional dependency)

    return fmha


def _bias(fmha, causal: bool):
    return fmha.attn_bias.LowerTriangularMask() if causal else None


def forward(q, k, v, causal, scale):
    fmha = _fmha()
    z, sq = q.shape[2], q.shape[1]
    out, lse = fmha.memory_efficient_attention_forward_requires_grad(
        q, expand_kv(k, z), expand_kv(v, z), attn_bias=_bias(fmha, causal), p=0.0, scale=scale)
    return out, lse[:, :, :sq].float()   # (B, Sq, Z, d), (B, Z, Sq): drop cutlass's padded rows


def backward(dout, q, k, v, lse, delta, causal, scale):
    fmha = _fmha()
    z, zkv = q.shape[2], k.shape[2]
    out_s = surrogate_out(dout, delta)
    dq, dk, dv = fmha.memory_efficient_attention_backward(
        dout, out_s, lse.float().contiguous(), q, expand_kv(k, z), expand_kv(v, z),
        attn_bias=_bias(fmha, causal), p=0.0, scale=scale)
    return dq, fold_kv(dk, zkv), fold_kv(dv, zkv)


# (dtype, head_dim, causal) the probe runs: xformers dispatches each to its own kernel (flash or cutlass,
# per dtype, head dim and bias), and any of them may be the fallback that ignores lse; the second is
# what the benchmark runs (bf16, d = 128, causal diagonal blocks).
PROBES = ((torch.float16, 64, False), (torch.bfloat16, 128, True))


def honours_lse(device: torch.device | str, dtype: torch.dtype = torch.float16, head_dim: int = 64,
                causal: bool = False) -> bool:
    """Does the backward use the lse it is given (P = exp(S - lse)), as a ring needs?

    Shifting lse by ln 2 halves every probability, so dV = P^T dO must halve. A
    backward that recomputes its own softmax (xformers' SDPA fallback) returns
    the same dV both times.
    """
    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(1, 64, 2, head_dim, generator=g).to(device=device, dtype=dtype) for _ in range(4))
    scale = 1.0 / math.sqrt(head_dim)
    out, lse = forward(q, k, v, causal, scale)
    delta = compute_delta(do, out)   # (B, Z, S), fp32
    dv = backward(do, q, k, v, lse, delta, causal, scale)[2].float()
    dv_half = backward(do, q, k, v, lse + math.log(2.0), delta, causal, scale)[2].float()
    err = (dv_half - dv / 2).abs().max().item()
    return err <= 0.05 * dv.abs().max().item()


def _probe_device() -> torch.device | None:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None


@functools.lru_cache(maxsize=None)
def available() -> bool:
    """xformers importable with both functions, and (where CUDA is) its backward honours lse."""
    try:
        fmha = _fmha()
        for fn in ("memory_efficient_attention_forward_requires_grad", "memory_efficient_attention_backward"):
            getattr(fmha, fn)
    except Exception as e:  # noqa: BLE001 - any import failure means "not here"
        _state["reason"] = f"xformers.ops.fmha is not importable: {type(e).__name__}: {e}"
        return False
    device = _probe_device()
    if device is not None:
        for dtype, head_dim, causal in PROBES:
            shown = f"{str(dtype).removeprefix('torch.')}, d = {head_dim}, {'causal' if causal else 'full'}"
            try:
                ok = honours_lse(device, dtype, head_dim, causal)
            except Exception as e:  # noqa: BLE001 - no kernel for this GPU, a broken build...
                _state["reason"] = f"xformers' probe ({shown}) failed on this GPU: {type(e).__name__}: {str(e)[:300]}"
                return False
            if not ok:
                _state["reason"] = (f"xformers' memory_efficient_attention_backward ({shown}) ignores the lse it is "
                                    "given (the PyTorch-SDPA fallback of xformers >= 0.0.36 without mslk): wrong "
                                    "for ring blocks")
                return False
    _state["reason"] = ""
    return True


def unavailable_reason() -> str:
    """Why ``available()`` said no ('' when it said yes or was not asked)."""
    return _state["reason"]


# head_dim: cutlass needs it aligned to 128 bits for 16-bit inputs on sm80+ (8 elements); xformers' flash
# kernels take multiples of 8 as well. Simpler to state one rule than per-dtype ones.
BACKEND = Backend(NAME, forward, backward, devices=("cuda",),
                  dtypes=(torch.float16, torch.bfloat16, torch.float32),
                  available=available, requirement=REQUIREMENT, check=head_dim_rule(NAME))
