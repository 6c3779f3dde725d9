"""Training and prefill steps: what the model-level experiments time.

Both take the GLOBAL batch, identical on every rank (``data.batch_at``), and
cut this rank's tokens themselves (``parallel.local_batch``), so the same call
runs single-device, sequence parallel (any registry method), TP-V1/V3 and
under FSDP2.

    loss = train_step(model, optimizer, tokens, labels)     # global mean loss (0-dim tensor)
    next_ids = prefill_step(model, tokens)                    # (B,) on every rank

Validation (sequence that does not split for the layout, method that cannot
run that length) happens before any communication.
"""
from __future__ import annotations

import torch

from burst_impl.collectives import all_reduce_

from .checkpoint import check_checkpoint
from .parallel import global_mean, local_batch, plan_of, sync_grads
from .sequence_parallel import check_sequence

Tensor = torch.Tensor


def forward_loss(model, tokens: Tensor, labels: Tensor) -> Tensor:
    """Global mean token loss of the global batch; differentiable (this rank's share)."""
    check_sequence(model, tokens.shape[1])
    check_checkpoint(model, tokens.shape[1])
    x, y, pos = local_batch(model, tokens, labels)
    return global_mean(model, *model(x, pos, y))


def loss_and_grads(model, tokens: Tensor, labels: Tensor) -> Tensor:
    """Forward, backward and gradient synchronisation: afterwards every rank's ``.grad`` is the
    single-device gradient (of its shard under TP / FSDP2). Returns the loss (detached)."""
    loss = forward_loss(model, tokens, labels)
    loss.backward()
    sync_grads(model)
    return loss.detach()


def train_step(model, optimizer: torch.optim.Optimizer, tokens: Tensor, labels: Tensor) -> Tensor:
    """One optimizer step on the global batch; returns the loss before the update (detached)."""
    optimizer.zero_grad(set_to_none=True)
    loss = loss_and_grads(model, tokens, labels)
    optimizer.step()
    return loss


@torch.no_grad()
def prefill_step(model, tokens: Tensor) -> Tensor:
    """Inference prefill (time to first token): run the prompt (B, N) through the model and
    return the greedy next token (B,) on every rank.

    Only the rank holding global position N-1 applies the LM head, to that one
    token; under a sequence split the ids reach the other ranks through one
    counted all-reduce of B int64 (kind "next_token", others contribute 0).
    """
    check_sequence(model, tokens.shape[1])
    plan = plan_of(model)
    n = tokens.shape[1]
    x, _, pos = local_batch(model, tokens, tokens)
    last = (pos == n - 1).nonzero()
    at = int(last[0, 0]) if last.numel() else 0     # ranks without the last token still run the blocks
    logits = model(x, pos, logits_at=at)                                        # (B, V)
    ids = logits.argmax(-1) if last.numel() else torch.zeros_like(logits[:, 0], dtype=torch.int64)
    if plan.shards_sequence:
        ids = all_reduce_(ids, plan.group, "forward", "next_token")
    return ids

