"""BurstEngine's model: a LLaMA-style decoder trained and prefilled with sequence or tensor parallelism.

One concept per file:

* ``config``: ``ModelConfig`` dataclasses, ``CONFIGS`` registry (``get_config``), parameter counts;
* ``layers``: RMSNorm, RoPE at global positions, SwiGLU MLP, attention block with a swappable core;
* ``model``: ``Transformer``, ``build_model``, the loss hook ``loss_fn``, ``wrap_blocks``;
* ``parallel``: ``ParallelPlan``, local batches, the global mean loss, gradient synchronisation;
* ``sequence_parallel``: ``sequence_parallel(model, method, group=, layout=)`` with an attention
  ``Method`` (Megatron tensor parallelism of the whole model is a baseline: ``baselines.tensor_parallel``);
* ``fsdp``: ``shard_weights(model)``, ZeRO-3-style weights through FSDP2;
* ``data``: seeded synthetic and shipped-text corpora, ``batch_at``;
* ``step``: ``train_step``, ``prefill_step``, ``loss_and_grads``;
* ``flops``: the model FLOP convention, ``model_flops``.
"""
from .config import CONFIGS, ModelConfig, get_config, matmul_params, num_params
from .flops import model_flops
from .fsdp import shard_weights
from .model import Transformer, build_model, cross_entropy_sum, wrap_blocks
from .parallel import ParallelPlan, sync_grads
from .sequence_parallel import sequence_parallel
from .step import forward_loss, loss_and_grads, prefill_step, train_step

__all__ = ["CONFIGS", "ModelConfig", "ParallelPlan", "Transformer", "build_model", "cross_entropy_sum",
           "forward_loss", "get_config", "loss_and_grads", "matmul_params", "model_flops", "num_params",
           "prefill_step", "sequence_parallel", "shard_weights", "sync_grads", "train_step",
           "wrap_blocks"]
