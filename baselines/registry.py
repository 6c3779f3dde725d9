"""The registry of attention methods, keyed by the names used in experiment YAML.

Every module in ``baselines/methods/`` that defines ``METHODS`` (a tuple of
``baselines.method.Method``) contributes its entries; modules are taken in
the order of their ``ORDER`` number, which is the order of figure legends
and colours. Adding a method is adding one module there (and its tests).

    from baselines.registry import METHODS, get
    get("burst").call(q, k, v, causal=True, group=g, layout="zigzag")
    get("ulysses").bytes(shape)          # {(phase, kind): bytes one rank sends}
"""
from __future__ import annotations

import importlib
import pkgutil

from . import methods as _methods_pkg
from .method import Method


def _discover() -> dict[str, Method]:
    mods = [importlib.import_module(f"{_methods_pkg.__name__}.{m.name}")
            for m in pkgutil.iter_modules(_methods_pkg.__path__)]
    mods = sorted((m for m in mods if hasattr(m, "METHODS")), key=lambda m: (m.ORDER, m.__name__))
    out: dict[str, Method] = {}
    for mod in mods:
        for method in mod.METHODS:
            if method.name in out:
                raise ValueError(f"method {method.name!r} registered twice ({mod.__name__})")
            out[method.name] = method
    return out


METHODS: dict[str, Method] = _discover()


def get(name: str) -> Method:
    if name not in METHODS:
        raise ValueError(f"method={name!r} is unknown; registered: {sorted(METHODS)}")
    return METHODS[name]
