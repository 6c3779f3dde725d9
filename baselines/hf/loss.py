"""The loss over every rank's tokens, and the gradient all-reduce of replicated weights.

Each rank holds the logits (B, S, V) of its S = N/G tokens and their labels, already shifted
globally (``shard_batch``): the loss does NOT shift (HF's ``ForCausalLMLoss`` would, which on a
shard pairs tokens with the wrong targets). ``global_loss`` is ``burst_impl.model.parallel.mean_over``:
its value is sum_all / count_all (one counted all-reduce of [sum, count] in fp64), its gradient
that of local_sum / count_all, so summing the weight gradients over the group (``sync_grads``, or
FSDP2's reduce-scatter with a divide factor of 1, ``baselines.hf.fsdp``) gives exactly the
single-process gradient. The same ``token_loss_sum`` on the full batch is the single-process loss.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from burst_impl import comm
from burst_impl.model import parallel

Tensor = torch.Tensor


def token_loss_sum(logits: Tensor, labels: Tensor, ignore_index: int = -100) -> tuple[Tensor, Tensor]:
    """(sum of the token cross-entropies, number of counted tokens) of logits (B, S, V), labels (B, S).

    bf16/fp16 logits are upcast to fp32 first (as HF's loss does): a logsumexp over the vocabulary in
    bf16 would lose ~2-3 digits; fp32 and fp64 stay as they are.
    """
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} must be labels {tuple(labels.shape)} + (vocab,)")
    x = logits.float() if logits.dtype in (torch.bfloat16, torch.float16) else logits
    total = F.cross_entropy(x.reshape(-1, x.shape[-1]), labels.reshape(-1).to(x.device), ignore_index=ignore_index,
                            reduction="sum")
    return total, (labels != ignore_index).sum()


def _plan(group) -> parallel.ParallelPlan:
    """The sequence split of ``group`` as the model's parallelism describes it (every rank N/G tokens)."""
    rank, world_size = comm.world(group)
    return parallel.ParallelPlan("sp", group=group, rank=rank, world_size=world_size)


def global_loss(logits: Tensor, labels: Tensor, group=None, ignore_index: int = -100) -> Tensor:
    """The mean token loss over all ranks of ``group`` (value identical on every rank)."""
    total, count = token_loss_sum(logits, labels, ignore_index)
    return parallel.mean_over(_plan(group), total, count)


def sync_grads(model, group=None) -> None:
    """Sum every parameter's gradient over ``group`` (replicated weights; counted all-reduces in 64 MiB
    buckets, kind "grads"). Not for FSDP2 models: their backward reduce-scatters already."""
    if any(hasattr(p, "full_tensor") for p in model.parameters()):
        raise ValueError("model has DTensor (FSDP2) parameters: their gradients are reduce-scattered in the "
                         "backward; do not call sync_grads on it")
    parallel.sum_grads(_plan(group), [p for p in model.parameters() if p.requires_grad])
