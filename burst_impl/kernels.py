"""Local attention kernels (PAPER.md §1, "Local attention optimisation").

Every ring method computes, at each ring step, attention of a query block
against one key/value block. Two entry points, shared by BurstAttention and
all baselines:

* ``attn_forward(q, k, v, causal, scale)  -> (out, lse)``
* ``attn_backward(dout, q, k, v, lse, delta, causal, scale) -> (dq, dk, dv)``

Shapes follow ``flash_attn_func``: q (B, Sq, Z, d), k/v (B, Sk, Zkv, d) with
Z a multiple of Zkv (GQA/MQA); out (B, Sq, Z, d) in q's dtype; lse (B, Z, Sq),
natural log, and delta (B, Z, Sq) = rowsum(dout * out), both in the
statistics dtype ``stats_dtype(q.dtype)``: fp64 for fp64 inputs (so that
``torch.autograd.gradcheck`` works end to end), fp32 otherwise.
``causal`` on a block means the top-left aligned mask k_pos <= q_pos, used
only on diagonal blocks where Sq == Sk.

Inputs of any strides are accepted: the fused kernels index every dimension
through its stride except the last, which must be unit-stride (a view with a
strided head dim, e.g. ``x.transpose(2, 3).contiguous().transpose(2, 3)``,
would be read as garbage), so the entry points copy exactly those tensors and
pass every other view through untouched (``unit_last``).

Backends (``backend=`` name, or ``None`` for automatic):

* ``"cpu_flash"``: PyTorch's fused tiled CPU kernels
  (``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward).
* ``"flash_attn"``: the flash-attn package on CUDA.
* ``"cuda_sdpa"``: PyTorch's CUDA efficient-attention kernels (return lse).
* ``"reference"``: plain math in fp64, for tests; materialises the scores.

What each backend runs on is in ``BACKEND_SUPPORT``; ``check_backend`` turns a
mismatch (a CUDA backend on CPU tensors, flash-attn with fp32 or fp64, a
package that is not installed) into a ValueError before any communication.

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

import functools
import math
from typing import Callable

import torch

Tensor = torch.Tensor

# ---------------------------------------------------------------- helpers


# Input dtypes every backend path accepts (the fused kernels of each backend accept a subset,
# ``BACKEND_SUPPORT``).
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


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


# ---------------------------------------------------------------- reference (fp64)


def _ref_scores(q: Tensor, k: Tensor, causal: bool, scale: float) -> Tensor:
    # (B, Z, Sq, Sk) in fp64; GQA by repeating kv heads.
    z, zkv = q.shape[2], k.shape[2]
    qh = q.double().transpose(1, 2)
    kh = k.double().transpose(1, 2).repeat_interleave(z // zkv, dim=1)
    s = qh @ kh.transpose(-1, -2) * scale
    if causal:
        sq, sk = s.shape[-2:]
        mask = torch.ones(sq, sk, dtype=torch.bool, device=s.device).tril()
        s = s.masked_fill(~mask, float("-inf"))
    return s


def _reference_forward(q, k, v, causal, scale):
    z, zkv = q.shape[2], k.shape[2]
    s = _ref_scores(q, k, causal, scale)
    lse = torch.logsumexp(s, dim=-1)  # (B, Z, Sq)
    p = torch.exp(s - lse.unsqueeze(-1))
    vh = v.double().transpose(1, 2).repeat_interleave(z // zkv, dim=1)
    out = (p @ vh).transpose(1, 2)
    return out.to(q.dtype), lse


def _reference_backward(dout, q, k, v, lse, delta, causal, scale):
    z, zkv = q.shape[2], k.shape[2]
    g = z // zkv
    s = _ref_scores(q, k, causal, scale)
    p = torch.exp(s - lse.double().unsqueeze(-1))  # (B, Z, Sq, Sk)
    do = dout.double().transpose(1, 2)  # (B, Z, Sq, d)
    vh = v.double().transpose(1, 2).repeat_interleave(g, dim=1)
    kh = k.double().transpose(1, 2).repeat_interleave(g, dim=1)
    qh = q.double().transpose(1, 2)
    dv = p.transpose(-1, -2) @ do  # (B, Z, Sk, d)
    dp = do @ vh.transpose(-1, -2)
    ds = p * (dp - delta.double().unsqueeze(-1))
    dq = ds @ kh * scale
    dk = ds.transpose(-1, -2) @ qh * scale

    def fold(x):  # sum the query heads that share one kv head: (B, Z, S, d) -> (B, S, Zkv, d)
        b, _, s_, d = x.shape
        return x.view(b, zkv, g, s_, d).sum(2).transpose(1, 2)

    return dq.transpose(1, 2).to(q.dtype), fold(dk).to(k.dtype), fold(dv).to(v.dtype)


# ---------------------------------------------------------------- CPU fused flash kernels


def _cpu_flash_forward(q, k, v, causal, scale):
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.0, causal, scale=scale
    )
    return out.transpose(1, 2), lse


def _cpu_flash_backward(dout, q, k, v, lse, delta, causal, scale):
    out_s = surrogate_out(dout, delta)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout.transpose(1, 2), q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
        out_s.transpose(1, 2), lse, 0.0, causal, scale=scale,
    )
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


# ---------------------------------------------------------------- CUDA kernels


@functools.lru_cache(maxsize=None)
def _flash_attn_available() -> bool:
    try:
        import flash_attn  # noqa: F401
        from flash_attn import flash_attn_interface  # noqa: F401
    except Exception:
        return False
    return True


def _window_kwargs(fn) -> dict:
    """flash-attn >= 2.6 takes window_size_left/right and softcap; 2.4-2.5 a window_size tuple."""
    import inspect

    params = inspect.signature(fn).parameters
    if "window_size_left" in params:
        kw = dict(window_size_left=-1, window_size_right=-1)
    else:
        kw = dict(window_size=(-1, -1))
    if "softcap" in params:
        kw["softcap"] = 0.0
    return kw


def _flash_attn_forward(q, k, v, causal, scale):
    from flash_attn import flash_attn_interface as fai

    # flash-attn 2.x: returns (out, softmax_lse (B, Z, Sq) fp32, S_dmask, rng_state)
    res = fai._flash_attn_forward(
        q.contiguous(), k.contiguous(), v.contiguous(), dropout_p=0.0, softmax_scale=scale,
        causal=causal, alibi_slopes=None, return_softmax=False,
        **_window_kwargs(fai._flash_attn_forward),
    )
    return res[0], res[1]


def _flash_attn_backward(dout, q, k, v, lse, delta, causal, scale):
    from flash_attn import flash_attn_interface as fai

    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    out_s = surrogate_out(dout, delta)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    fai._flash_attn_backward(
        dout.contiguous(), q, k, v, out_s, lse, dq, dk, dv, dropout_p=0.0, softmax_scale=scale,
        causal=causal, alibi_slopes=None, deterministic=False, rng_state=None,
        **_window_kwargs(fai._flash_attn_backward),
    )
    return dq, dk, dv


def _expand_kv(x: Tensor, groups: int) -> Tensor:
    return x if groups == 1 else x.repeat_interleave(groups, dim=2)


def _fold_kv(x: Tensor, zkv: int) -> Tensor:
    b, s, z, d = x.shape
    return x if z == zkv else x.view(b, s, zkv, z // zkv, d).sum(3)


def _cuda_sdpa_forward(q, k, v, causal, scale):
    g = q.shape[2] // k.shape[2]
    out, lse, *_ = torch.ops.aten._scaled_dot_product_efficient_attention(
        q.transpose(1, 2), _expand_kv(k, g).transpose(1, 2), _expand_kv(v, g).transpose(1, 2),
        None, True, 0.0, causal, scale=scale,
    )
    return out.transpose(1, 2), lse[..., : q.shape[1]].float()


def _cuda_sdpa_backward(dout, q, k, v, lse, delta, causal, scale):
    g = q.shape[2] // k.shape[2]
    out_s = surrogate_out(dout, delta)
    ke, ve = _expand_kv(k, g), _expand_kv(v, g)
    # The forward returns lse padded to a multiple of 32 rows; hand back that shape.
    sq = q.shape[1]
    lse = torch.nn.functional.pad(lse, (0, (-sq) % 32)).contiguous()
    seed = offset = torch.zeros((), dtype=torch.int64)  # dropout is 0: never read
    dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        dout.transpose(1, 2), q.transpose(1, 2), ke.transpose(1, 2), ve.transpose(1, 2), None,
        out_s.transpose(1, 2), lse, seed, offset, 0.0, [True, True, True, False],
        causal, scale=scale,
    )
    zkv = k.shape[2]
    return dq.transpose(1, 2), _fold_kv(dk.transpose(1, 2), zkv), _fold_kv(dv.transpose(1, 2), zkv)


# ---------------------------------------------------------------- registry and dispatch

BACKENDS: dict[str, tuple[Callable, Callable]] = {
    "reference": (_reference_forward, _reference_backward),
    "cpu_flash": (_cpu_flash_forward, _cpu_flash_backward),
    "flash_attn": (_flash_attn_forward, _flash_attn_backward),
    "cuda_sdpa": (_cuda_sdpa_forward, _cuda_sdpa_backward),
}

# backend -> (device types it runs on, None = any; input dtypes its kernels take)
BACKEND_SUPPORT: dict[str, tuple[tuple[str, ...] | None, tuple[torch.dtype, ...]]] = {
    "reference": (None, FLOAT_DTYPES),
    "cpu_flash": (("cpu",), FLOAT_DTYPES),
    "flash_attn": (("cuda",), (torch.float16, torch.bfloat16)),
    "cuda_sdpa": (("cuda",), (torch.float16, torch.bfloat16, torch.float32)),  # no fp64 kernels
}


def _names(dtypes) -> str:
    return ", ".join(str(d).removeprefix("torch.") for d in dtypes)


def check_backend(name: str, device: torch.device, dtype: torch.dtype | None = None,
                  head_dim: int | None = None) -> None:
    """ValueError (parameter, value, rule) unless backend ``name`` can run on ``device`` with ``dtype``."""
    if name not in BACKENDS:
        raise ValueError(f"backend={name!r} is unknown; choose one of {sorted(BACKENDS)}")
    devices, dtypes = BACKEND_SUPPORT[name]
    if devices is not None and device.type not in devices:
        raise ValueError(f"backend={name!r} runs on {'/'.join(devices)} tensors, but the inputs are on "
                         f"{device}; pass backend=None to choose automatically")
    if dtype is not None and dtype not in dtypes:
        raise ValueError(f"backend={name!r} does not take dtype {dtype}; it takes {_names(dtypes)}"
                         + ("; use backend='reference' (fp64 math) or None" if dtype == torch.float64 else ""))
    if name == "flash_attn":
        if not _flash_attn_available():
            raise ValueError("backend='flash_attn' needs the flash-attn package, which is not importable here "
                             "(pip install flash-attn, or pass backend=None)")
        if head_dim is not None and (head_dim % 8 or head_dim > 256):
            raise ValueError(f"backend='flash_attn' needs head_dim a multiple of 8 up to 256, got {head_dim}")


def resolve_backend(device: torch.device, backend: str | None = None,
                    dtype: torch.dtype | None = None, head_dim: int | None = None) -> str:
    """The backend name for tensors on ``device``: ``backend`` if given (checked), else automatic.

    On CUDA, flash-attn when importable and the inputs suit it (fp16/bf16,
    head_dim a multiple of 8 up to 256), PyTorch's efficient-attention kernels
    for other fp16/bf16/fp32 inputs, and the fp64 ``reference`` math for fp64
    (no fused CUDA kernel takes fp64). On CPU, PyTorch's fused flash kernels.
    """
    if backend is not None:
        check_backend(backend, device, dtype, head_dim)
        return backend
    if device.type == "cuda":
        if dtype == torch.float64:
            return "reference"
        suits = dtype in (torch.float16, torch.bfloat16) and head_dim is not None \
            and head_dim % 8 == 0 and head_dim <= 256
        return "flash_attn" if suits and _flash_attn_available() else "cuda_sdpa"
    return "cpu_flash"


def attn_forward(q: Tensor, k: Tensor, v: Tensor, *, causal: bool, scale: float,
                 backend: str | None = None) -> tuple[Tensor, Tensor]:
    """Attention of one q block against one k/v block -> (out (B,Sq,Z,d), lse (B,Z,Sq)).

    Any strides; lse in ``stats_dtype(q.dtype)``.
    """
    name = resolve_backend(q.device, backend, q.dtype, q.shape[-1])
    out, lse = BACKENDS[name][0](unit_last(q), unit_last(k), unit_last(v), causal, scale)
    return out, lse.to(stats_dtype(q.dtype))


def attn_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, lse: Tensor, delta: Tensor, *,
                  causal: bool, scale: float, backend: str | None = None
                  ) -> tuple[Tensor, Tensor, Tensor]:
    """Block backward from the global lse and delta of q's rows -> (dq, dk, dv) in input dtypes.

    Because lse and delta are the *global* row statistics, P = exp(S - lse) is
    the exact probability block and the block gradients sum to the full ones.
    Any strides; lse and delta are used in ``stats_dtype(q.dtype)``.
    """
    name = resolve_backend(q.device, backend, q.dtype, q.shape[-1])
    acc = stats_dtype(q.dtype)
    return BACKENDS[name][1](unit_last(dout), unit_last(q), unit_last(k), unit_last(v),
                             lse.to(acc).contiguous(), delta.to(acc).contiguous(), causal, scale)
