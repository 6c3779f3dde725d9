"""The registry of attention methods, keyed by the names used in experiment YAML.

Every module in ``baselines/methods/`` that defines ``METHODS`` (a tuple of
``burst_impl.method.Method``) contributes its entries; modules are taken in
the order of their ``ORDER`` number, which is the order of figure legends
and colours. Adding a method is adding one module there (and its tests):
everything else the suite knows about it (perf-model schedule, checkpointing,
tensor-parallel flavour, byte report, the generated methods table) is a field
of its ``Method``.

A method may also live outside this package: ``add_module(module)`` registers
the ``METHODS`` of any imported module, and the environment variable
``BURST_METHOD_MODULES`` (comma-separated module names) does so at import, so
that spawned workers and ``python -m experiments.run`` see the same methods.

    from baselines.registry import METHODS, get
    get("burst").call(q, k, v, causal=True, group=g, layout="zigzag")
    get("ulysses").bytes(shape)          # {(phase, kind): bytes one rank sends}
"""
from __future__ import annotations

import importlib
import os
import pkgutil
from types import ModuleType

from burst_impl.method import Method

from . import methods as _methods_pkg

PLUGINS_ENV = "BURST_METHOD_MODULES"
METHODS: dict[str, Method] = {}


def add_module(module: ModuleType) -> list[str]:
    """Register ``module.METHODS``; ValueError (nothing registered) for a name already taken."""
    entries = getattr(module, "METHODS", None)
    if not isinstance(entries, tuple) or not all(isinstance(m, Method) for m in entries):
        raise ValueError(f"module {module.__name__!r} must define METHODS, a tuple of burst_impl.method.Method")
    taken = [m.name for m in entries if m.name in METHODS] + \
        [m.name for i, m in enumerate(entries) if m.name in {e.name for e in entries[:i]}]
    if taken:
        raise ValueError(f"method {taken[0]!r} registered twice ({module.__name__})")
    METHODS.update((m.name, m) for m in entries)
    return [m.name for m in entries]


def _discover() -> None:
    mods = [importlib.import_module(f"{_methods_pkg.__name__}.{m.name}")
            for m in pkgutil.iter_modules(_methods_pkg.__path__)]
    for mod in sorted((m for m in mods if hasattr(m, "METHODS")), key=lambda m: (m.ORDER, m.__name__)):
        add_module(mod)
    for name in filter(None, (n.strip() for n in os.environ.get(PLUGINS_ENV, "").split(","))):
        add_module(importlib.import_module(name))


_discover()


def get(name: str) -> Method:
    if name not in METHODS:
        raise ValueError(f"method={name!r} is unknown; registered: {sorted(METHODS)}")
    return METHODS[name]
