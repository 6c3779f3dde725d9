"""ZeRO-3-style weights for the sequence-parallel model through PyTorch FSDP2 (``fully_shard``).

    model = shard_weights(sequence_parallel(build_model(cfg), get("burst"), group=g, layout="zigzag"))

Every block, then the root (embedding, final norm, LM head), becomes an FSDP2
unit over the SAME group as the sequence split (BurstEngine's "Burst+ZeRO":
one group does both): each rank stores 1/G of every weight, of its gradient
and of the optimizer state; a block's weights are all-gathered before its
forward (and again before its backward when ``reshard_after_forward``) and
its gradients reduce-scattered in the backward. Because ``global_mean`` gives
each rank the gradient of its share of the global loss, the reduction must
be a SUM: the gradient divide factor is set to 1 (FSDP2 averages by default).

Found on torch 2.13 (CPU, gloo): ``fully_shard`` works with a DeviceMesh made
from the process group (``DeviceMesh.from_group(group, "cpu")``); parameters
become DTensors sharded on dim 0 (padded when G does not divide it). FSDP2
averages gradients by default; a divide factor of 1 must be set on EVERY unit
(the root's setter does not reach the blocks), and alone it selects
``ReduceOp.PREMUL_SUM``, which gloo rejects ("Cannot use ReduceOp.PREMUL_SUM
with Gloo"): ``set_force_sum_reduction_for_comms(True)`` makes it a plain SUM
(NCCL would accept either). The registry methods' point-to-point rings and the
all-to-alls run on the same gloo group between FSDP2's collectives, in the
same order on every rank. The tests check losses and gradients against the
replicated model.

FSDP2's collectives are issued inside torch, not through our counted
wrappers, so their bytes are a formula (``comm_bytes``), not a measurement.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from .parallel import plan_of


def _mesh(group, device_type: str):
    return DeviceMesh.from_group(group if group is not None else dist.group.WORLD, device_type)


def shard_weights(model, *, reshard_after_forward: bool = True, mp_policy=None):
    """Shard the weights of a sequence-parallel ``model`` over its group with FSDP2. In place.

    ``mp_policy``: an FSDP2 ``MixedPrecisionPolicy`` (e.g. bf16 compute, fp32 reduce) for GPU runs.
    """
    # public in torch.distributed.fsdp from torch 2.6; pyproject allows torch>=2.4
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # noqa: PLC0415 (optional dependency)

    plan = plan_of(model)
    if plan.kind != "sp":
        raise ValueError(f"model parallel kind={plan.kind!r}: shard_weights needs a sequence_parallel model "
                         f"(FSDP2 over the sequence group)")
    if plan.weights == "fsdp2":
        raise ValueError("model weights are already sharded with FSDP2")
    if not dist.is_initialized():
        return model   # plain python, one process: ZeRO-3 over one rank keeps every weight whole
    device_type = next(model.parameters()).device.type
    mesh = _mesh(plan.group, device_type)
    kw = dict(mesh=mesh, reshard_after_forward=reshard_after_forward,
              mp_policy=mp_policy if mp_policy is not None else MixedPrecisionPolicy())
    for block in model.layers:
        fully_shard(block, **kw)
    fully_shard(model, **kw)
    # Gradients are already shares of the global mean: SUM them. The divide factor is per FSDP unit
    # (the root's setter does not reach the blocks); a factor other than G makes FSDP2 use
    # ReduceOp.PREMUL_SUM, which gloo rejects, unless sum-only reductions are forced.
    for unit in (*model.layers, model):
        unit.set_gradient_divide_factor(1.0)
        unit.set_force_sum_reduction_for_comms(True)
    plan.weights = "fsdp2"
    return model


def full_grads(model) -> dict[str, torch.Tensor]:
    """``{name: full gradient}`` (all-gathered from the FSDP2 shards; plain tensors as they are)."""
    out = {}
    for name, p in model.named_parameters():
        g = p.grad
        if g is None:
            continue
        out[name] = g.full_tensor() if hasattr(g, "full_tensor") else g
    return out


def comm_bytes(model, *, reshard_after_forward: bool = True) -> dict[tuple[str, str], int]:
    """Bytes one rank sends per step in FSDP2's collectives (formula, as FSDP2 pads each
    parameter's dim 0 to a multiple of G): an all-gather of every unit's shard before the forward,
    again before the backward for the blocks when ``reshard_after_forward`` (FSDP2 keeps the root's
    weights gathered between its forward and backward), a reduce-scatter of all gradients."""
    plan = plan_of(model)
    G = plan.world_size
    if G == 1:
        return {}

    def padded_bytes(params) -> int:
        return sum(-(-p.shape[0] // G) * G * (p.numel() // p.shape[0]) * p.element_size() for p in params)

    blocks = padded_bytes(model.layers.parameters())
    total = padded_bytes(model.parameters())
    out = {("forward", "fsdp.params"): total // G * (G - 1), ("backward", "fsdp.grads"): total * (G - 1) // G}
    if reshard_after_forward:
        out[("backward", "fsdp.params")] = blocks // G * (G - 1)
    return out
