"""Modern blockwise ring attention (ring-flash-attn, Megatron/TransformerEngine CP, PyTorch CP).

Forward: Q stays, (K, V) travel G-1 hops and each step's block result is
merged into the running (O, lse). Backward: Q, dO, lse, delta and dQ stay;
(K, V) travel again and the dK, dV accumulators (fp32 by default) follow on
a second ring, ending at their owner.

That is exactly BurstAttention's forward with its ``backward="ring"`` scheme,
so this baseline *is* that code path (``burst_attn_func(backward="ring")``):
one implementation, and a timing comparison of ``ring`` against ``burst_qring``
isolates the backward scheme. Independent checks of it: the fp64 reference
(tests/test_baselines.py) and PyTorch's own ring attention
(tests/test_baselines_peers.py). Bytes per rank: ``volume.expected_bytes(s, "ring")``.
"""
from __future__ import annotations

import torch

from burst_impl import burst_attn_func, volume
from burst_impl.layout import LAYOUT_NAMES

from burst_impl.method import Method, Schedule
from .burst import burst_link_bytes, ring_family_memory

ORDER = 10
Tensor = torch.Tensor


def ring_attn_func(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False, mask=None,
                   softmax_scale: float | None = None, group=None, layout="contiguous",
                   backend: str | None = None, grad_comm_dtype: torch.dtype | None = None,
                   node_size: int | None = None, overlap: bool = True) -> Tensor:
    """Blockwise ring attention on local shards: q (B, N/G, Z, d), k/v (B, N/G, Zkv, d) -> (B, N/G, Z, d)."""
    return burst_attn_func(q, k, v, causal=causal, mask=mask, softmax_scale=softmax_scale, group=group,
                           layout=layout, backward="ring", backend=backend, grad_comm_dtype=grad_comm_dtype,
                           node_size=node_size, overlap=overlap)


def ring_comm_bytes(s, rank: int = 0, node_size=None, **_) -> dict[tuple[str, str], int]:
    return volume.expected_bytes(s, backward="ring", rank=rank, node_size=node_size)


METHODS = (Method(
    name="ring", colour=2, marker="s", layouts=LAYOUT_NAMES, level="op", masks=True, fn=ring_attn_func,
    comm_bytes=ring_comm_bytes,
    memory_bytes=ring_family_memory, operator_backward="ring", schedule=Schedule("ring", {"default": "ring"}),
    link_bytes=lambda s, rank, node_size, **_: burst_link_bytes(s, rank, node_size, "ring"),
    description="Blockwise ring attention (ring-flash-attn / Megatron CP style), "
                "= Burst forward + K/V-circulating backward",
    travels="fwd: K, V; bwd: K, V + dK, dV ring (fp32)",
    external="PyTorch context parallel (_templated_ring_attention), forward",
),)
