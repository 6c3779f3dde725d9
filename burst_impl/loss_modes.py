"""LM-head + cross-entropy implementations, keyed by the names YAML uses (``loss: fused``).

Every mode is called as
``mode.fn(hidden, weight, labels, *, bias=None, ignore_index=-100, reduction="mean", return_count=False, **options)``
with hidden (T, H) or (B, S, H), weight (V, H), labels hidden.shape[:-1], and
the same input checks (``burst_impl.loss.check_loss_inputs``) before anything
runs.

* ``unfused``: F.linear + F.cross_entropy, the (T, V) logits in the input dtype.
* ``fused``: ours (``burst_impl.loss``): in training the gradients are computed in
  the forward, token chunks against the whole vocabulary (3 head GEMMs).
* ``fused_recompute``: ours with ``grad_in_forward=False``: (chunk_tokens x
  chunk_vocab) tiles, lse forward, recomputing backward (4 head GEMMs, less memory).
* ``liger``: Liger-Kernel's ``LigerFusedLinearCrossEntropyLoss`` (Triton, CUDA only).
  It chunks tokens only, materialising (chunk, V) logits, and computes the
  gradients during the forward (no recompute). Its forward takes
  ``(weight, input, target, bias)``: weight first.
* ``cce``: Apple's Cut Cross-Entropy ``linear_cross_entropy`` (Triton, CUDA only),
  the method BurstEngine's code calls (docs/papers.md §4): tiles of tokens x
  vocabulary, lse forward, recomputing backward. It takes
  ``(embeddings, classifier, targets)``: hidden first. Its default ``impl="cce"``
  skips gradient entries below a threshold (``filter_eps``), so it is not
  exact; ``impl="cce_exact"`` is.

The peers are compared for memory and time (``python -m experiments.benches.loss_bench``);
no test depends on them. ``available()`` is False without CUDA or without the package.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Callable

import torch

from .loss import (IGNORE_INDEX, REDUCTIONS, _finish, check_loss_inputs, fused_linear_cross_entropy,
                   linear_cross_entropy)

Tensor = torch.Tensor


@dataclass(frozen=True)
class LossMode:
    name: str
    fn: Callable
    description: str
    materialises_logits: str          # what of the (T, V) logits is live at once, for the memory model
    # None when the mode can run here, else why not (e.g. "needs CUDA").
    unavailable: Callable[[], str | None] = lambda: None
    external: str | None = None       # the package it wraps
    options: dict = field(default_factory=dict)

    def available(self) -> bool:
        return self.unavailable() is None

    def __call__(self, hidden: Tensor, weight: Tensor, labels: Tensor, **kwargs):
        return self.fn(hidden, weight, labels, **{**self.options, **kwargs})


# ---------------------------------------------------------------- peers (CUDA only)


def _import(module: str):
    return importlib.import_module(module)


def _cuda_present() -> bool:
    return torch.cuda.is_available()


def _unavailable(module: str, package: str) -> Callable[[], str | None]:
    def why() -> str | None:
        if not _cuda_present():
            return f"{package} runs Triton kernels on CUDA only; no CUDA device here"
        try:
            _import(module)
        except Exception as e:  # noqa: BLE001 - any import failure means "not usable here"
            return f"{package} is not importable ({type(e).__name__}: {e})"
        return None
    return why


def _check_peer(name: str, hidden: Tensor, weight: Tensor, labels: Tensor, bias, ignore_index, reduction) -> None:
    check_loss_inputs(hidden, weight, labels, bias=bias, ignore_index=ignore_index, reduction=reduction)
    if hidden.device.type != "cuda":
        raise ValueError(f"loss mode {name!r} needs CUDA tensors (Triton kernels); hidden.device={hidden.device}")
    if hidden.dtype == torch.float64:
        raise ValueError(f"loss mode {name!r} does not take hidden.dtype={hidden.dtype}; use float32, bfloat16 "
                         "or float16")


LIGER_MODULE = "liger_kernel.transformers.fused_linear_cross_entropy"
CCE_MODULE = "cut_cross_entropy"


def liger_linear_cross_entropy(hidden: Tensor, weight: Tensor, labels: Tensor, *, bias: Tensor | None = None,
                               ignore_index: int = IGNORE_INDEX, reduction: str = "mean",
                               return_count: bool = False):
    _check_peer("liger", hidden, weight, labels, bias, ignore_index, reduction)
    cls = _import(LIGER_MODULE).LigerFusedLinearCrossEntropyLoss
    loss_fn = cls(ignore_index=ignore_index, reduction=reduction)
    H = hidden.shape[-1]
    # Liger's forward is (weight, input (BT, H), target (BT,), bias): weight first, 2-D input.
    loss = loss_fn(weight, hidden.reshape(-1, H).contiguous(), labels.reshape(-1).long(), bias)
    if reduction == "none":
        loss = loss.view(labels.shape)
    return _finish(loss, labels, ignore_index, return_count)


def cce_linear_cross_entropy(hidden: Tensor, weight: Tensor, labels: Tensor, *, bias: Tensor | None = None,
                             ignore_index: int = IGNORE_INDEX, reduction: str = "mean",
                             return_count: bool = False, impl: str = "cce"):
    _check_peer("cce", hidden, weight, labels, bias, ignore_index, reduction)
    lce = _import(CCE_MODULE).linear_cross_entropy
    extra = {} if bias is None else {"bias": bias}     # releases before 25.x have no bias argument
    # CCE's order is (embeddings (..., H), classifier (V, H), targets (...)): hidden first.
    loss = lce(hidden, weight, labels.long(), ignore_index=ignore_index, reduction=reduction, impl=impl, **extra)
    if reduction == "none":
        loss = loss.view(labels.shape)
    return _finish(loss, labels, ignore_index, return_count)


# ---------------------------------------------------------------- registry


LOSS_MODES: dict[str, LossMode] = {m.name: m for m in (
    LossMode("unfused", linear_cross_entropy, "F.linear + F.cross_entropy", "all (T, V), input dtype"),
    LossMode("fused", fused_linear_cross_entropy,
             "ours: gradients in the forward when training ((rows, V) fp32 tiles, 3 head GEMMs), else lse tiles",
             "one (rows, V) fp32 tile, fp32 d hidden and d W"),
    LossMode("fused_recompute", fused_linear_cross_entropy,
             "ours, recomputing backward: (chunk_tokens x chunk_vocab) fp32 tiles, 4 head GEMMs",
             "one (chunk_tokens, chunk_vocab) fp32 tile", options={"grad_in_forward": False}),
    LossMode("liger", liger_linear_cross_entropy, "Liger-Kernel fused linear cross-entropy (token chunks)",
             "one (token chunk, V) tile", unavailable=_unavailable(LIGER_MODULE, "liger-kernel"),
             external="liger-kernel"),
    LossMode("cce", cce_linear_cross_entropy, "Cut Cross-Entropy (token x vocab tiles in SRAM)",
             "tiles in on-chip memory only", unavailable=_unavailable(CCE_MODULE, "cut-cross-entropy"),
             external="cut-cross-entropy"),
)}


def get_loss_mode(name: str) -> LossMode:
    if name not in LOSS_MODES:
        raise ValueError(f"loss={name!r} is unknown; registered: {sorted(LOSS_MODES)}")
    return LOSS_MODES[name]


__all__ = ["LOSS_MODES", "LossMode", "REDUCTIONS", "cce_linear_cross_entropy", "get_loss_mode",
           "liger_linear_cross_entropy"]
