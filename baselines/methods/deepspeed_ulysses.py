"""DeepSpeed's ``DistributedAttention`` (``deepspeed.sequence.layer``) as a method.

DeepSpeed-Ulysses around our local attention kernel, on any backend (gloo
included); the peer our ``ulysses`` is cross-checked against. Bytes are
recorded by formula (``ulysses.a2a_bytes`` through
``collectives.record_formula``): DeepSpeed issues its own all-to-alls.
Contiguous layout only, and Z_kv divisible by G (no kv replication here).
"""
from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.distributed as dist

from burst_impl import comm
from burst_impl.attention import check_inputs
from burst_impl.layout import check_even
from burst_impl.shape import AttnShape

from burst_impl.collectives import record_formula
from burst_impl.local import local_attn
from burst_impl.method import Method, Schedule
from .ulysses import a2a_bytes, kv_replication, ulysses_memory_bytes

ORDER = 70
Tensor = torch.Tensor


def deepspeed_available() -> bool:
    try:
        import deepspeed.sequence.layer  # noqa: F401, PLC0415 (optional dependency)
    except Exception:  # noqa: BLE001 - any import failure means "not here"
        return False
    return True


class _LocalAttnModule(torch.nn.Module):
    """DeepSpeed calls ``local_attn(q, k, v, *args)`` on head-sharded (B, N, Z/G, d) tensors."""

    def __init__(self, causal, softmax_scale, backend=None, mask=None):
        super().__init__()
        self.causal, self.softmax_scale, self.backend, self.mask = causal, softmax_scale, backend, mask

    def forward(self, q, k, v, *args, **kwargs):
        return local_attn(q, k, v, causal=self.causal, softmax_scale=self.softmax_scale, backend=self.backend,
                          mask=self.mask)


# A JIT build of DeepSpeed's CPU shm op takes about a minute here; a lock file much older than that was
# left by a build that was killed, and torch's FileBaton would wait on it forever (seen: a sweep stalled
# until its case timeout).
STALE_LOCK_S = 600


def _clear_stale_build_lock(name: str = "deepspeed_shm_comm") -> None:
    # cpp_extension imports setuptools, which is not a dependency; only DeepSpeed's JIT build needs it here
    from torch.utils.cpp_extension import _get_build_directory  # noqa: PLC0415 (optional dependency)

    lock = Path(_get_build_directory(name, verbose=False)) / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return
    if age > STALE_LOCK_S:
        print(f"deepspeed_ulysses: removing {lock}, a build lock {age:.0f} s old (a killed build left it)",
              flush=True)
        lock.unlink(missing_ok=True)


def _ensure_deepspeed_comm() -> None:
    import deepspeed.comm as dscomm  # noqa: PLC0415 (optional dependency)

    if not dscomm.is_initialized():
        _clear_stale_build_lock()
        # torch.distributed is already up: DeepSpeed wraps the existing default group.
        dscomm.init_distributed(dist_backend=dist.get_backend(), dist_init_required=False, verbose=False)


def deepspeed_ulysses_adapter(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False, mask=None,
                              softmax_scale: float | None = None, group=None,
                              layout: str = "contiguous", backend: str | None = None) -> Tensor:
    """DeepSpeed's DistributedAttention with our local kernel; contiguous layout, Zkv % G == 0.
    Masks (any, ``burst_impl.masks``) go to the local kernel, which sees the whole sequence in
    position order after DeepSpeed's all-to-all."""
    _, G = comm.world(group)
    the_mask, _ = check_inputs(q, k, v, layout=layout, softmax_scale=softmax_scale, group=group, causal=causal,
                               mask=mask)
    if layout != "contiguous":
        raise ValueError(f"layout={layout!r}: the DeepSpeed adapter supports only 'contiguous' "
                         "(DistributedAttention gathers shards in rank order)")
    check_even(q.shape[1] * G, layout, G, who="deepspeed_ulysses")
    if kv_replication(q.shape[2], k.shape[2], G) != 1:
        raise ValueError(f"kv_heads={k.shape[2]} must be divisible by the group size {G} for the "
                         "DeepSpeed adapter (we do not replicate kv heads for it)")
    from deepspeed.sequence.layer import DistributedAttention  # noqa: PLC0415 (optional dependency)

    _ensure_deepspeed_comm()
    pg = group if group is not None else dist.group.WORLD
    table = a2a_bytes(AttnShape.from_tensors(q, k, G, causal=causal, layout=layout), G)
    q, k, v = record_formula(table, q, k, v)
    attn = DistributedAttention(_LocalAttnModule(False, softmax_scale, backend, the_mask), pg,
                                scatter_idx=2, gather_idx=1)
    return attn(q, k, v, 0)


def deepspeed_ulysses_comm_bytes(s: AttnShape, **_) -> dict:
    return a2a_bytes(s, s.world_size)


def _check(s: AttnShape, **_) -> None:
    if s.heads % s.world_size or s.kv_heads % s.world_size:
        raise ValueError(f"heads={s.heads} and kv_heads={s.kv_heads} must be divisible by "
                         f"world_size={s.world_size} for deepspeed_ulysses (no kv replication there)")
    check_even(s.seqlen, s.layout, s.world_size, who="deepspeed_ulysses")


METHODS = (Method(
    name="deepspeed_ulysses", colour=9, marker="<", level="op", fn=deepspeed_ulysses_adapter,
    comm_bytes=deepspeed_ulysses_comm_bytes, memory_bytes=ulysses_memory_bytes,
    available=deepspeed_available, external="deepspeed", layouts=("contiguous",), masks=True,
    bytes_by_formula=True, check=_check, fresh_output=lambda s, **_: True, schedule=Schedule("ulysses"),
    description="DeepSpeed's DistributedAttention around our local kernel; bytes recorded by formula",
    travels="as ulysses",
),)
