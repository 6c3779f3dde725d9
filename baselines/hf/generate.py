"""Generation through ``generate()`` of an unmodified Hugging Face causal LM on a KV cache sharded
across a context-parallel group (docs/hf.md, "Generation").

    out = hf_generate(model, input_ids, 64, temperature=0.8, seed=0, group=g)
    out.sequences    # (B, N + 64) on every rank;  out.logits: the raw logits of every step

The model is replicated and every rank runs the same ``generate()``. Three pieces carry the shards:

* ``ShardedCache`` (a ``transformers.cache_utils.Cache``): one ``ShardLayer`` per decoder layer,
  over a ``burst_impl.inference.ShardedKVCache``. Its ``update`` hands the new keys and values on
  unchanged instead of returning the whole sequence's: the shard is filled where it is attended.
  ``get_seq_length`` and ``get_mask_sizes`` report the sequence's global length, from which
  transformers derives ``cache_position`` and so the RoPE positions of the new tokens.
* an ``AttentionInterface`` function bound to the cache: the layer's (query, key, value) go to
  ``burst_impl.inference.decode`` with the all-gather merge (the prompt as one multi-token decode:
  ``generate()`` feeds the whole prompt to every rank, so each rank computes all its projections
  anyway), and the output is the same bits on every rank.
* ``OneDraw`` (a ``LogitsProcessor``, last in the list): rank 0 draws the token
  (``burst_impl.inference.generate.sample``) and broadcasts it; the scores become 0 at the token
  and -inf elsewhere, and ``generate()`` runs greedy, so it picks that token on every rank.
"""
from __future__ import annotations

import itertools

import torch

from burst_impl import comm
from burst_impl.inference import ShardedKVCache, decode
from burst_impl.inference.agree import agree
from burst_impl.inference.generate import agreed_token, fingerprint

Tensor = torch.Tensor
PREFIX = "burst_kv:"
_names = itertools.count()


def _transformers():
    try:
        import transformers  # noqa: PLC0415 (optional dependency)
        from transformers import cache_utils  # noqa: PLC0415 (optional dependency)
    except ImportError as e:
        raise ImportError(f"baselines.hf needs transformers (the [hf] extra: pip install -e '.[hf]'): {e}") from e
    return transformers, cache_utils


def _layer_class():
    _, cache_utils = _transformers()

    class ShardLayer(cache_utils.CacheLayerMixin):
        """One decoder layer of a ``ShardedKVCache``, seen by transformers."""

        def __init__(self, shards: ShardedKVCache, layer: int):
            super().__init__()
            self.shards, self.layer = shards, layer
            self.is_initialized = True

        def lazy_initialization(self, key_states, value_states) -> None:
            return None

        def update(self, key_states, value_states, *args, **kwargs):
            return key_states, value_states          # the attention function appends them to this rank's shard

        def get_seq_length(self) -> int:
            return self.shards.lengths(self.layer)[0]

        def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
            return self.get_seq_length() + query_length, 0

        def get_max_length(self) -> int:
            return -1

    return ShardLayer


def sharded_cache(shards: ShardedKVCache):
    """A ``transformers`` ``Cache`` whose layers are the layers of ``shards``."""
    _, cache_utils = _transformers()
    layer = _layer_class()
    return cache_utils.Cache(layers=[layer(shards, i) for i in range(shards.n_layers)])


def _attention(shards: ShardedKVCache, group):
    def attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
        if attention_mask is not None:
            raise ValueError(f"attention_mask of shape {tuple(attention_mask.shape)} reached the sharded-cache "
                             "attention: hf_generate builds no mask (causality comes from the cached positions)")
        if dropout:
            raise ValueError(f"dropout={dropout} must be 0 in generation (call model.eval())")
        q, k, v = (t.transpose(1, 2) for t in (query, key, value))            # (B, S, heads, d)
        out, _ = decode(q, k, v, shards, module.layer_idx, merge="all_gather", softmax_scale=scaling, group=group)
        return out, None
    return attention


def one_draw(temperature: float, seed: int, group):
    transformers, _ = _transformers()
    rank, _ = comm.world(group)

    class OneDraw(transformers.LogitsProcessor):
        """Rank 0's draw, broadcast; the scores keep only that token (generate() runs greedy)."""

        def __init__(self):
            self.generator = torch.Generator().manual_seed(seed) if temperature and rank == 0 else None

        def __call__(self, input_ids, scores):
            token = agreed_token(scores, temperature, self.generator, group)
            out = torch.full_like(scores, float("-inf"))
            return out.scatter_(1, token[:, None], 0.0)

    return OneDraw()


def hf_generate(model, input_ids: Tensor, max_new_tokens: int, *, temperature: float = 0.0, seed: int = 0,
                max_len: int | None = None, placement: str = "round_robin", group=None):
    """``model.generate()`` of ``max_new_tokens`` after ``input_ids`` (B, N) on a ``ShardedKVCache``; returns
    generate()'s output (``sequences``, raw ``logits`` per step) with ``.cache``, this rank's shards."""
    _check(model, input_ids, max_new_tokens, temperature, max_len, seed, group)
    _transformers()
    from transformers import AttentionInterface  # noqa: PLC0415 (optional dependency)

    cfg = model.config
    weight = model.get_output_embeddings().weight
    shards = ShardedKVCache.empty(cfg.num_hidden_layers, input_ids.shape[0], cfg.num_key_value_heads,
                                  getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
                                  dtype=weight.dtype, device=weight.device, placement=placement, group=group)
    name = f"{PREFIX}{next(_names)}"
    AttentionInterface.register(name, _attention(shards, group))
    before = cfg._attn_implementation
    model.set_attn_implementation(name)
    try:
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), cache=sharded_cache(shards),
                             max_new_tokens=max_new_tokens,
                             min_new_tokens=max_new_tokens, do_sample=False, logits_processor=[
                                 one_draw(temperature, seed, group)], output_logits=True,
                             return_dict_in_generate=True, pad_token_id=0, eos_token_id=None)
    finally:
        model.set_attn_implementation(before)
    out.cache = shards
    return out


def _check(model, input_ids, max_new_tokens, temperature, max_len, seed, group) -> None:
    """The local rules and the ranks' agreement on them, before any byte."""
    def checks():
        if not isinstance(input_ids, Tensor) or input_ids.dim() != 2 or input_ids.shape[1] < 1:
            raise ValueError(f"input_ids={getattr(input_ids, 'shape', type(input_ids).__name__)} must be a "
                             "(batch, prompt tokens) tensor with at least one token")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={max_new_tokens!r} must be a positive int")
        if not isinstance(temperature, (int, float)) or not temperature >= 0:
            raise ValueError(f"temperature={temperature!r} must be a number >= 0 (0: greedy)")
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed={seed!r} must be an int >= 0")
        total = input_ids.shape[1] + max_new_tokens
        if max_len is not None and total > max_len:
            raise ValueError(f"prompt length {input_ids.shape[1]} + max_new_tokens={max_new_tokens} = {total} "
                             f"exceeds max_len={max_len}, the tokens per sequence the cache may hold")
        if model.training:
            raise ValueError("model is in training mode: call model.eval() before generating")
    agree(group, checks, dict(op="hf_generate", seed=seed, temperature=temperature, max_new_tokens=max_new_tokens,
                              max_len=max_len, prompt=fingerprint(input_ids),
                              shape=tuple(getattr(input_ids, "shape", ()))))
