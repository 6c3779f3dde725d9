"""The problem shape: one attention problem, its global sizes and how it is split.

Every closed form in the suite takes an ``AttnShape``: the bytes each method
sends (``burst_impl.volume``, ``Method.bytes``), the activations it keeps
(``Method.memory``), the FLOPs (``experiments.harness.flops``), the
performance model. Its fields are also the sweep axes of the experiment specs
(``experiments.harness.axes``): a field added here is a new axis, with its
YAML key, type, default, case-name label and plot facet taken from the
field's metadata:

* ``sweep_default``: the value a spec gets when it does not sweep the axis
  (absent: the axis is required in every spec);
* ``label``: a format string for the case name (``"N{}"``), or a function of
  the value returning the label ("" leaves it out of the name);
* ``doc``: one line for the README and error messages;
* ``check``: the rule a single value must meet (a function returning why not, or None).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from .layout import LAYOUTS, check_seqlen

DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16,
          "float16": torch.float16}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


def _axis(doc: str, label, sweep_default=dataclasses.MISSING, check=None, **kw):
    meta = {"doc": doc, "label": label}
    if sweep_default is not dataclasses.MISSING:
        meta["sweep_default"] = sweep_default
    if check is not None:
        meta["check"] = check
    return field(metadata=meta, **kw)


def _positive(v) -> str | None:
    return None if v > 0 else f"{v} must be positive"


def _one_of(choices):
    return lambda v: None if v in choices else f"{v!r} is unknown; choose one of {sorted(choices)}"


@dataclass(frozen=True)
class AttnShape:
    """One attention problem: global sizes (B, N, Z, Z_kv, d), G ranks, dtype, mask, layout."""

    batch: int = _axis("B, sequences per step", "B{}", 1, check=_positive)
    seqlen: int = _axis("N, global tokens per sequence", "N{}", check=_positive)
    heads: int = _axis("Z, query heads", "Z{}", 32, check=_positive)
    kv_heads: int = _axis("Z_kv, key/value heads (omit for MHA: = heads)", "kv{}", None, check=_positive)
    head_dim: int = _axis("d, head dimension", "d{}", 128, check=_positive)
    world_size: int = _axis("G, ranks in the sequence-parallel group", "G{}", 1, check=_positive)
    dtype: str = _axis("input dtype", "{}", "bfloat16", check=_one_of(DTYPES), default="bfloat16")
    causal: bool = _axis("causal mask (else full)", lambda v: "causal" if v else "full", True, default=True)
    layout: str = _axis("how tokens are split over ranks", "{}", "contiguous", check=_one_of(LAYOUTS),
                        default="contiguous")

    @classmethod
    def from_tensors(cls, q: torch.Tensor, k: torch.Tensor, world_size: int, *, causal: bool = True,
                     layout: str = "contiguous") -> "AttnShape":
        """The shape of local shards q (B, N/G, Z, d), k (B, N/G, Z_kv, d) on ``world_size`` ranks."""
        b, s, z, d = q.shape
        return cls(b, s * world_size, z, k.shape[2], d, world_size, dtype=DTYPE_NAMES[q.dtype],
                   causal=causal, layout=layout)

    def replace(self, **changes) -> "AttnShape":
        return dataclasses.replace(self, **changes)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def elem_size(self) -> int:
        return torch.empty((), dtype=self.torch_dtype).element_size()

    @property
    def local_seqlen(self) -> int:
        return self.seqlen // self.world_size

    @property
    def rows(self) -> int:
        """B * N/G: query rows (tokens) held by one rank."""
        return self.batch * self.local_seqlen

    def validate(self) -> None:
        """ValueError naming the field, the value and the rule: each field's own ``check``, then the
        rules between fields."""
        for f in dataclasses.fields(self):
            why = f.metadata["check"](getattr(self, f.name)) if "check" in f.metadata else None
            if why:
                raise ValueError(f"{f.name}={getattr(self, f.name)!r}: {why}")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads={self.heads} must be a multiple of kv_heads={self.kv_heads}")
        check_seqlen(self.seqlen, self.layout, self.world_size)
