"""The model-only variants, in one place: rows of the papers' tables that no registry method is, because
what they change (no LAO: materialised scores; no FlashAttention) is the local kernel, not the method.

The performance model builds each from its method's schedule with extra options
(``experiments.perfmodel.schedules.VARIANTS``); a measured run realises it as its method on a kernel
(``measured_as``: how the report finds its records, ``experiments.report.compare``); the papers' tables
name it (``experiments/paper/methods.yaml``); figures draw it with its own colour and marker
(``experiments.figstyle``: an index into the suite's palette, the light shade of its method's hue where
free) and dashed, as every variant. A new one is a line here and nothing else.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ModelOnly:
    name: str
    method: str              # the registry method whose bytes and memory model it shares
    label: str
    schedule: dict = field(default_factory=dict)   # extra options of the method's schedule builder
    kernel: str = "math"     # the local kernel (burst_impl.kernels) a measured run realises it with
    colour: int | None = None    # index into experiments.figstyle.PALETTE
    marker: str | None = None

    @property
    def measured_as(self) -> dict:
        """The record fields of a measured run of this row."""
        return {"method": self.method, "kernel": self.kernel}


MODEL_ONLY: dict[str, ModelOnly] = {v.name: v for v in (
    ModelOnly("burst_nolao", "burst", "Burst without LAO", {"materialised": True}, colour=19, marker="o"),
    ModelOnly("tp_v1_noflash", "tp_v1", "TP V1 without FlashAttention", {"flash": False}, colour=17, marker="*"),
    ModelOnly("tp_v3_noflash", "tp_v3", "TP V3 without FlashAttention", {"flash": False}, colour=13, marker="p"),
)}
