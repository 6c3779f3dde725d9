"""What defines an attention method: ``Method``, one per registry name.

A method module (``baselines/methods/<name>.py``) holds the implementation
and a ``METHODS`` tuple of ``Method`` entries, each carrying:

* ``fn``: the function to run. ``level="op"`` methods have the operator
  signature ``fn(q, k, v, *, causal=False, softmax_scale=None, group=None,
  layout=..., **kw)`` on local shards (B, N/G, Z, d); ``level="layer"``
  methods (tensor parallelism) are attention layers (``baselines.layer``);
* ``comm_bytes(shape, **options)``: bytes ONE rank sends for one forward +
  backward, ``{(phase, kind): bytes}``, exactly what
  ``burst_impl.comm.count_bytes`` must count (tests assert equality);
* ``memory_bytes(shape, **options)``: activation bytes per rank that one
  attention layer keeps for backward (a model, printed beside the measured peak);
* ``check(shape, **options)``: ``ValueError`` if the method cannot run that shape;
* ``available()``: whether it can run on this machine at all (adapters need
  their package, some need CUDA);
* ``layouts``: the sequence layouts it accepts (``"balanced"``: the balanced chunk
  layout of the case's mask, any ``"balanced:K"``);
* ``masks``: whether it takes ``mask=`` (sliding window, documents, block-sparse,
  ``burst_impl.masks``); without it only ``causal`` true/false.
* ``kernel``: the local kernel it always runs, for methods that take no
  ``backend=`` (a peer package's own calls, materialised scores); None: it
  takes ``backend=``, a ``burst_impl.kernels`` name (None = automatic).
* ``link_bytes(shape, rank, node_size, **options)``: the same bytes of rank
  ``rank``, split by link class, ``{(phase, kind, link): bytes}`` with link
  "intra" or "inter" (``burst_impl.nodes``; ``node_size`` None: ``LOCAL_WORLD_SIZE``,
  else one node), exactly what ``count_bytes().link_dict()`` must count;
  None for adapters whose sends happen inside another package ("unclassified");
* ``variant_of``: for a timing variant of another method (same numerics,
  same bytes, e.g. communication/computation overlap switched off), its name;
* ``operator_backward``: for a method that IS the BurstAttention operator
  (``burst_impl.burst_attn_func``), the backward scheme it binds ("auto",
  "burst", "ring"): sequence-level checkpointing can cache its (O, lse) and run
  the operator's backward from them (``burst_impl.model.checkpoint``); None: the
  method only exposes its own autograd, and ``seq``/``whole`` checkpoint it as ``full``;
* ``cached_attention(causal=, layout=, group=, options=)``: for a method that is not the operator
  but has its own backward from (O, lse) (``burst_usp``), an object with ``causal``, ``layout``,
  ``forward(q, k, v, layout) -> (O, lse)`` and ``backward(dout, q, k, v, O, lse) -> (dq, dk, dv)``,
  which sequence-level checkpointing runs instead of the operator; None: ``operator_backward`` decides;
* ``fresh_output(shape, **options)``: True when the method returns a new
  (B, N/G, Z, d) buffer rather than the O its backward saved (Ulysses' output
  all-to-all): the layer's output projection then keeps both (``layer_memory``);
* ``tp_version``: for tensor-parallel layers, the Megatron flavour ("v1", "v3")
  that the whole-model transform (``baselines.tensor_parallel``) applies;
* ``schedule``: the performance model's schedule family and its options
  (``Schedule``; the topology and overlap come from ``options``);
* ``colour``, ``marker``: how figures draw it, the same in every figure
  (``colour``: an index into the suite's 40-colour palette, ``experiments.figstyle.PALETTE``:
  tab20, then 10 more dark/light pairs; an even index is a dark shade and the
  next odd one its light shade, which a timing variant takes; ``marker``: a
  matplotlib marker). None: a stable colour and marker derived from the name.

The byte report lists every method that is not a timing variant (``variant_of``);
the generated methods table (``docs/methods.md``) is one row per entry.

``options`` are the method's keyword arguments (e.g. ``ulysses_degree`` for
``usp``); ``method.bytes(shape, **options)``, ``method.memory(shape, **options)``,
``method.validate(shape, **options)`` and ``method.call(...)`` merge them
with the registered defaults.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable

from burst_impl.layout import BALANCED, LAYOUT_NAMES, is_balanced_name
from burst_impl.shape import AttnShape

# Methods accept these unless they list more ("striped" needs position-generic masks).
CHUNKED_LAYOUTS = ("contiguous", "zigzag")
LEVELS = ("op", "layer")


def _no_check(shape: AttnShape, **_) -> None:
    return None


def _always() -> bool:
    return True


def _never(shape: AttnShape, **_) -> bool:
    return False


@dataclass(frozen=True)
class Schedule:
    """How the performance model (``experiments/perfmodel/schedules``) builds this method's tasks:
    ``family`` names the builder ("ring", "ring_rsa", "ulysses", "usp", "tp"), ``options`` its
    keyword arguments (e.g. ``default="burst"`` for the ring family's backward). A method's
    ``topology`` and ``overlap`` options reach the builder too."""

    family: str
    options: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Method:
    name: str
    level: str                                   # "op" or "layer"
    fn: Callable
    comm_bytes: Callable[..., dict]
    memory_bytes: Callable[..., int]
    description: str
    travels: str                                 # what moves, for the generated methods table
    layouts: tuple[str, ...] = CHUNKED_LAYOUTS
    check: Callable[..., None] = _no_check
    available: Callable[[], bool] = _always       # external adapters: is the package importable?
    external: str | None = None                   # peer package it wraps or is checked against
    # True for adapters whose sends happen inside another package: their counters
    # record the formula at the points the sends happen, they do not measure.
    bytes_by_formula: bool = False
    masks: bool = False                           # takes mask= (burst_impl.masks)
    options: dict = field(default_factory=dict)   # fixed keyword arguments for fn
    # What the attention layer of this method takes (baselines.layer): "sequence" = the
    # layout shard (B, N/G, H) of the hidden states; "replicated" = all of (B, N, H).
    layer_input: str = "sequence"
    kernel: str | None = None                     # fixed local kernel (no backend= choice), for records
    link_bytes: Callable[..., dict] | None = None
    variant_of: str | None = None
    operator_backward: str | None = None          # the BurstAttention operator's backward it binds
    cached_attention: Callable[..., object] | None = None   # its own (O, lse) hook for seq/whole checkpointing
    fresh_output: Callable[..., bool] = _never
    tp_version: str | None = None                 # "v1" / "v3" for tensor-parallel layers
    schedule: Schedule | None = None              # None: not modelled
    colour: int | None = None                     # palette index in figures (a variant: its method's + 1)
    marker: str | None = None

    def __post_init__(self):
        if self.level not in LEVELS:
            raise ValueError(f"level={self.level!r} of method {self.name!r} must be one of {LEVELS}")
        bad = set(self.layouts) - set(LAYOUT_NAMES)
        if bad:
            raise ValueError(f"layouts={self.layouts} of method {self.name!r}: unknown {sorted(bad)}")

    def _opts(self, options: dict) -> dict:
        return {**self.options, **options}

    def validate(self, shape: AttnShape, **options) -> None:
        layout = BALANCED if is_balanced_name(shape.layout) else shape.layout
        if layout not in self.layouts:
            raise ValueError(f"layout={shape.layout!r} is not supported by method {self.name!r}; "
                             f"it supports {self.layouts}")
        if shape.mask and not self.masks:
            raise ValueError(f"mask={shape.mask!r}: method {self.name!r} takes only causal true/false, not masks")
        shape.validate()
        self.check(shape, **self._opts(options))

    def problem(self, shape: AttnShape, level: str, **options) -> str | None:
        """Why this method cannot run ``shape`` at ``level`` on this machine, else None.

        The one "can this case run here" check: the harness records such cases as
        skipped with this reason (and spec loading turns shape errors into load errors).
        """
        if not self.available():
            return f"method {self.name!r} is unavailable here (needs {self.external or 'an optional package'})"
        if level == "op" and self.level == "layer":
            return (f"method {self.name!r} is layer-only (tensor parallelism splits the layer's weights); "
                    "use measure.level: layer")
        try:
            self.validate(shape, **options)
        except ValueError as e:
            return f"method {self.name!r} cannot run this shape: {e}"
        return None

    def bytes(self, shape: AttnShape, **options) -> dict:
        """``{(phase, kind): bytes}`` one rank sends for one forward + backward."""
        return self.comm_bytes(shape, **self._opts(options))

    def links(self, shape: AttnShape, rank: int = 0, node_size=None, **options) -> dict:
        """``{(phase, kind, link): bytes}`` rank ``rank`` sends for one forward + backward, by link class."""
        if self.link_bytes is None:
            return {(p, k, "unclassified"): b for (p, k), b in self.bytes(shape, **options).items()}
        return self.link_bytes(shape, rank, node_size, **self._opts(options))

    def memory(self, shape: AttnShape, **options) -> int:
        return self.memory_bytes(shape, **self._opts(options))

    def layer_memory(self, shape: AttnShape, **options) -> int:
        """Activation bytes one rank keeps for backward in this method's attention LAYER (a model).

        A tensor-parallel method models its whole layer (``memory``: the gathered input X and the
        head-sharded q, k, v, out, lse). A sequence-parallel method keeps its operator's model
        (``memory``: q, k, v, out, lse of its shard) plus the layer input x (B, N/G, H) that the QKV
        projection keeps for the weight gradients, plus, where its output is a fresh buffer
        (``fresh_output``), that (B, N/G, H) output, which the output projection keeps besides the O
        its attention saved. Weights are parameters, not counted."""
        if self.level == "layer":
            return int(self.memory(shape, **options))
        shard = shape.rows * shape.heads * shape.head_dim * shape.elem_size     # (B, N/G, H)
        out_copy = shard if self.fresh_output(shape, **self._opts(options)) else 0
        return int(self.memory(shape, **options)) + shard + out_copy

    def call(self, *args, **kwargs):
        """``fn`` with the registered options as defaults (``mask`` only passed on when given)."""
        if kwargs.get("mask", "") in ("", None):
            kwargs.pop("mask", None)
        return self.fn(*args, **self._opts(kwargs))


def no_overlap(base: Method) -> Method:
    """``base``'s timing variant ``<name>_no_overlap``: the same entry with ``overlap=False``
    (every ring transfer waited for before the step computes), same numerics and bytes."""
    return replace(base, name=f"{base.name}_no_overlap", options={**base.options, "overlap": False},
                   variant_of=base.name, colour=None if base.colour is None else base.colour + 1,
                   description=f"{base.name} with overlap=False: each ring transfer is waited for before "
                               "the step computes",
                   travels=f"as {base.name}, serialised with the compute")
