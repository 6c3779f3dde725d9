"""FLOPs of one model step: the numerator of tokens/s-based MFU.

Convention (stated in every record that uses it):

* matmuls: 2 FLOPs per multiply-add per token for every weight that
  multiplies every token (``config.matmul_params``: the blocks' projections
  and MLP and the LM head; not the embedding lookup, not the norms). Training
  = forward + backward = 3 x forward: 6 x params x tokens. Prefill = forward
  only, and its LM head runs on the last token of each sequence only.
* attention: the suite's single formula (``burst_impl.flops``):
  4 B N^2 Z d per layer forward, halved when causal, x3.5 for forward +
  backward; Z = query heads (GQA does not change it). With a mask
  (``cfg.mask``: sliding window, documents, block-sparse) the live entries of
  the mask intersected with causal (``Mask.area``), counted exactly.
* recomputation (activation checkpointing, Burst's backward recomputing
  scores) is NOT counted: the FLOPs are the model's, not the implementation's,
  so MFU does not reward extra work.

``causal_halved=False`` gives the unhalved count that some papers use, for a
figure that must be compared with theirs (say so in its title).
"""
from __future__ import annotations

from burst_impl.shape import AttnShape
from burst_impl.flops import attention_flops

from .config import ModelConfig, matmul_params

MODES = ("train", "prefill")


def model_flops(cfg: ModelConfig, batch: int, seqlen: int, *, mode: str = "train", causal: bool = True,
                causal_halved: bool = True) -> dict[str, float]:
    """``{"matmul", "attention", "total"}`` FLOPs of one step on the global batch (all ranks together)."""
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} is unknown; choose one of {MODES}")
    if batch <= 0 or seqlen <= 0:
        raise ValueError(f"batch={batch} and seqlen={seqlen} must be positive")
    tokens = batch * seqlen
    head = cfg.vocab_size * cfg.hidden
    if mode == "train":
        dense = 6.0 * matmul_params(cfg) * tokens
    else:
        dense = 2.0 * (matmul_params(cfg) - head) * tokens + 2.0 * head * batch
    shape = AttnShape(batch, seqlen, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, 1, causal=causal and causal_halved,
                      mask=cfg.mask)
    attn = cfg.n_layers * attention_flops(shape, mode="fwd_bwd" if mode == "train" else "forward")
    return {"matmul": dense, "attention": attn, "total": dense + attn}


def mfu(flops: float, seconds: float, n_devices: int, peak_flops_per_device: float) -> float:
    """Model FLOP utilisation: ``flops`` done in ``seconds`` over ``n_devices`` of the given peak."""
    if seconds <= 0 or n_devices <= 0 or peak_flops_per_device <= 0:
        return float("nan")
    return flops / seconds / (n_devices * peak_flops_per_device)
