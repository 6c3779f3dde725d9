"""BurstAttention and BurstEngine: reference implementation (see docs/papers.md)."""
from . import comm, kernels, layout, volume
from .attention import burst_attn_func, check_inputs

__all__ = ["burst_attn_func", "check_inputs", "comm", "kernels", "layout", "volume"]
