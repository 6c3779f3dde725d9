"""FSDP2 (``torch.distributed.fsdp.fully_shard``) over the sequence-parallel group, for HF models.

Each decoder layer, then the root (embeddings, final norm, LM head), becomes an FSDP2 unit over the
SAME group as the sequence split (BurstEngine's "Burst+ZeRO"), as ``burst_impl.model.fsdp`` does
for the suite's own model, with the two settings gloo needs (found there, torch 2.13): the
gradient divide factor is 1 on EVERY unit (``global_loss`` already gives each rank its share of the
global mean, so the reduction must be a sum), and sum-only reductions (otherwise FSDP2 uses
``ReduceOp.PREMUL_SUM``, which gloo rejects).
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def decoder_layers(model) -> torch.nn.ModuleList:
    """The decoder layers of an HF causal LM (``model.model.layers`` for Llama, Qwen2, Mistral)."""
    layers = getattr(getattr(model, "base_model", model), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise ValueError(f"model={type(model).__name__} has no base_model.layers ModuleList: shard_model wraps each "
                         "decoder layer in an FSDP2 unit and needs to find them")
    return layers


def shard_model(model, group=None, *, reshard_after_forward: bool = True, mp_policy=None):
    """Shard ``model``'s weights over ``group`` with FSDP2, in place; no-op without a process group."""
    # public only from torch 2.6 (pyproject allows 2.4), as burst_impl/model/fsdp.py
    from torch.distributed.device_mesh import DeviceMesh  # noqa: PLC0415 (torch >= 2.6 only)
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # noqa: PLC0415 (torch >= 2.6 only)

    if not dist.is_initialized():
        return model
    layers = decoder_layers(model)
    device_type = next(model.parameters()).device.type
    mesh = DeviceMesh.from_group(group if group is not None else dist.group.WORLD, device_type)
    kw = dict(mesh=mesh, reshard_after_forward=reshard_after_forward,
              mp_policy=mp_policy if mp_policy is not None else MixedPrecisionPolicy())
    for layer in layers:
        fully_shard(layer, **kw)
    fully_shard(model, **kw)
    for unit in (*layers, model):
        unit.set_gradient_divide_factor(1.0)
        unit.set_force_sum_reduction_for_comms(True)
    return model


def full_grads(model) -> dict[str, torch.Tensor]:
    """``{name: full gradient}``: all-gathered from FSDP2 shards (a collective), plain tensors as they are."""
    out = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            out[name] = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
    return out
