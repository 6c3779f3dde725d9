"""The AttentionInterface function of one registry method bound to a layout, a group and options.

transformers 5.x calls (``models/llama/modeling_llama.py``, ``LlamaAttention.forward``)

    attn_output, attn_weights = attention_interface(module, query, key, value, attention_mask,
                                                    dropout=..., scaling=..., [sliding_window=...], **kwargs)

with query (B, Z, S, d) and key, value (B, Z_kv, S, d) after RoPE (heads before the sequence), and
reshapes ``attn_output`` (B, S, Z, d) to (B, S, Z*d) for ``o_proj``. The suite's methods take local
shards (B, S, Z, d): a transpose, which is a view (the methods accept any strides). Grouped-query
attention goes in as it is (Z_kv < Z): every method handles it, no ``repeat_kv``.

Masks. The model builds no mask: the causal mask, the sliding window and packed documents are the
suite's ``burst_impl.masks`` over GLOBAL positions, whatever the layout. A name that is not in
transformers' ``AttentionMaskInterface`` makes ``masking_utils._preprocess_mask_arguments`` return
None and silently DROP a padding mask given to the model; so every name is also registered there
with ``refuse_mask``, which returns None (no mask) and raises on a padding mask (it belongs in
``shard_batch``). HF's packed-sequence detection, which zigzag's non-monotonic positions would
trigger, only feeds the mask function, which ignores it. ``sliding_window=w`` (Mistral, Qwen2's sliding layers) is
HF's ``q - w < k <= q``, i.e. ``masks.sliding_window(w - 1, 0)``; packed documents arrive as the
keyword ``burst_mask`` (``MASK_KWARG``, a ``masks.Documents`` that ``shard_batch`` made and
``ShardedBatch.model_inputs`` passes to the model, which hands its kwargs down to attention).
Everything that cannot be expressed is a ValueError before the method sends a byte.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from baselines.registry import get
from burst_impl import comm, masks

MASK_KWARG = "burst_mask"
Tensor = torch.Tensor


@dataclass(frozen=True)
class Binding:
    """A registry method with what every call of it shares: layout, process group, options."""

    method: str
    layout: str = "zigzag"
    group: object = None                      # the sequence-parallel group; None = the default group
    options: dict = field(default_factory=dict)


def suite_mask(doc_mask, sliding_window, seqlen: int):
    """The one ``burst_impl.masks`` mask of a call (None: plain causal) over ``seqlen`` global tokens.

    ``doc_mask``: a ``masks.Documents`` from ``shard_batch`` or None; ``sliding_window``: HF's window
    w (keys q-w+1..q) or None. A window of at least N tokens is plain causal.
    """
    window = None
    if sliding_window is not None:
        if isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window < 1:
            raise ValueError(f"sliding_window={sliding_window!r} must be a positive integer (HF: each query "
                             "attends to itself and the sliding_window-1 keys before it)")
        if sliding_window < seqlen:
            window = masks.sliding_window(sliding_window - 1, 0)
    if doc_mask is not None and not isinstance(doc_mask, masks.Documents):
        raise ValueError(f"{MASK_KWARG}={doc_mask!r} must be a burst_impl.masks.Documents (made by "
                         "baselines.hf.shard_batch) or None")
    if doc_mask is not None and window is not None:
        raise ValueError(f"sliding_window={sliding_window} with packed documents ({MASK_KWARG}): the suite has "
                         "no mask that is both a window and documents yet; give shard_batch one document per "
                         "sequence, or use a model without sliding-window layers")
    mask = doc_mask if doc_mask is not None else window
    if mask is not None:
        mask.validate(seqlen)
    return mask


def refuse_mask(*args, attention_mask=None, **kwargs):
    """The ``AttentionMaskInterface`` entry of every registered name: no mask (None) for the layers,
    and a ValueError for a padding mask given to the model, which the methods would otherwise never see."""
    if attention_mask is not None:
        raise ValueError(f"attention_mask of shape {tuple(attention_mask.shape)} was given to the model: pass the "
                         "GLOBAL padding mask to baselines.hf.shard_batch (right padding becomes ignored labels; "
                         "other padding is refused there) and call the model without attention_mask")
    return None


def _check_call(module, query: Tensor, key: Tensor, attention_mask, dropout, kwargs) -> None:
    """ValueError for what the methods cannot do; all local, identical on every rank."""
    if attention_mask is not None:
        raise ValueError(f"attention_mask of shape {tuple(attention_mask.shape)} reached the attention: pass the "
                         "padding mask to baselines.hf.shard_batch (which turns it into labels and the suite's "
                         "masks), and call the model with attention_mask=None")
    if dropout:
        raise ValueError(f"dropout={dropout}: the suite's methods have no attention dropout; set "
                         "config.attention_dropout=0")
    if not getattr(module, "is_causal", True) or kwargs.get("is_causal") is False:
        raise ValueError("is_causal=False: only causal decoders are supported (bidirectional attention is not)")
    if kwargs.get("softcap"):
        raise ValueError(f"softcap={kwargs['softcap']}: logit soft-capping is not supported by the methods")
    if query.dim() != 4 or key.shape[2] != query.shape[2]:
        raise ValueError(f"query {tuple(query.shape)} and key {tuple(key.shape)} must be (B, heads, S, d) with the "
                         "same S: a KV cache (generation, use_cache=True) is not supported; call the model "
                         "with use_cache=False")


def attention_function(binding: Binding):
    """``fn(module, query, key, value, attention_mask, ...) -> (out (B, S, Z, d), None)`` for
    ``AttentionInterface.register``."""
    method = get(binding.method)

    def burst_attention(module, query: Tensor, key: Tensor, value: Tensor, attention_mask, scaling=None,
                        dropout: float = 0.0, sliding_window=None, **kwargs):
        _check_call(module, query, key, attention_mask, dropout, kwargs)
        _, world_size = comm.world(binding.group)
        mask = suite_mask(kwargs.get(MASK_KWARG), sliding_window, query.shape[2] * world_size)
        # (B, Z, S, d) -> (B, S, Z, d): views; the methods take any strides.
        q, k, v = (t.transpose(1, 2) for t in (query, key, value))
        out = method.call(q, k, v, causal=True, mask=mask, softmax_scale=scaling, group=binding.group,
                          layout=binding.layout, **binding.options)
        return out, None      # (B, S, Z, d); no attention weights (never materialised)

    burst_attention.__name__ = f"burst_attention_{binding.method}"
    burst_attention.binding = binding
    return burst_attention
