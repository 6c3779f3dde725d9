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
wrappers, so their bytes are a formula (``comm_bytes``; ``config_step_bytes``
for a config without a model), checked against the bytes of the collectives
FSDP2 issues in a real step (tests/test_fsdp_bytes.py).
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


def unit_shapes(cfg) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """``(block, root)``: (dim 0, elements) of every parameter of one decoder block and of the root unit
    (embedding, final norm, LM head), as ``model.Transformer`` builds them (``nn.Linear(i, o).weight`` is
    (o, i)): the units ``shard_weights`` makes, whose dim 0 FSDP2 pads to a multiple of G."""
    h, q, kv, f, v = (cfg.hidden, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.ffn_hidden,
                      cfg.vocab_size)
    block = [(h, h), (q, q * h), (kv, kv * h), (kv, kv * h), (h, h * q), (h, h), (f, f * h), (f, f * h), (h, h * f)]
    return block, [(v, v * h), (h, h), (v, v * h)]


def padded_bytes(shapes, world_size: int, elem_size: int) -> int:
    """Bytes of parameters ``shapes`` ((dim 0, elements) each) once FSDP2 pads each dim 0 to a multiple of G
    (``_fsdp_param.py``, ``FSDPParam._init_sharded_param``): what one all-gather returns, what one
    reduce-scatter takes in."""
    G = world_size
    return sum(-(-rows // G) * G * (numel // rows) * elem_size for rows, numel in shapes)


# Ring steps of a reduce-scatter, in units of G-1, by process-group backend. NCCL's ring: G-1. Gloo has no
# reduce-scatter of its own: ProcessGroupGloo::reduce_scatter_tensor_coalesced (what _reduce_scatter_base and
# so FSDP2's reduce_scatter_single call) clones the input, all-reduces the clone and copies out its own chunk
# (pytorch/pytorch torch/csrc/distributed/c10d/ProcessGroupGloo.cpp, at c194358), so it sends an all-reduce's
# 2 (G-1) shards: on loopback with torch 2.13, 128 MiB for a 64 MiB reduce-scatter at G=2 (docs/findings.md).
REDUCE_SCATTER_STEPS = {"nccl": 1, "gloo": 2}


def unit_comm_bytes(unit_bytes: int, world_size: int, backend: str = "nccl") -> dict[str, int]:
    """Bytes one rank sends in the ring all-gather ("params") and reduce-scatter ("grads") of one FSDP unit
    of ``unit_bytes`` padded bytes: (G-1) shards of unit_bytes / G each, the reduce-scatter's twice on gloo
    (``REDUCE_SCATTER_STEPS``)."""
    if backend not in REDUCE_SCATTER_STEPS:
        raise ValueError(f"backend={backend!r}: FSDP2's bytes are known for {tuple(REDUCE_SCATTER_STEPS)}")
    shards = unit_bytes // world_size * (world_size - 1)
    return {"params": shards, "grads": shards * REDUCE_SCATTER_STEPS[backend]}


def step_bytes(units: int, world_size: int, *, reshard_after_forward: bool = True,
               backend: str = "nccl") -> dict[tuple[str, str], int]:
    """``{(phase, kind): bytes}`` one rank sends per step in FSDP2's collectives (``unit_comm_bytes``), from
    the padded bytes (``padded_bytes``) of all units together (the blocks and the root): every unit's
    all-gather before the forward, again before the backward when ``reshard_after_forward`` (``shard_weights``
    passes it to the root too, so FSDP2 does not keep the root gathered as it would by default:
    ``_fsdp_state.py``, ``FSDPState._lazy_init``, only under ``reshard_after_forward=None``), every unit's
    reduce-scatter in the backward. The one formula of ``comm_bytes`` (a built model) and of the
    performance model (``config_step_bytes``, ``experiments/perfmodel/schedules/zero3.py``)."""
    if world_size == 1:
        return {}
    every = unit_comm_bytes(units, world_size, backend)
    out = {("forward", "fsdp.params"): every["params"], ("backward", "fsdp.grads"): every["grads"]}
    if reshard_after_forward:
        out[("backward", "fsdp.params")] = every["params"]
    return out


def config_step_bytes(cfg, world_size: int, elem_size: int, *, reshard_after_forward: bool = True,
                      backend: str = "nccl") -> dict:
    """``step_bytes`` of a model config (no model built): what ``comm_bytes`` gives for ``build_model(cfg)``
    with parameters of ``elem_size`` bytes (tests/test_fsdp_bytes.py checks the two agree)."""
    block, root = unit_shapes(cfg)
    units = cfg.n_layers * padded_bytes(block, world_size, elem_size) + padded_bytes(root, world_size, elem_size)
    return step_bytes(units, world_size, reshard_after_forward=reshard_after_forward, backend=backend)


def comm_bytes(model, *, reshard_after_forward: bool = True, backend: str | None = None) -> dict[tuple[str, str], int]:
    """Bytes one rank sends per step in FSDP2's collectives (``step_bytes``) of a sharded (or to be
    sharded) sequence-parallel ``model``, from its parameters' shapes and element sizes; ``backend``: the
    process group's (None: its group's when initialised, else "nccl")."""
    plan = plan_of(model)
    G = plan.world_size
    if backend is None:
        backend = str(dist.get_backend(plan.group)) if dist.is_initialized() else "nccl"
    units = sum(padded_bytes([(p.shape[0], p.numel())], G, p.element_size()) for p in model.parameters())
    return step_bytes(units, G, reshard_after_forward=reshard_after_forward, backend=backend)
