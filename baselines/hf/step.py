"""One forward + backward of an HF causal LM, sequence-parallel or on the whole batch.

``sp_loss_and_grads`` is what a training loop does on each rank (shard, forward, global mean loss,
backward, gradient all-reduce unless FSDP2); ``single_loss_and_grads`` is the unmodified model on
the whole global batch with the same targets (``batch.global_inputs``) and the same loss: the
reference every parallel run must equal (tests/test_hf_parity.py, the example).
"""
from __future__ import annotations

import torch

from .batch import global_inputs, shard_batch
from .fsdp import full_grads
from .loss import global_loss, sync_grads, token_loss_sum

Tensor = torch.Tensor


def sp_loss_and_grads(model, input_ids: Tensor, labels: Tensor | None = None, *, layout: str = "zigzag",
                      group=None, fsdp: bool = False, grads: bool = True,
                      **batch_kw) -> tuple[Tensor, dict[str, Tensor]]:
    """(global mean loss, {name: full gradient}) of one step on this rank's shard of the batch.
    ``grads=False``: {} instead (no all-gather of FSDP2 gradient shards; the optimizer needs none)."""
    batch = shard_batch(input_ids, labels, layout=layout, group=group, **batch_kw)
    model.zero_grad(set_to_none=True)
    loss = global_loss(model(**batch.model_inputs()).logits, batch.labels, group)
    loss.backward()
    if not fsdp:
        sync_grads(model, group)
    return loss.detach(), full_grads(model) if grads else {}


def single_loss_and_grads(model, input_ids: Tensor, labels: Tensor | None = None, *,
                          attention_mask: Tensor | None = None, **batch_kw) -> tuple[Tensor, dict[str, Tensor]]:
    """The same step on one process: the model's own attention (sdpa), its own masks (HF detects
    packed documents from the position_ids resets, builds the sliding window and padding masks)."""
    pos, target, cu = global_inputs(input_ids, labels, attention_mask=attention_mask, **batch_kw)
    model.zero_grad(set_to_none=True)
    kw = dict(attention_mask=attention_mask, use_cache=False)
    if cu is not None or batch_kw.get("position_ids") is not None:
        kw["position_ids"] = pos
    total, count = token_loss_sum(model(input_ids=input_ids, **kw).logits, target)
    loss = total / count
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
