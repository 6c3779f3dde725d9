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
    methods_with(level="op", layout="zigzag", variants=False)   # names with those capabilities
"""
from __future__ import annotations

import importlib
import os
import pkgutil
from types import ModuleType

from burst_impl.layout import BALANCED, LAYOUT_NAMES, is_balanced_name
from burst_impl.method import LEVELS, Method

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


def methods_with(*, level: str | None = None, layout: str | None = None, masks: bool | None = None,
                 variants: bool = True, adapters: bool = True, available: bool | None = None) -> tuple[str, ...]:
    """Names of the registered methods with these capabilities, in registry order (None: any).

    The query behind every test that is about all methods of a capability, so that a method
    added to the registry is covered without editing the test. ``level``: "op" or "layer";
    ``layout``: a layout the method accepts (any "balanced:K" counts as "balanced"); ``masks``:
    whether it takes ``mask=``; ``variants=False`` leaves out timing variants (``variant_of``:
    their method's numerics and bytes); ``adapters=False`` leaves out adapters of a peer package
    whose sends happen inside it (``bytes_by_formula``); ``available``: whether it runs here.
    """
    if level is not None and level not in LEVELS:
        raise ValueError(f"level={level!r} must be one of {LEVELS} (or None: any)")
    if layout is not None and not (layout in LAYOUT_NAMES or is_balanced_name(layout)):
        raise ValueError(f"layout={layout!r} must be one of {LAYOUT_NAMES} or 'balanced:K' (or None: any)")
    wanted = BALANCED if layout is not None and is_balanced_name(layout) else layout
    return tuple(name for name, m in METHODS.items()
                 if (level is None or m.level == level) and (wanted is None or wanted in m.layouts)
                 and (masks is None or m.masks == masks) and (variants or m.variant_of is None)
                 and (adapters or not m.bytes_by_formula)
                 and (available is None or m.available() == available))
