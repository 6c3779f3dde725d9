"""The suite's one figure style: a fixed colour, marker and line style per method, one resolution, and
the finishing every figure gets on saving (tick labels that never overlap, nothing clipped).

Every figure module imports this first: it selects matplotlib's Agg backend (files only, no display).
A method keeps its colour in every figure and every run because the colour is written down here, per
name (``COLOURS``, the 20 colours of tab20), not derived from the registry's order: adding a method never
moves another's colour. A method added to the registry needs its entry here (a test says so); until then
it gets a stable colour from its name.
"""
from __future__ import annotations

import zlib
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # after the backend is chosen

from baselines.registry import METHODS

_TAB20 = plt.get_cmap("tab20").colors
_PALETTE = plt.get_cmap("tab10").colors      # for things that are not methods (layouts, series)
# method -> tab20 index; a *_no_overlap variant takes the light shade of its method's hue
_COLOUR_INDEX = {
    "burst": 0, "burst_no_overlap": 1, "ring": 2, "ring_flash_attn": 3, "burst_double_ring": 4,
    "burst_double_ring_no_overlap": 5, "ring_rsa": 6, "ring_rsa_no_overlap": 7, "ulysses": 8,
    "deepspeed_ulysses": 9, "usp": 10, "usp_no_overlap": 11, "tp_v3": 12, "tp_v3_noflash": 13,
    "loongtrain_double_ring": 14, "loongtrain_double_ring_no_overlap": 15, "tp_v1": 16, "tp_v1_noflash": 17,
    "burst_qring": 18, "burst_nolao": 19,
}
COLOURS = {m: _TAB20[i] for m, i in _COLOUR_INDEX.items()}
_MARKERS = {
    "burst": "o", "burst_no_overlap": "o", "burst_qring": "P", "burst_nolao": "o", "burst_double_ring": "D",
    "burst_double_ring_no_overlap": "D", "ring": "s", "ring_flash_attn": "X", "ring_rsa": "^",
    "ring_rsa_no_overlap": "^", "ulysses": "v", "deepspeed_ulysses": "<", "usp": "h", "usp_no_overlap": "h",
    "tp_v1": "*", "tp_v1_noflash": "*", "tp_v3": "p", "tp_v3_noflash": "p", "loongtrain_double_ring": ">",
    "loongtrain_double_ring_no_overlap": ">",
}
FOOTER_GID = "provenance-footer"      # the one footer line of every figure (tests find it by this gid)
_EXTRA_MARKERS = "o s D ^ v < > p h * P X".split()


def _method_order(m: str) -> int:
    order = list(METHODS)
    return order.index(m) if m in order else len(order)


def color(method: str) -> tuple:
    """The method's colour in every figure; a name not yet listed gets a stable colour from its name."""
    return COLOURS.get(method) or _TAB20[zlib.crc32(method.encode()) % len(_TAB20)]


def _variant(method: str) -> bool:
    return method.endswith(("_no_overlap", "_nolao", "_noflash"))


def style(method: str) -> dict:
    """Colour, marker and line style: a variant (no overlap, no LAO, no FlashAttention) is dashed and hollow."""
    marker = _MARKERS.get(method) or _EXTRA_MARKERS[zlib.crc32(method.encode()) % len(_EXTRA_MARKERS)]
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
