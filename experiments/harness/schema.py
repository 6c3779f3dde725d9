"""Typed dataclasses are the schema; YAML is how they are written down.

``from_mapping(cls, raw, err)`` builds a dataclass from a YAML mapping using
nothing but the dataclass itself: its fields are the allowed keys, fields
without a default are required, each value is checked against the field's
annotation (int, float, bool, str, ``tuple[X, ...]`` accepting a scalar or a
list, ``X | None``, nested dataclasses), and a field may add a rule with
``metadata={"check": fn}`` where ``fn(value)`` returns why the value is wrong
(or None). Every error is a ``ValueError`` naming the file, the key and the
rule, through the caller's ``err(key, rule)``.
"""
from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Callable

Err = Callable[[str, str], ValueError]


class FileErr:
    """``err(key, rule)`` -> ValueError("<file>: key '<key>': <rule>")."""

    def __init__(self, path):
        self.path = str(path)

    def __call__(self, key: str, rule: str) -> ValueError:
        return ValueError(f"{self.path}: key {key!r}: {rule}")


def as_tuple(value: Any) -> tuple:
    return tuple(value) if isinstance(value, (list, tuple)) else (value,)


def check_type(value: Any, typ, err: Err, key: str) -> Any:
    """``value`` converted to ``typ`` (a resolved annotation), or ``err``."""
    origin = typing.get_origin(typ)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(typ)
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return check_type(value, inner, err, key)
    if origin is tuple:
        (inner, _) = typing.get_args(typ)
        vals = as_tuple(value)
        if not vals:
            raise err(key, "must not be empty")
        return tuple(check_type(v, inner, err, key) for v in vals)
    if origin is dict:
        if not isinstance(value, dict):
            raise err(key, "must be a mapping")
        return dict(value)
    if dataclasses.is_dataclass(typ):
        return from_mapping(typ, value or {}, err, prefix=f"{key}.")
    if typ is bool:
        if not isinstance(value, bool):
            raise err(key, f"value {value!r} must be true or false")
        return value
    if typ is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise err(key, f"value {value!r} must be an integer")
        return value
    if typ is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise err(key, f"value {value!r} must be a number")
        return float(value)
    if typ is str:
        if not isinstance(value, str):
            raise err(key, f"value {value!r} must be a string")
        return value
    return value


def field_types(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def check_keys(raw: dict, allowed, err: Err, prefix: str = "") -> None:
    unknown = sorted(set(raw) - set(allowed))
    if unknown:
        where = f" under {prefix.rstrip('.')}" if prefix else ""
        raise err(f"{prefix}{unknown[0]}", f"unknown key; allowed keys{where}: {sorted(allowed)}")


def fields_from(cls, raw: Any, err: Err, *, prefix: str = "", skip: tuple[str, ...] = ()) -> dict:
    """Checked keyword arguments for dataclass ``cls`` from ``raw``; ``skip`` names fields the
    caller fills in itself (they are not allowed as keys)."""
    if not isinstance(raw, dict):
        raise err(prefix.rstrip(".") or cls.__name__, "must be a mapping")
    fields = [f for f in dataclasses.fields(cls) if f.init and f.name not in skip]
    check_keys(raw, [f.name for f in fields], err, prefix)
    types_ = field_types(cls)
    out = {}
    for f in fields:
        key = prefix + f.name
        if f.name not in raw:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise err(key, "is required")
            continue
        value = check_type(raw[f.name], types_[f.name], err, key)
        rule = f.metadata.get("check")
        why = rule(value) if rule is not None else None
        if why:
            raise err(key, why)
        out[f.name] = value
    return out


def from_mapping(cls, raw: Any, err: Err, *, prefix: str = ""):
    """An instance of dataclass ``cls`` from the mapping ``raw`` (see the module docstring)."""
    return cls(**fields_from(cls, raw, err, prefix=prefix))


def plain(x: Any) -> Any:
    """Dataclasses, tuples and dicts as YAML-safe plain data."""
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return plain(dataclasses.asdict(x))
    if isinstance(x, dict):
        return {k: plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [plain(v) for v in x]
    return x
