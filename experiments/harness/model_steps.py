"""Model-level steps (``measure.level: model``): a decoder trained or prefilled, built per case.

``train``: ``burst_impl.model.train_step`` = forward, loss as the mean over
all global tokens, backward, gradient synchronisation (all-reduce, or FSDP2's
reduce-scatter), optimizer step. ``prefill``: ``prefill_step`` = the prompt's
forward and the first generated token (first-token latency, Tables 2/3).

The model is ``model.name`` with the case's loss and checkpoint mode (``case_config``), in the case's
dtype on the worker's device, weights
drawn from the case's seed (identical on every rank), then split by the
method: op-level registry methods through ``sequence_parallel`` (+
``shard_weights`` for ``zero``), ``tp_v1``/``tp_v3`` through
``tensor_parallel``; the case's kernel is the local attention kernel
(``math``: materialised scores, the papers' "without LAO / FlashAttention").
Tokens are one seeded global batch of the synthetic Markov corpus
(``burst_impl.model.data``), the same on every rank and every step (values
do not change the work).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from baselines.registry import get
from baselines.tensor_parallel import tensor_parallel
from burst_impl.model import get_config, prefill_step, sequence_parallel, shard_weights
from burst_impl.model import build_model as build_decoder
from burst_impl.model.config import ModelConfig
from burst_impl.model.data import batch_at, load_corpus
from burst_impl.model.fsdp import comm_bytes as fsdp_comm_bytes
from burst_impl.model.parallel import grad_sync_bytes, plan_of
from burst_impl.model.sequence_parallel import layer_comm_bytes as sp_layer_bytes
from burst_impl.model.step import train_step
from baselines.tensor_parallel import layer_comm_bytes as tp_layer_bytes

from .spec import Case
from .timed_step import Step

LEARNING_RATE = 1e-5      # small: timed steps must not drive bf16 weights to inf/nan


@dataclass
class ModelRun:
    """What a model-level step holds, for its record."""

    cfg: ModelConfig
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer | None
    tokens: torch.Tensor                   # (B, N) global batch, on the device
    labels: torch.Tensor
    losses: list[torch.Tensor] = field(default_factory=list)

    def state_bytes(self) -> int:
        """Bytes this rank keeps between steps: its weights, gradients and optimizer state."""
        def local(t):
            t = t.to_local() if hasattr(t, "to_local") else t
            return t.numel() * t.element_size()
        total = sum(local(p) + (local(p.grad) if p.grad is not None else 0) for p in self.model.parameters())
        if self.optimizer is not None:
            total += sum(local(v) for st in self.optimizer.state.values() for v in st.values()
                         if isinstance(v, torch.Tensor) and v.dim() > 0)
        return total

    def comm_formula(self, case: Case) -> dict[tuple[str, str], int]:
        """``{(phase, kind): bytes}`` one rank sends per step: the per-layer closed form x layers, the
        gradient all-reduce and FSDP2's collectives (prefill: the forward phase of the layers only)."""
        per_layer = layer_bytes(case, self.cfg)
        out = {k: v * self.cfg.n_layers for k, v in per_layer.items()}
        G = case.world_size
        ring = lambda n: 2 * n * (G - 1) // G          # noqa: E731 - an all-reduce of n bytes (collectives.all_reduce_)
        if case.mode == "train":
            for k, v in {**grad_sync_bytes(self.model), **self.fsdp_bytes()}.items():
                out[k] = out.get(k, 0) + v
            if plan_of(self.model).shards_sequence:
                out[("forward", "loss")] = ring(2 * 8)   # [sum, count] in fp64 (parallel.global_mean)
        else:
            out = {k: v for k, v in out.items() if k[0] == "forward"}
            if plan_of(self.model).shards_sequence:
                out[("forward", "next_token")] = ring(8 * case.batch)   # B int64 ids (step.prefill_step)
        return {k: v for k, v in out.items() if v}

    def fsdp_bytes(self) -> dict:
        return fsdp_comm_bytes(self.model) if plan_of(self.model).weights == "fsdp2" else {}


def layer_bytes(case: Case, cfg: ModelConfig) -> dict[tuple[str, str], int]:
    """One layer's bytes per rank (forward + backward) of the case's method: the attention method's
    closed form (sequence parallelism; projections and MLP send nothing) or TP's 4BZNd-style formula."""
    s = case.shape
    method = get(case.method)
    if method.tp_version is not None:
        return tp_layer_bytes(cfg, method.tp_version, s.batch, s.seqlen, s.world_size, s.elem_size)
    return sp_layer_bytes(cfg, method, s.batch, s.seqlen, s.world_size, s.layout, s.dtype)


def case_config(case: Case) -> ModelConfig:
    """The case's decoder with its training setup (the spec's loss and checkpoint mode, or its variant's) and
    the case's attention mask (the ``mask`` sweep axis: every block's attention, intersected with causal)."""
    return replace(get_config(case.model), loss=case.loss, checkpoint=case.checkpoint, mask=case.shape.mask)


def build_model(case: Case, *, group, device: torch.device, parallel: bool = True
                ) -> tuple[ModelConfig, torch.nn.Module]:
    """The case's model on ``device``, split by its method (sequence parallel, + FSDP2, or TP); with
    ``parallel=False`` not split (the single-process reference of ``model_parity.py``)."""
    cfg = case_config(case)
    s = case.shape
    model = build_decoder(cfg, seed=case.seed, dtype=s.torch_dtype, device=device)
    if not parallel:
        return cfg, model
    method = get(case.method)
    if method.tp_version is not None:
        fused = case.kernel != "math"
        tensor_parallel(model, method.tp_version, group=group, layout=s.layout, fused=fused,
                        backend=case.kernel if fused else None)
    else:
        sequence_parallel(model, method, group=group, layout=s.layout,
                          **({"backend": case.kernel} if case.kernel else {}))
        if case.zero:
            shard_weights(model)
    return cfg, model


def build_model_run(case: Case, *, group, device: torch.device, parallel: bool = True) -> ModelRun:
    cfg, model = build_model(case, group=group, device=device, parallel=parallel)
    s = case.shape
    optimizer = None
    if case.mode == "train":
        params = list(model.parameters())
        optimizer = (torch.optim.AdamW(params, lr=LEARNING_RATE) if case.optimizer == "adamw"
                     else torch.optim.SGD(params, lr=LEARNING_RATE))
    else:
        model.requires_grad_(False)
    corpus = load_corpus("markov", cfg.vocab_size, n_tokens=max(1 << 12, s.seqlen + 1), seed=case.seed)
    tokens, labels = batch_at(corpus, 0, s.batch, s.seqlen, seed=case.seed)
    return ModelRun(cfg, model, optimizer, tokens.to(device), labels.to(device))


def build_model_step(case: Case, *, rank: int, group, device: torch.device):
    run = build_model_run(case, group=group, device=device)
    if case.mode == "train":
        def step():
            run.losses.append(train_step(run.model, run.optimizer, run.tokens, run.labels))
    else:
        def step():
            return prefill_step(run.model, run.tokens)
    return Step(step=step, setup=None, start_bytes=0, context=run)
