"""The problem shape: one attention problem, its global sizes and how it is split.

Every closed form in the suite takes an ``AttnShape``: the bytes each method
sends (``burst_impl.volume``, ``Method.bytes``), the activations it keeps
(``Method.memory``), the FLOPs (``burst_impl.flops``), the
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
import functools
from dataclasses import dataclass, field

import torch

from . import masks
from .layout import LAYOUT_NAMES, check_seqlen, is_balanced_name, lengths
from .balance import resolve_layout

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


def _layout_rule(v) -> str | None:
    if v in LAYOUT_NAMES or is_balanced_name(v):
        return None
    return f"{v!r} is unknown; choose one of {list(LAYOUT_NAMES)} (or 'balanced:K', K chunks per rank)"


def _mask_rule(v) -> str | None:
    return None if v == "" else masks.check_spec(v)


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
    causal: bool = _axis("causal mask (else full); with a mask: intersected with it",
                         lambda v: "causal" if v else "full", True, default=True)
    layout: str = _axis("how tokens are split over ranks ('balanced[:K]': balanced chunks for the mask)",
                        lambda v: v.replace(":", "-"),
                        "contiguous", check=_layout_rule, default="contiguous")
    mask: str = _axis("attention mask spec (burst_impl.masks): '' none, 'window:L:R', 'docs:MEAN[:SEED]', "
                      "'bsparse:BS:DENSITY[:SEED]'", masks.label, "", check=_mask_rule, default="")

    @classmethod
    def from_tensors(cls, q: torch.Tensor, k: torch.Tensor, world_size: int, *, causal: bool = True,
                     layout: str = "contiguous", mask: str = "") -> "AttnShape":
        """The shape of local shards q (B, N/G, Z, d), k (B, N/G, Z_kv, d) on ``world_size`` ranks."""
        b, s, z, d = q.shape
        return cls(b, s * world_size, z, k.shape[2], d, world_size, dtype=DTYPE_NAMES[q.dtype],
                   causal=causal, layout=layout if isinstance(layout, str) else str(layout),
                   mask=mask if isinstance(mask, str) else "")

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
    def attn_mask(self) -> masks.Mask:
        """The one mask of this problem: ``mask`` intersected with causal when ``causal`` (``masks.resolve``)."""
        return _resolved_mask(self.causal, self.mask, self.seqlen)

    @property
    def resolved_layout(self):
        """``layout``, with ``"balanced[:K]"`` resolved for ``attn_mask`` (a ``layout.ChunkLayout``)."""
        return resolve_layout(self.layout, self.attn_mask, self.seqlen, self.world_size)

    @property
    def rows(self) -> int:
        """B * N/G: query rows (tokens) held by one rank (even N; ``rank_rows`` in general)."""
        return self.batch * self.local_seqlen

    @property
    def lengths(self) -> tuple[int, ...]:
        """Tokens of each rank's shard (``layout.lengths`` of the resolved layout): N/G each when the
        layout's chunks divide N, else differing by at most a token per chunk."""
        return lengths(self.resolved_layout, self.world_size, self.seqlen)

    @property
    def even(self) -> bool:
        """True when every rank holds the same number of tokens."""
        return self.seqlen % self.world_size == 0 and len(set(self.lengths)) == 1

    def rank_rows(self, rank: int) -> int:
        """B * (tokens of ``rank``'s shard)."""
        return self.batch * self.lengths[rank]

    def validate(self) -> None:
        """ValueError naming the field, the value and the rule: each field's own ``check``, then the
        rules between fields."""
        for f in dataclasses.fields(self):
            why = f.metadata["check"](getattr(self, f.name)) if "check" in f.metadata else None
            if why:
                raise ValueError(f"{f.name}={getattr(self, f.name)!r}: {why}")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads={self.heads} must be a multiple of kv_heads={self.kv_heads}")
        self.attn_mask   # noqa: B018 - ValueError for a mask that does not fit N
        check_seqlen(self.seqlen, self.resolved_layout, self.world_size)


@functools.lru_cache(maxsize=256)
def _resolved_mask(causal: bool, spec: str, seqlen: int) -> masks.Mask:
    return masks.resolve(causal, spec, seqlen)
