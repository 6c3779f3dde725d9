"""The ring-flash-attn package (``ring_flash_attn_func``, ``zigzag_ring_flash_attn_func``) as a method.

Needs CUDA and flash-attn. Its sends happen inside the package, so we cannot
instrument them: its bytes are recorded *by formula*
(``ring_flash_attn_comm_bytes``), at the points where they happen (forward on
entry, backward when the gradient passes back; ``collectives.record_formula``),
from our reading of its source: K, V make G-1 hops forward and again backward
in the input dtype; the dK, dV accumulators are sent at every one of the G
backward steps (the last send returns them home) in fp32. Its zigzag function
asserts ``causal=True``; we raise ValueError instead. ring-flash-attn needs a
process group even with no peer: at world size 1 under plain ``python`` (no
group initialised) the adapter starts a single-process one on an in-memory
store (no network), so the package runs unchanged at G = 1. The package is imported through
``ring_flash_attn_shim`` (its HF adapter does not import next to transformers 5.x).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from burst_impl import comm
from burst_impl.attention import check_inputs
from burst_impl.layout import check_even
from burst_impl.shape import AttnShape

from burst_impl.collectives import record_formula
from burst_impl.method import Method, Schedule
from . import ring_flash_attn_shim
from .burst import ring_family_memory

ORDER = 60
Tensor = torch.Tensor


def ring_flash_attn_unavailable() -> str:
    """Why the peer cannot run here ('' when it can): no CUDA, or the package not importable (through
    ``ring_flash_attn_shim``, which gets past its HF adapter's clash with transformers 5.x)."""
    if not torch.cuda.is_available():
        return "ring_flash_attn needs a CUDA device"
    return ring_flash_attn_shim.load().reason


def ring_flash_attn_available() -> bool:
    return not ring_flash_attn_unavailable()


def ring_flash_attn_comm_bytes(s: AttnShape, **_) -> dict:
    G = s.world_size
    if G == 1:
        return {}
    block = s.rows * s.kv_heads * s.head_dim                   # one rank's K block (elements)
    hop = (G - 1) * block * s.elem_size
    acc = G * block * 4                                         # fp32 dK/dV sent at each of the G steps
    return {("forward", "k"): hop, ("forward", "v"): hop, ("backward", "k"): hop, ("backward", "v"): hop,
            ("backward", "dk"): acc, ("backward", "dv"): acc}


def _start_single_process_group(device: torch.device) -> None:
    """World size 1 without torchrun: a one-rank default group on an in-memory store."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                            device_id=device if device.type == "cuda" else None)


def ring_flash_attn_adapter(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False,
                            softmax_scale: float | None = None, group=None,
                            layout: str = "contiguous") -> Tensor:
    """ring-flash-attn under our signature; q (B, N/G, Z, d), k/v (B, N/G, Zkv, d) on CUDA."""
    check_inputs(q, k, v, layout=layout, softmax_scale=softmax_scale, group=group, method="ring_flash_attn")
    check_even(q.shape[1] * comm.world(group)[1], layout, comm.world(group)[1], who="ring_flash_attn")
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"q.dtype={q.dtype}: ring-flash-attn runs flash-attn kernels, which take "
                         "float16 or bfloat16 only")
    if layout == "zigzag" and not causal:
        raise ValueError("layout='zigzag' with causal=False: ring-flash-attn's zigzag function requires "
                         "causal=True (zigzag only balances causal work)")
    rfa = ring_flash_attn_shim.load().module
    if rfa is None:
        raise ValueError(f"method 'ring_flash_attn' cannot run: {ring_flash_attn_shim.load().reason}")
    _, G = comm.world(group)
    table = ring_flash_attn_comm_bytes(AttnShape.from_tensors(q, k, G, causal=causal, layout=layout))
    q, k, v = record_formula(table, q, k, v)
    fn = rfa.zigzag_ring_flash_attn_func if layout == "zigzag" else rfa.ring_flash_attn_func
    if group is None and not dist.is_initialized():
        _start_single_process_group(q.device)
    pg = group if group is not None else dist.group.WORLD
    return fn(q, k, v, dropout_p=0.0, softmax_scale=softmax_scale, causal=causal, group=pg)


METHODS = (Method(
    name="ring_flash_attn", colour=3, marker="X", level="op", fn=ring_flash_attn_adapter,
    comm_bytes=ring_flash_attn_comm_bytes, memory_bytes=ring_family_memory,
    available=ring_flash_attn_available, external="ring-flash-attn", bytes_by_formula=True,
    kernel="flash_attn (ring-flash-attn's own calls)",
    schedule=Schedule("ring", {"default": "ring", "acc_sends": "n"}),
    description="The ring-flash-attn package (CUDA); bytes recorded by formula, not instrumented",
    travels="fwd: K, V; bwd: K, V + dK, dV (fp32, G sends)",
),)
