"""The decode step's two kinds of work (``perfmodel/decode_costs.py``) on the emulated cluster: measured here.

* ``DecodeEmulatedCosts``: ``EmulatedCosts`` (the kernel table, the run's load scale, host per op, overlap
  excess) answering ``decode_attention`` from the table's ``("decode", q, keys, Z, Zkv, d, dtype[, B])`` key
  (``measured._runner``: ``partial_attention`` as a decode step calls it, over the step's B caches in turn) and
  ``weight_gemm`` from its GEMM key at the exact shape (on a CPU the weight's read is in the measured time). The
  attention streams the cache (``EmulatedCosts.memory_bound``: at the validation's memory rule, by default the
  compute load); the GEMV at the compute load: the CPU mirror's weights (at most 2.5 MiB a layer) stay in this
  machine's caches, as in the table;
* ``DecodeRecording``: ``measured.RecordingCosts`` noting those keys too (``validate_decode.needed_keys``).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..decode_costs import DecodeCosts
from .costs import EmulatedCosts
from .measured import RecordingCosts


def decode_key(q: int, keys: int, heads: int, kv_heads: int, head_dim: int, dtype: str, batch: int = 1) -> tuple:
    """The table's key of one sequence's decode attention in a step over ``batch`` sequences. The table times
    a batch's key over ``batch`` caches in turn (``measured._runner``), as the step reads them: one cache timed
    call after call stays in this machine's L3 where it fits, and a step's B caches need not (docs/findings.md,
    "A decode key timed over the step's batch"). A batch of one keeps the 7-part key."""
    key = ("decode", q, keys, heads, kv_heads, head_dim, dtype)
    return key if batch == 1 else (*key, batch)


@dataclass(frozen=True)
class DecodeEmulatedCosts(EmulatedCosts):
    def decode_attention(self, q, keys, heads, kv_heads, head_dim, batch=1):
        if q <= 0 or keys <= 0:
            return 0.0, 0.0
        return (self.memory_bound(decode_key(q, keys, heads, kv_heads, head_dim, self.dtype, batch)),
                4.0 * q * keys * heads * head_dim)

    def weight_gemm(self, m, n, k):
        return self.gemm(m, n, k)


@dataclass(frozen=True)
class DecodeRecording(RecordingCosts, DecodeCosts):
    def decode_attention(self, q, keys, heads, kv_heads, head_dim, batch=1):
        if q > 0 and keys > 0:
            self.seen.add(decode_key(q, keys, heads, kv_heads, head_dim, self.dtype, batch))
        return super().decode_attention(q, keys, heads, kv_heads, head_dim, batch)

    def weight_gemm(self, m, n, k):
        return self.gemm(m, n, k)        # the table times the GEMM at its shape, the weight's read included


def decode_twin(cost):
    """The decode-capable twin of an emulated or recording cost model (same fields), or ``cost`` itself."""
    for base, twin in ((EmulatedCosts, DecodeEmulatedCosts), (RecordingCosts, DecodeRecording)):
        if type(cost) is base:
            return twin(**{f.name: getattr(cost, f.name) for f in dataclasses.fields(cost)})
    return cost
