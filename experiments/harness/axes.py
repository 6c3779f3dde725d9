"""Sweep axes: the fields of the problem shape (``burst_impl.shape.AttnShape``), defined once.

Everything about an axis is derived from its field: the YAML key under
``sweep:`` (the field name), the value type (the annotation), the default
when a spec does not sweep it (``sweep_default`` metadata; absent: required),
its part of the case name (``label``), and the plot facets (every axis that
varies). Adding a field to ``AttnShape`` adds an axis everywhere.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Any, Iterator, Mapping

from burst_impl.shape import AttnShape

from .schema import Err, as_tuple, check_keys, check_type, field_types

_FIELDS = {f.name: f for f in dataclasses.fields(AttnShape)}
_TYPES = field_types(AttnShape)
AXES: tuple[str, ...] = tuple(_FIELDS)
REQUIRED: tuple[str, ...] = tuple(n for n, f in _FIELDS.items() if "sweep_default" not in f.metadata)
# Case names lead with the two axes every figure is about; cases are generated world size
# outermost (one launch per world size) and sequence length innermost.
_LEAD = ("seqlen", "world_size")
ID_ORDER = _LEAD + tuple(a for a in AXES if a not in _LEAD)
NEST_ORDER = ("world_size",) + tuple(a for a in AXES if a not in _LEAD) + ("seqlen",)


def human(n: int) -> str:
    """A token count as figures and tables print it: exact multiples of 2^20 as "1M", of 2^10 as "64K"."""
    if n >= 1 << 20 and n % (1 << 20) == 0:
        return f"{n >> 20}M"
    if n >= 1024 and n % 1024 == 0:
        return f"{n >> 10}K"
    return str(n)


def shape_from(d: Mapping[str, Any]) -> AttnShape:
    """The ``AttnShape`` of a case dict, a result record or a DataFrame row of records: every field of
    ``AttnShape`` that ``d`` has. A field that is absent, None or NaN (a record written before the axis
    existed; a column that only other records have) takes the dataclass's default, and ``kv_heads`` then
    ``heads`` (MHA). NumPy scalars (DataFrame rows) become Python values; an int field whose column holds
    NaN elsewhere (pandas then stores floats) becomes an int again."""
    kw = {}
    for name, typ in _TYPES.items():
        v = d.get(name)
        if hasattr(v, "item"):
            v = v.item()
        if v is None or (isinstance(v, float) and math.isnan(v)):
            continue
        if typ is int and isinstance(v, float) and v.is_integer():
            v = int(v)
        kw[name] = v
    kw.setdefault("kv_heads", kw.get("heads"))
    return AttnShape(**kw)


def default(axis: str) -> Any:
    return _FIELDS[axis].metadata["sweep_default"]


def doc(axis: str) -> str:
    return _FIELDS[axis].metadata.get("doc", "")


def label(axis: str, value: Any) -> str:
    """This axis' part of a case name, e.g. ``N4096`` for seqlen=4096 ("" to leave it out)."""
    lab = _FIELDS[axis].metadata.get("label", "{}")
    return lab(value) if callable(lab) else lab.format(value)


def case_id(method: str, level: str, mode: str, shape: AttnShape) -> str:
    """Stable key for resume: what is measured, not how often."""
    parts = [method, level, mode] + [label(a, getattr(shape, a)) for a in ID_ORDER]
    return ".".join(p for p in parts if p)


def parse_sweep(raw: Any, err: Err) -> dict[str, tuple]:
    """``sweep:`` mapping -> {axis: tuple of values}, every axis present (defaults filled in)."""
    if not isinstance(raw, dict):
        raise err("sweep", "must be a mapping of axis -> value or list of values")
    check_keys(raw, AXES, err, "sweep.")
    types_ = field_types(AttnShape)
    out = {}
    for axis in AXES:
        key = f"sweep.{axis}"
        if axis not in raw:
            if axis in REQUIRED:
                raise err(key, "is required")
            out[axis] = (default(axis),)
            continue
        vals = as_tuple(raw[axis])
        if not vals:
            raise err(key, "must not be empty")
        # None stands for the axis' default where the default itself is None (kv_heads: MHA).
        vals = tuple(v if v is None and default(axis) is None else check_type(v, types_[axis], err, key)
                     for v in vals)
        rule = _FIELDS[axis].metadata.get("check")
        for v in vals:
            why = rule(v) if rule is not None and v is not None else None
            if why:
                raise err(key, f"value {why}")
        out[axis] = vals
    return out


def shapes(sweep: dict[str, tuple]) -> Iterator[AttnShape]:
    """The Cartesian product of the sweep, as shapes (kv_heads None -> heads: MHA)."""
    for values in itertools.product(*(sweep[a] for a in NEST_ORDER)):
        point = dict(zip(NEST_ORDER, values))
        if point.get("kv_heads") is None:
            point["kv_heads"] = point["heads"]
        yield AttnShape(**point)
