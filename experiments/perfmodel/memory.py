"""Peak memory per rank of one attention layer, and whether it fits the accelerator's HBM.

    peak = inputs + kept + max over phases of the transient buffers

* inputs: op level, this rank's q, k, v shards (plus dO and the gradients
  dq, dk, dv when there is a backward); layer level, the hidden states it
  takes (N/G tokens, or all N for ``tp_v1``) and its layer weights (a TP rank
  holds 1/G of the heads), plus dY, dX and the weight gradients in training.
* kept: the method's registry memory model (``Method.memory``: what the layer
  keeps for backward; for ``ring_rsa`` the (B, Z, N/G, N) probabilities). The
  models count q, k, v, which at op level are the inputs themselves: counted
  twice here, an overestimate of B*N/G*(Z+2Zkv)*d*e (small next to what decides
  an OOM: score matrices).
* transient: the buffers the schedule builders declare (blocks in flight, fp32
  accumulators, materialised scores, gathered tensors), per phase.

Capacity: the device's usable memory (``usable_memory.capacity``: the total the CUDA runtime reports,
less the CUDA context and NCCL's buffers, each sourced) where the accelerator has a sourced total,
else the profile's ``hbm_gib``. Not counted (attention level, one layer): the other layers' weights and
activations, optimizer state and allocator fragmentation.
So "fits" means the layer alone fits; "OOM" means it cannot fit at all.

A spec row that ran a peer implementation (``peer_memory.RUNS``: BurstEngine's attention-only benchmark)
takes its kept and transient bytes from that implementation's terms instead (``implementation_memory``):
one formula per record, the implementation it names.
"""
from __future__ import annotations

import dataclasses

from baselines import AttnShape, Method, get

from .peer_memory import implementation_of
from .usable_memory import Comms, capacity as usable

GIB = 2 ** 30


def _inputs(method: Method, shape: AttnShape, phases, level: str) -> int:
    s, e = shape, shape.elem_size
    local = s.seqlen // s.world_size
    train = "backward" in phases
    if level == "op":
        qkv = s.batch * local * (s.heads + 2 * s.kv_heads) * s.head_dim * e
        dout = s.batch * local * s.heads * s.head_dim * e
        return qkv + (dout + qkv if train else 0)
    hidden = s.heads * s.head_dim
    tokens = s.seqlen if method.layer_input == "replicated" else local
    x = s.batch * tokens * hidden * e
    if method.level == "layer":   # tensor parallel: this rank's columns of W_q, W_k, W_v and rows of W_o
        zq = s.heads // s.world_size
        kvl = s.kv_heads // s.world_size if s.kv_heads % s.world_size == 0 else 1
        weights = (hidden * (zq + 2 * kvl) * s.head_dim + zq * s.head_dim * hidden) * e
    else:
        weights = (hidden * (s.heads + 2 * s.kv_heads) * s.head_dim + s.heads * s.head_dim * hidden) * e
    return x + weights + ((2 * x + weights) if train else 0)


def _verdict(inputs: int, kept: int, per_phase: dict, buffers: dict, cap: dict, **extra) -> dict:
    worst = max(per_phase, key=per_phase.get) if per_phase else None
    trans = per_phase.get(worst, 0) if worst else 0
    total = inputs + kept + trans
    return {
        "inputs_bytes": inputs,
        "kept_bytes": kept,
        "transient_bytes": trans,
        "transient_phase": worst,
        "transient_buffers": dict(buffers.get(worst, {})) if worst else {},
        "transient_by_phase": dict(per_phase),
        "total_bytes": total,
        "above_inputs_bytes": kept + trans,
        "capacity_bytes": cap["capacity_bytes"],
        "capacity_parts": cap["parts"],
        "capacity_basis": cap["basis"],
        "oom": total > cap["capacity_bytes"],
        **extra,
    }


def _capacity(hbm_gib: float | None, accelerator, comms: Comms | None, intra_kind: str = "nvlink") -> dict:
    if accelerator is not None:
        return usable(accelerator, comms, intra_kind)
    return {"capacity_bytes": int(hbm_gib * GIB), "parts": {"hbm_gib": int(hbm_gib * GIB)},
            "basis": f"hbm_gib ({hbm_gib:g} GiB) as given"}


def peak_memory(method: Method, shape: AttnShape, *, phases, level: str, transient: dict,
                hbm_gib: float | None = None, options: dict | None = None, accelerator=None,
                intra_kind: str = "nvlink") -> dict:
    """Peak bytes per rank by component, and the verdict against the accelerator's usable memory
    (``accelerator``, a hardware profile's ``Accelerator``) or ``hbm_gib``."""
    inputs = _inputs(method, shape, phases, level)
    kept = int(method.memory(shape, **(options or {})))
    per_phase = {p: sum(transient.get(p, {}).values()) for p in phases}
    return _verdict(inputs, kept, per_phase, transient, _capacity(hbm_gib, accelerator, None, intra_kind))


def implementation_memory(impl, method: Method, shape: AttnShape, *, phases, level: str, accelerator,
                          intra_kind: str = "nvlink") -> dict:
    """``peak_memory``'s verdict with ``impl``'s terms (a ``peer_memory.Implementation``): its kept bytes, its
    transient sets by phase, and usable memory less its own communicators' NCCL buffers. Inputs as every
    method's (the benchmark's q, k, v, dO and their gradients)."""
    terms = impl.attention(shape)
    if terms is None or level != "op":
        raise ValueError(f"implementation {impl.name!r} has no attention-level terms at level={level!r}")
    buffers = {"forward": terms.forward, "backward": terms.backward}
    per_phase = {p: sum(buffers[p].values()) for p in phases}
    return _verdict(_inputs(method, shape, phases, level), sum(terms.kept.values()), per_phase, buffers,
                    usable(accelerator, impl.comms, intra_kind), implementation=impl.name, terms=terms.as_dict(),
                    method=f"modelled: {impl.description} (experiments/perfmodel/peer_memory.py), above inputs")


def peer_prediction(experiment: str, case, pred):
    """``pred`` (a ``model.Prediction`` of ``case`` in spec ``experiment``) with the memory of the peer
    implementation its row ran (``peer_memory.RUNS``), else ``pred`` itself."""
    impl = implementation_of(experiment, case.variant or case.method)
    if impl is None or pred.level != "op":    # the peers' terms are the attention operator's (model level: its own)
        return pred
    mem = implementation_memory(impl, get(pred.base_method), pred.shape, level=pred.level,
                                phases=tuple(pred.memory["transient_by_phase"]),
                                accelerator=pred.hardware.accelerator, intra_kind=pred.hardware.intra.kind)
    return dataclasses.replace(pred, memory=mem)
