"""How a model is split over a process group, and the pieces every split shares.

A transform (``sequence_parallel``, ``tensor_parallel``) sets ``model.parallel``
to a ``ParallelPlan``; the step functions read it to

* cut the global batch into this rank's tokens and their global positions
  (``local_batch``: the ``layout`` shard under sequence parallelism and TP-V3,
  everything under TP-V1; ``"balanced[:K]"`` is the balanced chunk layout of the
  model's mask for that N, ``burst_impl.balance``, the one the attention method
  resolves from the same mask);
* form the loss as the mean over ALL global tokens (``global_mean``: an
  all-reduce of the local sum and count), so the gradient equals the
  single-device gradient once the partial weight gradients are summed;
* sum those partial weight gradients over the group (``sync_grads``, a
  counted all-reduce of the parameters listed in ``plan.reduce_grads``),
  unless FSDP2 does it (``plan.weights == "fsdp2"``: reduce-scatter inside
  the backward).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from burst_impl.collectives import all_reduce_
from burst_impl import comm, masks
from burst_impl.balance import chunks_of, resolve_layout
from burst_impl.layout import check_even, check_layout, check_seqlen, is_balanced_name, positions, shard

Tensor = torch.Tensor
KINDS = ("single", "sp", "tp_v1", "tp_v3")


@dataclass
class ParallelPlan:
    kind: str                          # one of KINDS
    group: object = None               # the sequence (or tensor) parallel group; None = default group
    layout: str = "contiguous"
    method: object = None              # the attention ``burst_impl.method.Method`` (sequence parallelism)
    options: dict = field(default_factory=dict)
    reduce_grads: tuple[str, ...] = ()  # parameters whose gradients are partial sums over the group
    weights: str = "replicated"        # or "fsdp2"
    rank: int = 0
    world_size: int = 1
    mask: str = ""                     # the model's mask (ModelConfig.mask): what "balanced" balances

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"kind={self.kind!r} is unknown; choose one of {KINDS}")
        if is_balanced_name(self.layout):
            chunks_of(self.layout)          # ValueError for a malformed "balanced:K"
        else:
            check_layout(self.layout)

    def resolved_layout(self, seqlen: int):
        """``layout`` for a global sequence of ``seqlen`` tokens: ``"balanced[:K]"`` becomes the balanced
        ChunkLayout of the causal model's mask (``masks.resolve``), as the attention method resolves it."""
        if not is_balanced_name(self.layout):
            return self.layout
        return resolve_layout(self.layout, masks.resolve(True, self.mask or None, seqlen), seqlen, self.world_size)

    @property
    def shards_sequence(self) -> bool:
        """True when each rank holds N/G tokens (SP, TP-V3), False when every rank holds all N."""
        return self.kind in ("sp", "tp_v3") and self.world_size > 1

    def check_seqlen(self, seqlen: int) -> None:
        """ValueError (before any communication) unless the global sequence splits for the layout."""
        if self.shards_sequence and self.kind == "tp_v3":   # its all-gather takes equal shards
            check_even(seqlen, self.layout, self.world_size, who="tp_v3")
        elif self.shards_sequence:                          # any N >= the layout's chunks (issue 22)
            check_seqlen(seqlen, self.resolved_layout(seqlen), self.world_size)
        elif seqlen <= 0:
            raise ValueError(f"seqlen={seqlen} must be positive")

    def positions(self, seqlen: int, device=None) -> Tensor:
        """Global positions (S,) of this rank's tokens, in local order."""
        self.check_seqlen(seqlen)
        if not self.shards_sequence:
            return torch.arange(seqlen, device=device)
        return positions(self.resolved_layout(seqlen), self.rank, self.world_size, seqlen).to(device)

    def local(self, x: Tensor) -> Tensor:
        """This rank's tokens of a global (B, N, ...) tensor."""
        if not self.shards_sequence:
            return x
        return shard(x, self.resolved_layout(x.shape[1]), self.rank, self.world_size)


SINGLE = ParallelPlan("single")


def plan_of(model) -> ParallelPlan:
    return model.parallel if model.parallel is not None else SINGLE


def local_batch(model, tokens: Tensor, labels: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(tokens, labels, positions) of this rank from the global batch (B, N), identical on all ranks."""
    plan = plan_of(model)
    if tokens.shape != labels.shape or tokens.dim() != 2:
        raise ValueError(f"tokens {tuple(tokens.shape)} and labels {tuple(labels.shape)} must both be (B, N)")
    pos = plan.positions(tokens.shape[1], device=tokens.device)
    return plan.local(tokens), plan.local(labels), pos


def global_mean(model, loss_sum: Tensor, count: Tensor) -> Tensor:
    """The mean token loss over every rank's tokens.

    The value is sum_all / count_all (an all-reduce of [sum, count], counted as
    kind "loss"); the gradient is that of local_sum / count_all, this rank's
    share, so that summing the weight gradients over the group (``sync_grads``
    or FSDP2's reduce-scatter) gives exactly the single-device gradient.
    """
    return mean_over(plan_of(model), loss_sum, count)


def mean_over(plan: ParallelPlan, loss_sum: Tensor, count: Tensor) -> Tensor:
    """``global_mean`` for the tokens ``plan`` splits, without a model (e.g. a Hugging Face model's
    loss, ``baselines.hf``)."""
    if not plan.shards_sequence:
        return loss_sum / count
    both = torch.stack([loss_sum.detach().to(torch.float64), count.to(torch.float64)])
    total_sum, total_count = all_reduce_(both, plan.group, "forward", "loss")
    others = (total_sum - loss_sum.detach().to(torch.float64)).to(loss_sum.dtype)  # no gradient
    return (loss_sum + others) / total_count.to(loss_sum.dtype)


BUCKET_BYTES = 64 << 20   # gradients are all-reduced in flat buckets of at most this size (or one tensor)


def bucket_sizes(sizes: list[int]) -> list[int]:
    """Bytes of each flat bucket ``sync_grads`` forms from gradients of ``sizes`` bytes, in order:
    consecutive gradients while the bucket stays within BUCKET_BYTES (a larger gradient is a bucket
    of its own). The memory model (``memory.step_memory``) takes the largest."""
    return [sum(sizes[a:b]) for a, b in _bucket_bounds(sizes)]


def _bucket_bounds(sizes: list[int]) -> list[tuple[int, int]]:
    out, start, size = [], 0, 0
    for i, n in enumerate(sizes):
        if i > start and size + n > BUCKET_BYTES:
            out.append((start, i))
            start, size = i, 0
        size += n
    return out + ([(start, len(sizes))] if sizes else [])


def _buckets(tensors: list[Tensor]) -> list[list[Tensor]]:
    return [tensors[a:b] for a, b in _bucket_bounds([comm.nbytes(t) for t in tensors])]


def _reduced(model) -> list[Tensor]:
    plan = plan_of(model)
    if plan.world_size == 1 or plan.weights == "fsdp2" or not plan.reduce_grads:
        return []
    named = dict(model.named_parameters())
    return [named[n] for n in plan.reduce_grads]


def sync_grads(model) -> None:
    """Sum the partial gradients of ``plan.reduce_grads`` over the group: counted all-reduces
    (phase "backward", kind "grads") of flat buckets. No-op on one rank and under FSDP2."""
    sum_grads(plan_of(model), _reduced(model))


def sum_grads(plan: ParallelPlan, params: list[Tensor]) -> None:
    """``sync_grads`` of ``params`` over ``plan.group``, without a model (``baselines.hf``)."""
    if plan.world_size == 1:
        return
    grads = [p.grad for p in params if p.grad is not None]
    for bucket in _buckets(grads):
        flat = all_reduce_(torch.cat([g.reshape(-1) for g in bucket]), plan.group, "backward", "grads")
        for g, part in zip(bucket, flat.split([g.numel() for g in bucket])):
            g.copy_(part.view_as(g))


def grad_sync_bytes(model) -> dict[tuple[str, str], int]:
    """Bytes one rank sends in ``sync_grads`` (per bucket of n bytes: 2 n (G-1)/G)."""
    G = plan_of(model).world_size
    n = sum(2 * sum(comm.nbytes(p) for p in b) * (G - 1) // G for b in _buckets(_reduced(model)))
    return {("backward", "grads"): n} if n else {}
