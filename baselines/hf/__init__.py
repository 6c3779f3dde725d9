"""The suite's sequence-parallel attention methods inside unmodified Hugging Face models.

transformers routes every attention call of its modern decoders (Llama, Qwen2,
Mistral, ...) through ``transformers.AttentionInterface``: a dict from the name in
``config._attn_implementation`` to ``fn(module, query, key, value, attention_mask,
scaling=..., dropout=..., sliding_window=..., **kwargs) -> (attn_output, attn_weights)``.
Registering a registry method there is all a model needs to run sequence-parallel:

    import baselines.hf as hf
    name = hf.use_method(model, "burst", layout="zigzag")       # checks, registers "burst:burst", sets it
    batch = hf.shard_batch(input_ids, layout="zigzag")         # this rank's tokens, global positions,
    out = model(**batch.model_inputs())                        #   labels shifted once before sharding
    loss = hf.global_loss(out.logits, batch.labels)            # mean over every rank's tokens
    loss.backward(); hf.sync_grads(model)                      # summed weight grads = single-process ones

Modules: ``attention`` (the AttentionInterface function of a bound method),
``register`` (names, ``register``/``register_all``/``use_method``), ``checks``
(model and method rules, before any byte is sent), ``batch`` (global batch ->
this rank's inputs), ``loss`` (global mean loss, gradient all-reduce), ``fsdp``
(FSDP2 over the sequence group), ``models`` (small Llama/Qwen2/Mistral configs),
``example`` (``python -m baselines.hf.example``), ``generate`` (``hf_generate``: ``generate()`` on a
sharded KV cache). docs/hf.md says what is and
is not supported. The baselines floor: imports ``burst_impl`` and ``baselines``,
never ``experiments``; transformers (the ``[hf]`` extra) is imported only where
a function needs it.
"""
from __future__ import annotations

from .attention import MASK_KWARG, Binding
from .batch import ShardedBatch, global_inputs, shard_batch
from .checks import check_model
from .fsdp import full_grads, shard_model
from .generate import hf_generate, sharded_cache
from .loss import global_loss, sync_grads, token_loss_sum
from .register import PREFIX, default_name, register, register_all, sp_methods, use_method
from .step import single_loss_and_grads, sp_loss_and_grads

__all__ = [
    "MASK_KWARG", "Binding", "ShardedBatch", "global_inputs", "shard_batch", "check_model", "full_grads", "shard_model",
    "global_loss", "sync_grads", "token_loss_sum", "PREFIX", "default_name", "register", "register_all",
    "sp_methods", "use_method", "single_loss_and_grads", "sp_loss_and_grads", "hf_generate", "sharded_cache",
]
