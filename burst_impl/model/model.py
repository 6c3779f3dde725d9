"""The decoder: embedding, blocks, final norm, untied LM head, and the loss hook.

    model = build_model(get_config("tiny"), seed=0)          # identical weights on every rank
    loss_sum, count = model(tokens, positions, labels)         # this rank's token losses
    hidden = model(tokens, positions)                          # (B, S, H), after the final norm
    logits = model(tokens, positions, logits_at=i)             # (B, V) at local token i (prefill)

``positions`` are the global positions of the S tokens (RoPE); a
single-device model passes ``arange(N)``. The LM head and the loss run inside
``forward`` (so FSDP2 has the root's weights gathered while they run) through
the swappable ``model.loss_fn(hidden, head_weight, labels, ignore_index) ->
(sum of token losses, number of counted tokens)``, chosen by ``cfg.loss``
(``loss_fn_for``: unfused, or the fused LM head + cross-entropy and its
peers of ``burst_impl.loss_modes``). Blocks run under ``cfg.checkpoint``
(``checkpoint.run_block``: none, full, seq, whole). The mean over all global tokens is formed by the caller
(``parallel.global_mean``).

Hooks for parallelisation and memory features: ``model.layers`` is a
ModuleList of ``TransformerBlock`` (``forward(x, rope)``); a per-block
wrapper (activation checkpointing) replaces its entries (``wrap_blocks``).
Each block's ``attention.core`` is the attention callable a transform swaps.
``model.parallel`` describes how the model is split (None: one device); see
``parallel.py``.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .checkpoint import run_block
from .config import ModelConfig
from .layers import RMSNorm, TransformerBlock, rope_tables
from burst_impl.loss_modes import get_loss_mode

Tensor = torch.Tensor
IGNORE_INDEX = -100


def cross_entropy_sum(hidden: Tensor, head_weight: Tensor, labels: Tensor,
                      ignore_index: int = IGNORE_INDEX) -> tuple[Tensor, Tensor]:
    """Unfused LM head + cross-entropy: hidden (B, S, H), head_weight (V, H), labels (B, S)
    -> (sum of token losses, number of tokens whose label is not ``ignore_index``).
    Materialises the (B, S, V) logits; the softmax runs in at least fp32."""
    logits = hidden @ head_weight.t()                                           # (B, S, V)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    total = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=ignore_index, reduction="sum")
    return total, (labels != ignore_index).sum()


def loss_fn_for(name: str) -> Callable[..., tuple[Tensor, Tensor]]:
    """The ``loss_fn`` of loss mode ``name`` (``ModelConfig.loss``): ``unfused`` is
    ``cross_entropy_sum``; the others are ``burst_impl.loss_modes`` entries called with
    ``reduction="sum", return_count=True``. ValueError for a mode that cannot run here
    (Liger and CCE need CUDA and their package)."""
    if name == "unfused":
        return cross_entropy_sum

    mode = get_loss_mode(name)
    if not mode.available():
        raise ValueError(f"loss={name!r} cannot run here: {mode.unavailable()}")

    def loss_fn(hidden: Tensor, head_weight: Tensor, labels: Tensor, ignore_index: int = IGNORE_INDEX):
        return mode(hidden, head_weight, labels, ignore_index=ignore_index, reduction="sum", return_count=True)

    loss_fn.__name__ = f"{name}_loss_sum"
    return loss_fn


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig, device=None, dtype=None):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden, device=device, dtype=dtype)
        self.layers = nn.ModuleList(TransformerBlock(cfg, device, dtype) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.hidden, cfg.norm_eps, device, dtype)
        self.output = nn.Linear(cfg.hidden, cfg.vocab_size, bias=False, device=device, dtype=dtype)  # untied
        self.loss_fn: Callable[..., tuple[Tensor, Tensor]] = loss_fn_for(cfg.loss)
        self.parallel = None                                                    # parallel.ParallelPlan

    def forward(self, tokens: Tensor, positions: Tensor, labels: Tensor | None = None, *,
                logits_at: int | None = None, ignore_index: int = IGNORE_INDEX):
        """tokens (B, S) int64 at global ``positions`` (S,). Returns (loss_sum, count) of the
        tokens' ``labels`` (B, S) through ``loss_fn`` if given; else the logits (B, V) of local
        token ``logits_at`` if given; else the hidden states (B, S, H) after the final norm."""
        h = self.tok_embeddings(tokens)
        # Tables in at least fp32: cos/sin rounded to bf16 would misplace positions (HF keeps fp32 too).
        rope = rope_tables(positions, self.cfg.head_dim, self.cfg.rope_theta,
                           dtype=torch.promote_types(h.dtype, torch.float32))
        for block in self.layers:
            h = run_block(block, h, rope, self.cfg.checkpoint)   # checkpoint.py: none/full/seq/whole
        h = self.norm(h)
        if labels is not None:
            return self.loss_fn(h, self.output.weight, labels, ignore_index)
        if logits_at is not None:
            return self.output(h[:, logits_at])
        return h


def wrap_blocks(model: Transformer, wrapper: Callable[[int, nn.Module], nn.Module]) -> Transformer:
    """Replace block i by ``wrapper(i, block)`` (same ``forward(x, rope)``), e.g. a checkpoint wrapper."""
    for i in range(len(model.layers)):
        model.layers[i] = wrapper(i, model.layers[i])
    return model


@torch.no_grad()
def init_weights(model: Transformer, seed: int = 0) -> Transformer:
    """Deterministic initialisation, identical on every rank for the same seed and device type.

    Fan-in scaling (std = in_features^-1/2) so that activations and attention
    scores are O(1) at any width (a parity test must see non-uniform
    attention); the residual outputs wo and w2 are further scaled by
    (2 * n_layers)^-1/2; embedding std 1 (RMSNorm follows); norms 1. Drawn in
    fp32 in named-parameter order, then cast to the parameter dtype.
    """
    gen = None
    scale_out = (2 * model.cfg.n_layers) ** -0.5
    for name, p in model.named_parameters():
        if gen is None or gen.device != p.device:
            gen = torch.Generator(device=p.device).manual_seed(seed)
        if name.endswith("norm.weight"):
            p.fill_(1.0)
            continue
        std = 1.0 if "tok_embeddings" in name else p.shape[-1] ** -0.5
        if name.endswith(("wo.weight", "w2.weight")):
            std *= scale_out
        p.copy_(torch.randn(p.shape, generator=gen, device=p.device, dtype=torch.float32) * std)  # cast
    return model


def build_model(cfg: ModelConfig, *, seed: int = 0, dtype: torch.dtype = torch.float32,
                device: torch.device | str = "cpu") -> Transformer:
    """The model on ``device`` in ``dtype``, initialised by ``init_weights`` (values drawn in fp32,
    one parameter at a time, so no fp32 copy of the whole model is ever held).

    Not built on the meta device: on CPU, materialising meta tensors (``to_empty``) imports
    torch's reference decompositions and sympy, seconds per process, which every test worker
    would pay. ``Transformer(cfg, device="meta")`` + ``to_empty`` + ``init_weights`` remains
    possible where a model must be sharded before it is materialised."""
    return init_weights(Transformer(cfg, device=device, dtype=dtype), seed)
