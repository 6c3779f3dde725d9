"""Schedule builders, one per schedule family, and the method -> builder map derived from the registry.

A builder takes a ``Ctx`` (shape, mode, level, cost model, placement, the
registry's byte table) and adds the method's tasks for the phases the mode
asks for. Which builder a method uses, and with which options, is a field of
its ``Method`` (``Method.schedule``: a family and its options; the method's
``topology`` and ``overlap`` options reach the builder too), so a new method
needs no edit here. The double ring's pass is ``double_ring.routed_pass`` (the
runtime's own routes), chosen by ``double_ring.pass_for``.
"""
from __future__ import annotations

import functools
from typing import Callable

from baselines.registry import METHODS, get
from burst_impl.method import Method

from ...model_only import MODEL_ONLY

from .allgather_kv import allgather_kv
from .common import Ctx
from .ring_family import flat
from .ring_rsa import ring_rsa
from .tp import tp
from .ulysses import ulysses, usp

Builder = Callable[[Ctx], dict]

FAMILIES: dict[str, Callable[..., dict]] = {"ring": flat, "ring_rsa": ring_rsa, "ulysses": ulysses, "usp": usp,
                                            "tp": tp, "allgather_kv": allgather_kv}
# What a builder takes from the method's own options, by family.
_FROM_OPTIONS = {"ring": ("topology", "overlap"), "ring_rsa": ("overlap",), "usp": ("overlap",)}


def for_method(method: Method, **extra) -> Builder:
    """The builder of ``method`` (``Method.schedule``), with ``extra`` options (model-only variants)."""
    if method.schedule is None or method.schedule.family not in FAMILIES:
        raise ValueError(f"method={method.name!r} has schedule={method.schedule!r}; the performance model "
                         f"builds the families {sorted(FAMILIES)}")
    family = method.schedule.family
    opts = {k: method.options[k] for k in _FROM_OPTIONS.get(family, ()) if k in method.options}
    return functools.partial(FAMILIES[family], **{**method.schedule.options, **opts, **extra})


def schedules() -> dict[str, Builder]:
    """registry name -> builder, for every registered method that has a schedule (read now, so a
    method registered later, ``baselines.registry.add_module``, is included)."""
    return {name: for_method(m) for name, m in METHODS.items() if m.schedule is not None}


# Model-only variants of docs/papers.md §3's tables (experiments.model_only: not registry methods, nothing runs them):
# name -> (registry method whose bytes and memory model they share, builder, label)
VARIANTS: dict[str, tuple[str, Builder, str]] = {
    v.name: (v.method, for_method(get(v.method), **v.schedule), v.label) for v in MODEL_ONLY.values()}


def builder(name: str) -> tuple[str, Builder]:
    """(registry method, builder) for a registry name or a variant; ValueError naming the rule."""
    if name in VARIANTS:
        base, fn, _ = VARIANTS[name]
        return base, fn
    if name in METHODS and METHODS[name].schedule is not None:
        return name, for_method(METHODS[name])
    raise ValueError(f"method={name!r} has no performance-model schedule; modelled: "
                     f"{sorted(schedules())} and variants {sorted(VARIANTS)}")
