"""Adapters that run other people's implementations under our operator signature.

* ``ring_flash_attn``: the ring-flash-attn package (``ring_flash_attn_func``,
  ``zigzag_ring_flash_attn_func``; needs CUDA and flash-attn). Its sends
  happen inside the package, so we cannot instrument them: its bytes are
  recorded *by formula* (``ring_flash_attn_comm_bytes``), at the points where
  they happen (forward on entry, backward when the gradient passes back), from
  our reading of its source: K, V make G-1 hops forward and again backward in
  the input dtype; the dK, dV accumulators are sent at every one of the G
  backward steps (the last send returns them home) in fp32. Its zigzag
  function asserts ``causal=True``; we raise ValueError instead.
* ``deepspeed_ulysses``: DeepSpeed's ``DistributedAttention``
  (``deepspeed.sequence.layer``) around our local attention kernel, on any
  backend (gloo included). Bytes are recorded by formula as well
  (``ulysses.a2a_bytes``): DeepSpeed issues its own all-to-alls.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from burst_impl import comm
from burst_impl.attention import check_inputs
from burst_impl.layout import check_seqlen

from .local import local_attn
from .ulysses import a2a_bytes, kv_replication

Tensor = torch.Tensor


class _Record(torch.autograd.Function):
    """Identity on (q, k, v) that records formula bytes: forward now, backward when grads pass."""

    @staticmethod
    def forward(ctx, table, q, k, v):
        ctx.table = table
        for (phase, kind), b in table.items():
            if phase == "forward":
                comm.record(phase, kind, b)
        return q.view_as(q), k.view_as(k), v.view_as(v)

    @staticmethod
    def backward(ctx, dq, dk, dv):
        for (phase, kind), b in ctx.table.items():
            if phase == "backward":
                comm.record(phase, kind, b)
        return None, dq, dk, dv


# ---------------------------------------------------------------- ring-flash-attn


def ring_flash_attn_available() -> bool:
    try:
        import flash_attn  # noqa: F401
        import ring_flash_attn  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means "not here"
        return False
    return torch.cuda.is_available()


def ring_flash_attn_bytes(batch, seqlen, kv_heads, head_dim, world_size, elem_size) -> dict:
    G = world_size
    if G == 1:
        return {}
    block = batch * (seqlen // G) * kv_heads * head_dim      # one rank's K block (elements)
    hop = (G - 1) * block * elem_size
    acc = G * block * 4                                       # fp32 dK/dV sent at each of the G steps
    return {("forward", "k"): hop, ("forward", "v"): hop, ("backward", "k"): hop, ("backward", "v"): hop,
            ("backward", "dk"): acc, ("backward", "dv"): acc}


def ring_flash_attn_comm_bytes(s, **_) -> dict:
    return ring_flash_attn_bytes(s.batch, s.seqlen, s.kv_heads, s.head_dim, s.world_size, s.elem_size)


def ring_flash_attn_adapter(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False,
                            softmax_scale: float | None = None, group=None,
                            layout: str = "contiguous") -> Tensor:
    """ring-flash-attn under our signature; q (B, N/G, Z, d), k/v (B, N/G, Zkv, d) on CUDA."""
    check_inputs(q, k, v, layout=layout, softmax_scale=softmax_scale)
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"q.dtype={q.dtype}: ring-flash-attn runs flash-attn kernels, which take "
                         "float16 or bfloat16 only")
    if layout == "zigzag" and not causal:
        raise ValueError("layout='zigzag' with causal=False: ring-flash-attn's zigzag function requires "
                         "causal=True (zigzag only balances causal work)")
    import ring_flash_attn as rfa

    _, G = comm.world(group)
    b, s, _, d = q.shape
    table = ring_flash_attn_bytes(b, s * G, k.shape[2], d, G, q.element_size())
    q, k, v = _Record.apply(table, q, k, v)
    fn = rfa.zigzag_ring_flash_attn_func if layout == "zigzag" else rfa.ring_flash_attn_func
    pg = group if group is not None else dist.group.WORLD
    return fn(q, k, v, dropout_p=0.0, softmax_scale=softmax_scale, causal=causal, group=pg)


# ---------------------------------------------------------------- DeepSpeed-Ulysses


def deepspeed_available() -> bool:
    try:
        import deepspeed.sequence.layer  # noqa: F401
    except Exception:  # noqa: BLE001
        return False
    return True


class _LocalAttnModule(torch.nn.Module):
    """DeepSpeed calls ``local_attn(q, k, v, *args)`` on head-sharded (B, N, Z/G, d) tensors."""

    def __init__(self, causal, softmax_scale, backend=None):
        super().__init__()
        self.causal, self.softmax_scale, self.backend = causal, softmax_scale, backend

    def forward(self, q, k, v, *args, **kwargs):
        return local_attn(q, k, v, causal=self.causal, softmax_scale=self.softmax_scale, backend=self.backend)


def _ensure_deepspeed_comm() -> None:
    import deepspeed.comm as dscomm

    if not dscomm.is_initialized():
        # torch.distributed is already up: DeepSpeed wraps the existing default group.
        dscomm.init_distributed(dist_backend=dist.get_backend(), dist_init_required=False, verbose=False)


def deepspeed_ulysses_adapter(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False,
                              softmax_scale: float | None = None, group=None,
                              layout: str = "contiguous", backend: str | None = None) -> Tensor:
    """DeepSpeed's DistributedAttention with our local kernel; contiguous layout, Zkv % G == 0."""
    check_inputs(q, k, v, layout=layout, softmax_scale=softmax_scale)
    _, G = comm.world(group)
    if layout != "contiguous":
        raise ValueError(f"layout={layout!r}: the DeepSpeed adapter supports only 'contiguous' "
                         "(DistributedAttention gathers shards in rank order)")
    check_seqlen(q.shape[1] * G, layout, G)
    if kv_replication(q.shape[2], k.shape[2], G) != 1:
        raise ValueError(f"kv_heads={k.shape[2]} must be divisible by the group size {G} for the "
                         "DeepSpeed adapter (we do not replicate kv heads for it)")
    from deepspeed.sequence.layer import DistributedAttention

    _ensure_deepspeed_comm()
    pg = group if group is not None else dist.group.WORLD
    b, s, _, d = q.shape
    table = a2a_bytes(b, s * G, q.shape[2], k.shape[2], d, G, G, q.element_size())
    q, k, v = _Record.apply(table, q, k, v)
    attn = DistributedAttention(_LocalAttnModule(causal, softmax_scale, backend), pg,
                                scatter_idx=2, gather_idx=1)
    return attn(q, k, v, 0)


def deepspeed_ulysses_comm_bytes(s, **_) -> dict:
    return a2a_bytes(s.batch, s.seqlen, s.heads, s.kv_heads, s.head_dim, s.world_size, s.world_size,
                     s.elem_size)
