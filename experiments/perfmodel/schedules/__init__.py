"""Per-method schedule builders, keyed by registry name (plus model-only variants).

A builder takes a ``Ctx`` (shape, mode, level, cost model, placement, the
registry's byte table) and adds the method's tasks for the phases the mode
asks for. Phase B adds entries here (the double ring, BurstEngine's model
level schedules) without touching the existing ones. The double ring's pass is
``double_ring.routed_pass`` (the runtime's own routes), chosen by ``double_ring.pass_for``.
"""
from __future__ import annotations

from typing import Callable

from .common import Ctx
from .ring_family import (burst, burst_double_ring, burst_double_ring_no_overlap, burst_no_overlap, burst_nolao, ring,
                          ring_flash_attn)
from .ring_rsa import ring_rsa, ring_rsa_no_overlap
from .tp import tp_v1, tp_v1_noflash, tp_v3, tp_v3_noflash
from .ulysses import ulysses, usp, usp_no_overlap

Builder = Callable[[Ctx], dict]

# registry name -> builder
SCHEDULES: dict[str, Builder] = {
    "burst": burst,
    "burst_qring": burst,            # what travels backward comes from the registry's formula
    "burst_no_overlap": burst_no_overlap,
    "burst_double_ring": burst_double_ring,
    "burst_double_ring_no_overlap": burst_double_ring_no_overlap,
    "ring": ring,
    "ring_flash_attn": ring_flash_attn,
    "ring_rsa": ring_rsa,
    "ring_rsa_no_overlap": ring_rsa_no_overlap,
    "ulysses": ulysses,
    "deepspeed_ulysses": ulysses,
    "usp": usp,
    "usp_no_overlap": usp_no_overlap,
    "tp_v1": tp_v1,
    "tp_v3": tp_v3,
}

# Model-only variants of PAPER.md §3's tables (not registry methods: nothing runs them):
# name -> (registry method whose bytes and memory model they share, builder, label)
VARIANTS: dict[str, tuple[str, Builder, str]] = {
    "burst_nolao": ("burst", burst_nolao, "Burst without LAO"),
    "tp_v1_noflash": ("tp_v1", tp_v1_noflash, "TP V1 without FlashAttention"),
    "tp_v3_noflash": ("tp_v3", tp_v3_noflash, "TP V3 without FlashAttention"),
}


def builder(name: str) -> tuple[str, Builder]:
    """(registry method, builder) for a registry name or a variant; ValueError naming the rule."""
    if name in SCHEDULES:
        return name, SCHEDULES[name]
    if name in VARIANTS:
        base, fn, _ = VARIANTS[name]
        return base, fn
    raise ValueError(f"method={name!r} has no performance-model schedule; modelled: "
                     f"{sorted(SCHEDULES)} and variants {sorted(VARIANTS)}")
