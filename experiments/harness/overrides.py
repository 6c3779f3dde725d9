"""A spec that names another as ``base:`` and states only what changes (the CPU mirrors of the paper specs).

    base: fig2_train_7b_8gpu        # a spec's name: experiments/specs/<name>.yaml or experiments/cpu/<name>.yaml
    name: cpu_fig2_train            # required with base: (else the mirror would write the base's results/<name>/)
    sweep: {seqlen: [512, 1024], world_size: 4, heads: 8, head_dim: 32}
    exclude: null                   # null: the base's value is dropped and the field's default applies

The merge rule, applied from the last base to the file itself:

* a mapping merges key by key, recursively (``sweep``, ``measure``, ``timeouts``, ``model``): a key the
  override leaves out keeps the base's value;
* a list or a scalar replaces the base's value whole (``methods``, ``exclude``, ``kernels``,
  ``model.variants``, one sweep axis such as ``seqlen``): lists are never concatenated;
* ``null`` removes the key, so the field's default applies (``exclude: null``: no exclusions;
  ``sweep: {kv_heads: null}``: MHA again).

A base may have a base of its own. The chain is resolved once, when the spec loads, into one plain mapping
that the schema then validates as if it had been written out in full. An unknown base, a cycle, a
``base`` that is not a name, or a top-level key the schema does not know is a ``ValueError`` naming the
file, the key and the rule.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import yaml

from .schema import FileErr

BASE_KEY = "base"


def merge(base: dict, over: dict) -> dict:
    """``over`` on top of ``base`` by the rule above; neither argument is modified."""
    out = dict(base)
    for key, value in over.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def read_mapping(path: Path) -> dict:
    """A spec file's YAML mapping, or a ValueError naming the file."""
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ValueError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: a spec must be a YAML mapping")
    return raw


def _base_name(raw: dict, err: FileErr) -> str:
    name = raw[BASE_KEY]
    if not isinstance(name, str) or not name:
        raise err(BASE_KEY, f"value {name!r} must be the name of a spec (experiments/specs or experiments/cpu)")
    return name


def resolve_base(raw: dict, path: Path | str, *, find: Callable[[str], Path | None],
                 check: Callable[[dict, FileErr], None]) -> dict:
    """``raw`` with its chain of ``base:`` specs merged in and the ``base`` keys gone.

    ``find(name)`` is the file of the spec called ``name``, or None; ``check(mapping, err)`` refuses a
    key the schema does not know, so each file of the chain is blamed for its own keys."""
    err = FileErr(path)
    check(raw, err)
    if BASE_KEY not in raw:
        return raw
    if "name" not in raw:
        raise err("name", "is required with base: (the mirror's own results/<name>/), e.g. name: cpu_<experiment>")
    layers: list[dict[str, Any]] = [raw]
    chain = [str(path)]
    seen = {Path(path).resolve()}
    while BASE_KEY in layers[-1]:
        name = _base_name(layers[-1], FileErr(chain[-1]))
        base_path = find(name)
        if base_path is None:
            raise FileErr(chain[-1])(BASE_KEY, f"{name!r} is not a spec in experiments/specs or experiments/cpu")
        if base_path.resolve() in seen:
            raise err(BASE_KEY, f"the bases form a cycle: {' -> '.join([*chain, str(base_path)])}")
        seen.add(base_path.resolve())
        chain.append(str(base_path))
        layer = read_mapping(base_path)
        check(layer, FileErr(base_path))
        layers.append(layer)
    merged = layers[-1]           # the root as written (its nulls mean what they mean without a base)
    for layer in reversed(layers[:-1]):
        merged = merge(merged, {k: v for k, v in layer.items() if k != BASE_KEY})
    return merged
