"""A GLOBAL batch -> this rank's model inputs for a layout (``shard_batch``).

Every rank gets the same global batch and keeps its layout shard of the tokens. What the
single-process model does implicitly must be made explicit before sharding:

* positions: HF's default ``position_ids`` are ``arange(S)`` of the LOCAL length; a shard needs
  its tokens' global positions (within their document when packed), or RoPE rotates them wrongly;
* labels: HF's causal-LM loss shifts labels by one inside the model; on a shard that pairs a token
  with its local neighbour, which is another shard's token's label (zigzag, striped) or nothing
  (the shard's last token). So labels are shifted ONCE over the global sequence, then sharded, and
  the loss (``baselines.hf.loss``) does not shift again. The last token, pad tokens and the last
  token of each packed document get ``ignore_index``;
* padding: right padding (each row 1..1 0..0) needs no mask under causal attention (no real token
  sees a pad); its labels are ignored. Any other padding mask (left padding, holes) would need a
  per-row mask the methods cannot take: ValueError;
* packed documents (``cu_seqlens``, or ``position_ids`` that restart, HF's packing convention):
  the suite's ``masks.documents`` over global positions, one for the whole batch (every row must
  pack the same documents: the methods take one mask).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from burst_impl import comm, masks
from burst_impl.layout import check_seqlen, shard

from .attention import MASK_KWARG

Tensor = torch.Tensor


@dataclass
class ShardedBatch:
    """This rank's inputs: every tensor (B, S), S = N / world size, tokens in layout order."""

    input_ids: Tensor
    position_ids: Tensor           # global positions (within the document when packed)
    labels: Tensor                 # next-token labels, shifted once globally; ignore_index where none
    mask: masks.Documents | None   # packed documents over the global sequence; None: causal
    layout: str
    rank: int
    world_size: int

    def model_inputs(self) -> dict:
        """Keyword arguments for ``model(...)`` (no labels: the model must not shift them again)."""
        out = dict(input_ids=self.input_ids, position_ids=self.position_ids, use_cache=False)
        if self.mask is not None:
            out[MASK_KWARG] = self.mask
        return out


def shift_labels(labels: Tensor, ignore_index: int = -100) -> Tensor:
    """(B, N) -> (B, N): token t's target is labels[t + 1]; the last has none."""
    out = torch.full_like(labels, ignore_index)
    out[:, :-1] = labels[:, 1:]
    return out


def _right_padding_lengths(attention_mask: Tensor) -> Tensor | None:
    """(B,) real tokens per row of a right-padded 0/1 mask, None if nothing is padded; else ValueError."""
    m = attention_mask.to(torch.long)
    if not bool(((m == 0) | (m == 1)).all()):
        raise ValueError("attention_mask must hold only 0 and 1 (1 = real token)")
    lengths = m.sum(1)
    right = torch.arange(m.shape[1], device=m.device)[None] < lengths[:, None]
    if not torch.equal(m.bool(), right) or bool((lengths == 0).any()):
        raise ValueError(f"attention_mask rows {right.ne(m.bool()).any(1).nonzero().flatten().tolist() or 'all-zero'} "
                         "are not right-padded (1..1 then 0..0, at least one 1): the methods take one causal or "
                         "document mask for the whole batch, so left padding and holes cannot be expressed; "
                         "pad on the right")
    return None if bool((lengths == m.shape[1]).all()) else lengths


def _documents_from_positions(position_ids: Tensor, n: int) -> list[int]:
    """cu_seqlens of HF's packing convention: a document starts where position_ids[t] != [t-1] + 1.
    Rows without a restart may have different offsets (one document each); packed rows must agree."""
    pos = position_ids.reshape(-1, n)
    if bool((pos[:, 1:] == pos[:, :-1] + 1).all()):
        return [0, n]
    if not bool((pos == pos[:1]).all()):
        raise ValueError("position_ids differ between batch rows: the methods take one document mask for the "
                         "whole batch, so every row must pack the same documents (or use batch size 1)")
    starts = (torch.nonzero(pos[0, 1:] != pos[0, :-1] + 1).flatten() + 1).tolist()
    return [0, *starts, n]


def _positions_in_documents(cu: list[int], n: int) -> Tensor:
    pos = torch.arange(n)
    for a, b in zip(cu[:-1], cu[1:]):
        pos[a:b] -= a
    return pos


def _documents(position_ids, cu_seqlens, b: int, n: int) -> tuple[Tensor, list[int] | None]:
    """(global position_ids (B, N), cu_seqlens or None for one document)."""
    if cu_seqlens is not None:
        cu = [int(c) for c in (cu_seqlens.tolist() if isinstance(cu_seqlens, Tensor) else cu_seqlens)]
        masks.documents(cu).validate(n)
        pos = _positions_in_documents(cu, n)
        if position_ids is not None and not bool((position_ids.reshape(-1, n).cpu() == pos).all()):
            raise ValueError("position_ids disagree with cu_seqlens: give one of them (positions restart at 0 "
                             "at every document start)")
    elif position_ids is not None:
        if position_ids.numel() not in (n, b * n):
            raise ValueError(f"position_ids of shape {tuple(position_ids.shape)} must be (B, N), (1, N) or (N,) "
                             f"for input_ids (B={b}, N={n})")
        pos = position_ids.reshape(-1, n).cpu()
        cu = _documents_from_positions(pos, n)
    else:
        pos, cu = torch.arange(n), None
    if cu is not None and len(cu) == 2:
        cu = None
    return pos.expand(b, n), cu


def global_inputs(input_ids: Tensor, labels: Tensor | None = None, *, attention_mask: Tensor | None = None,
                  position_ids: Tensor | None = None, cu_seqlens=None,
                  ignore_index: int = -100) -> tuple[Tensor, Tensor, list[int] | None]:
    """(position_ids (B, N), shifted targets (B, N), cu_seqlens or None) of the global batch: what
    ``shard_batch`` cuts, and what the single-process model's loss uses (``baselines.hf.step``)."""
    if not isinstance(input_ids, Tensor) or input_ids.dim() != 2 or input_ids.dtype.is_floating_point:
        raise ValueError(f"input_ids must be an integer tensor (B, N); got {getattr(input_ids, 'shape', input_ids)!r}")
    b, n = input_ids.shape
    labels = input_ids if labels is None else labels
    if labels.shape != input_ids.shape:
        raise ValueError(f"labels {tuple(labels.shape)} must have the shape of input_ids {tuple(input_ids.shape)}")
    pos, cu = _documents(position_ids, cu_seqlens, b, n)
    target = shift_labels(labels, ignore_index)
    if cu is not None:
        target[:, [c - 1 for c in cu[1:]]] = ignore_index      # no target across a document boundary
    if attention_mask is not None:
        if tuple(attention_mask.shape) != (b, n):
            raise ValueError(f"attention_mask {tuple(attention_mask.shape)} must be (B, N) = {(b, n)}")
        lengths = _right_padding_lengths(attention_mask)
        if lengths is not None:                                # the last real token predicts nothing
            last = (lengths[:, None] - 1).to(target.device)
            target[torch.arange(n, device=target.device)[None] >= last] = ignore_index
    return pos.to(input_ids.device), target, cu


def shard_batch(input_ids: Tensor, labels: Tensor | None = None, *, layout: str = "zigzag", group=None,
                attention_mask: Tensor | None = None, position_ids: Tensor | None = None, cu_seqlens=None,
                ignore_index: int = -100) -> ShardedBatch:
    """This rank's ``ShardedBatch`` of the global batch ``input_ids`` (B, N); ``labels`` (B, N)
    unshifted, as HF takes them (default: ``input_ids``). ValueError before any communication."""
    rank, world_size = comm.world(group)
    if isinstance(input_ids, Tensor) and input_ids.dim() == 2:
        check_seqlen(input_ids.shape[1], layout, world_size, name="input_ids.shape[1] (global N)")
    pos, target, cu = global_inputs(input_ids, labels, attention_mask=attention_mask, position_ids=position_ids,
                                    cu_seqlens=cu_seqlens, ignore_index=ignore_index)
    def cut(x):
        return shard(x, layout, rank, world_size)

    return ShardedBatch(cut(input_ids), cut(pos), cut(target), None if cu is None else masks.documents(cu),
                        layout, rank, world_size)
