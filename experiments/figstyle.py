"""The suite's one figure style: a fixed colour, marker and line style per method, one resolution.

Every figure module imports this first: it selects matplotlib's Agg backend (files only, no display).
A method keeps its colour in every figure and every run because the style follows the registry's
order (``baselines.registry.METHODS``); names outside the registry (model-only variants) come last.
"""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # after the backend is chosen

from baselines.registry import METHODS

_PALETTE = plt.get_cmap("tab10").colors
_MARKERS = "osD^vP*X<>hp"
_LINESTYLES = ("-", "--", "-.", ":")


def _method_order(m: str) -> int:
    order = list(METHODS)
    return order.index(m) if m in order else len(order)


def color(method: str) -> tuple:
    # registry order: a method keeps its colour in every figure and every run
    return _PALETTE[_method_order(method) % len(_PALETTE)]


def style(method: str) -> dict:
    """Marker and line style by registry order: two methods with equal numbers stay distinguishable."""
    k = _method_order(method)
    return {"color": color(method), "marker": _MARKERS[k % len(_MARKERS)],
            "linestyle": _LINESTYLES[(k // len(_PALETTE)) % len(_LINESTYLES) if k >= len(_PALETTE) else k % 2],
            "markersize": 7 - 0.4 * (k % 5), "markerfacecolor": "none" if k % 2 else color(method)}


def save_figure(fig, out: Path) -> Path:
    """Write ``fig`` to ``out`` (its folder made) at the suite's one resolution, and free it."""
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
