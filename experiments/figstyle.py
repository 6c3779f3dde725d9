"""The suite's one figure style: a fixed colour, marker and line style per method, one resolution, and
the finishing every figure gets on saving (tick labels that never overlap, nothing clipped).

Every figure module imports this first: it selects matplotlib's Agg backend (files only, no display).
A method keeps its colour in every figure and every run because its ``Method`` says it (``colour``: an
index into ``PALETTE``, ``marker``), not the registry's order or the figure's other methods: adding a
method never moves another's colour. A model-only variant's comes from ``experiments.model_only``. A
method without one gets a stable colour and marker from its name.

``PALETTE`` has 40 colours in dark/light pairs (an even index is a dark shade, the next odd one its
light shade, which a timing variant takes): tab20 first (indices 0-19, so the colours of the figures
drawn before it grew stay), then 10 pairs chosen greedily from CIELAB hue/chroma/lightness steps so that
every colour is at least as far from every other (CIE76 distance >= 16.6) as tab20's two closest.
"""
from __future__ import annotations

import zlib
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # after the backend is chosen

from matplotlib.colors import to_rgb

from baselines.registry import METHODS

from .model_only import MODEL_ONLY

# indices 20-39: dark, light of each added hue (green, blue, teal, wine, brown, pine, orchid, navy, olive, rust)
_MORE = ("#20510a #799a66 #2e57c2 #9ea5f8 #08885b #8fd5b1 #8d024e #cd7697 #714b01 #bd9767 "
         "#175d4f #7aa79b #b54eb2 #f9adf4 #12487d #7b91bb #5f6137 #adad8d #84250a #cb7d63").split()
PALETTE = tuple(plt.get_cmap("tab20").colors) + tuple(to_rgb(c) for c in _MORE)
_SERIES_COLOURS = plt.get_cmap("tab10").colors  # for things that are not methods (layouts, series)
# A name without a colour (a model spec's row, e.g. burst_ring) hashes into tab20 as before the palette grew,
# so the figures drawn then keep their colours.
_HASH_SLOTS = 20
FOOTER_GID = "provenance-footer"      # the one footer line of every figure (tests find it by this gid)
_EXTRA_MARKERS = "o s D ^ v < > p h * P X".split()


def _method_order(m: str) -> int:
    order = list(METHODS)
    return order.index(m) if m in order else len(order)


def _index_and_marker(method: str) -> tuple[int | None, str | None]:
    m = METHODS.get(method) or MODEL_ONLY.get(method)
    return (m.colour, m.marker) if m is not None else (None, None)


def color(method: str) -> tuple:
    """The method's colour in every figure; a name without one gets a stable colour from its name."""
    index = _index_and_marker(method)[0]
    return PALETTE[index if index is not None else zlib.crc32(method.encode()) % _HASH_SLOTS]


def _variant(method: str) -> bool:
    m = METHODS.get(method)
    return method in MODEL_ONLY or (m is not None and m.variant_of is not None)


def style(method: str) -> dict:
    """Colour, marker and line style: a variant (no overlap, no LAO, no FlashAttention) is dashed and hollow."""
    marker = _index_and_marker(method)[1] or _EXTRA_MARKERS[zlib.crc32(method.encode()) % len(_EXTRA_MARKERS)]
    dashed = _variant(method)
    return {"color": color(method), "marker": marker, "linestyle": "--" if dashed else "-",
            "markersize": 6.5, "markerfacecolor": "none" if dashed else color(method)}


def legend_outside(ax, handles=None, labels=None, **kw):
    """The legend to the right of the axes, never over the data."""
    if handles is None:
        handles, labels = ax.get_legend_handles_labels()
    return ax.legend(handles, labels, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0,
                     fontsize=kw.pop("fontsize", 8), **kw)


def _overlap(labels, renderer) -> bool:
    boxes = sorted((t.get_window_extent(renderer) for t in labels if t.get_visible() and t.get_text()),
                   key=lambda b: b.x0)
    return any(a.x1 > b.x0 + 0.5 and a.y1 > b.y0 and b.y1 > a.y0 for a, b in zip(boxes, boxes[1:]))


def untangle_ticks(fig) -> None:
    """Rotate the x tick labels of every axes whose labels overlap (30, 60, then 90 degrees), then thin
    them: category names (method names under bars) stay readable whatever their number."""
    renderer = fig.canvas.get_renderer()
    for ax in fig.axes:
        labels = ax.get_xticklabels()
        for angle in (30, 60, 90):
            if not _overlap(labels, renderer):
                break
            for t in labels:
                t.set_rotation(angle)
                t.set_horizontalalignment("right" if angle < 90 else "center")
                t.set_rotation_mode("anchor" if angle < 90 else "default")
        step = 2
        while _overlap(labels, renderer) and step < len(labels):
            for i, t in enumerate(labels):
                t.set_visible(i % step == 0)
            step += 1


def place_footer(fig) -> None:
    """Move the footer line (gid FOOTER_GID) just below the lowest thing drawn (rotated tick labels,
    notes), so it never sits on them; saving with a tight box keeps it in the frame."""
    feet = [t for t in fig.texts if t.get_gid() == FOOTER_GID]
    if not feet:
        return
    renderer = fig.canvas.get_renderer()
    boxes = [ax.get_tightbbox(renderer) for ax in fig.axes] + \
        [t.get_window_extent(renderer) for t in fig.texts if t.get_gid() != FOOTER_GID and t.get_text()]
    low = min([b.y0 for b in boxes if b is not None] + [0.0])
    for t in feet:
        t.set_y((low - 4) / fig.bbox.height)       # 4 px under the lowest artist, in figure coordinates
        t.set_verticalalignment("top")


def save_figure(fig, out: Path) -> Path:
    """Write ``fig`` to ``out`` (its folder made) at the suite's one resolution, and free it. The saved
    area is the figure's tight bounding box, so titles, outside legends and the footer are never clipped."""
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.canvas.draw()
    untangle_ticks(fig)
    place_footer(fig)
    fig.savefig(out, dpi=120, bbox_inches="tight", pad_inches=0.15)
    plt.close(fig)
    return out
