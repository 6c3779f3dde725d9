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

Not counted (attention level, one layer): the other layers' weights and
activations, optimizer state, the CUDA context and allocator fragmentation.
So "fits" means the layer alone fits; "OOM" means it cannot fit at all.
"""
from __future__ import annotations

from baselines import AttnShape, Method

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


def peak_memory(method: Method, shape: AttnShape, *, phases, level: str, transient: dict, hbm_gib: float,
                options: dict | None = None) -> dict:
    """Peak bytes per rank by component, and the verdict against ``hbm_gib``."""
    inputs = _inputs(method, shape, phases, level)
    kept = int(method.memory(shape, **(options or {})))
    per_phase = {p: sum(transient.get(p, {}).values()) for p in phases}
    worst = max(per_phase, key=per_phase.get) if per_phase else None
    trans = per_phase.get(worst, 0) if worst else 0
    total = inputs + kept + trans
    capacity = int(hbm_gib * GIB)
    return {
        "inputs_bytes": inputs,
        "kept_bytes": kept,
        "transient_bytes": trans,
        "transient_phase": worst,
        "transient_buffers": dict(transient.get(worst, {})) if worst else {},
        "total_bytes": total,
        "above_inputs_bytes": kept + trans,
        "capacity_bytes": capacity,
        "oom": total > capacity,
    }
