"""The papers' tables and figures drawn as grouped bars: one group per setting (a column of the table: a
sequence length, or a model / GPUs / tokens setting that no line may join to the next), in the table's own
order, and in each group one pair of bars per paper row: the paper's value solid, the model's lighter with a
dashed edge. A row's colour is its method's (``figstyle.color``, as in every figure); rows of one method
(BurstAttention with and without ZeRO, the ablation's cumulative steps) differ by hatch, so the legend has one
entry per paper row. An OOM is an empty bar the height of the axes, marked "OOM"; a value the source does not
give, or a cell not modelled, is a short mark at the bottom. Columns of another quantity (the ablation's
memory) get a panel of their own. One footer line says where the numbers come from."""
from __future__ import annotations

import math
import textwrap
from dataclasses import dataclass
from pathlib import Path

from matplotlib.patches import Patch, Rectangle
from matplotlib.transforms import blended_transform_factory

from baselines.registry import METHODS

from ..figstyle import FOOTER_GID, color, legend_outside, plt, save_figure
from ..model_only import MODEL_ONLY
from .model_error import Cell
from .paper import OOM, PaperTable
from .quantities import QUANTITIES

HATCHES = ("", "//", "..", "xx", "\\\\", "oo", "++", "--")
MODEL_ALPHA = 0.45          # the modelled bar's fill: its row's colour, lighter
LOG_SPAN = 30               # values spanning more than this factor get a log axis (Tables 2/3: 0.1 s to 75 s)
GROUP_WIDTH = 0.8           # of the unit between two settings' groups
MAX_BAR = 0.12              # a few rows do not make a wall of colour: the group narrows instead


@dataclass(frozen=True)
class RowStyle:
    label: str
    colour: tuple
    hatch: str


def _family(method: str) -> str:
    """The registry method a row's method belongs to: a model-only variant's, a timing variant's parent."""
    if method in MODEL_ONLY:
        return MODEL_ONLY[method].method
    m = METHODS.get(method)
    return m.variant_of if m is not None and m.variant_of else method


def row_styles(t: PaperTable, cells: list[Cell]) -> list[RowStyle]:
    """Per paper row: its method's colour, and a hatch of its own among the rows of that method's family
    (the family's own method first, plain, whatever the paper's row order)."""
    ncol = len(t.columns)
    methods = [cells[i * ncol].paper.method.method for i in range(len(t.rows))]
    order = sorted(range(len(t.rows)), key=lambda i: (methods[i] != _family(methods[i]), i))
    seen: dict[str, int] = {}
    hatch = {}
    for i in order:
        k = seen[_family(methods[i])] = seen.get(_family(methods[i]), -1) + 1
        hatch[i] = HATCHES[k % len(HATCHES)]
    return [RowStyle(row.label, color(m), hatch[i]) for i, (row, m) in enumerate(zip(t.rows, methods))]


def _panels(t: PaperTable) -> list[tuple[str, list[int]]]:
    """Columns grouped by the quantity they hold, in the table's order: one panel each."""
    out: dict[str, list[int]] = {}
    for ci, c in enumerate(t.columns):
        out.setdefault(c.quantity or t.quantity, []).append(ci)
    return list(out.items())


def _number(v) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 else None


def _floor(values: list[float]) -> float:
    """0 on a linear axis; on a log axis (values spanning > LOG_SPAN) a decade at least 3x below the smallest
    value, so the shortest bar still shows."""
    if not values or max(values) / min(values) <= LOG_SPAN:
        return 0.0
    return 10.0 ** math.floor(math.log10(min(values) / 3))


def _empty_bar(ax, x: float, w: float, style: RowStyle, modelled: bool) -> None:
    # the height of the axes whatever its scale: out of memory has no value to draw
    trans = blended_transform_factory(ax.transData, ax.transAxes)
    ax.add_patch(Rectangle((x - w / 2, 0), w, 0.97, transform=trans, fill=False, edgecolor=style.colour,
                           linewidth=1.2, linestyle="--" if modelled else "-", clip_on=False))
    ax.text(x, 0.02, "OOM", transform=trans, rotation=90, fontsize=6, ha="center", va="bottom")


def _bar(ax, x: float, w: float, value, status: str | None, style: RowStyle, floor: float, modelled: bool) -> None:
    v = _number(value)
    if status == "oom":
        _empty_bar(ax, x, w, style, modelled)
    elif v is not None:
        face = (*style.colour[:3], MODEL_ALPHA) if modelled else style.colour
        ax.bar(x, v - floor, w, bottom=floor, color=face, hatch=style.hatch, edgecolor="black", linewidth=0.6,
               linestyle="--" if modelled else "-")
    else:
        trans = blended_transform_factory(ax.transData, ax.transAxes)
        ax.text(x, 0.02, "n/a" if modelled else "—", transform=trans, rotation=90, fontsize=6, ha="center",
                va="bottom")


def _panel(ax, t: PaperTable, cells: list[Cell], cols: list[int], styles: list[RowStyle], quantity: str) -> None:
    ncol, nrow = len(t.columns), len(t.rows)
    values = [v for ci in cols for i, r in enumerate(t.rows)
              for v in (_number(r.values[ci]), cells[i * ncol + ci].ours) if v]
    floor = _floor(values)
    w = min(GROUP_WIDTH / (2 * nrow), MAX_BAR)
    for g, ci in enumerate(cols):
        for i, row in enumerate(t.rows):
            x = g - nrow * w + (2 * i + 0.5) * w
            cell = cells[i * ncol + ci]
            _bar(ax, x, w, row.values[ci], "oom" if row.values[ci] == OOM else None, styles[i], floor, False)
            _bar(ax, x + w, w, cell.ours, cell.status, styles[i], floor, True)
    if floor:
        ax.set_yscale("log")
        ax.set_ylim(bottom=floor)
    ax.set_xticks(range(len(cols)), [textwrap.fill(t.columns[ci].label, 16) for ci in cols], fontsize=8)
    ax.set_xlim(-0.5, len(cols) - 0.5)
    q = QUANTITIES[quantity]
    ax.set_ylabel(f"{q.label} ({q.unit})" if q.unit else q.label)
    ax.grid(True, axis="y", alpha=0.3)


def _legend(ax, t: PaperTable, cells: list[Cell], styles: list[RowStyle]) -> None:
    """One entry per paper row (colour and hatch), then what solid, light and empty bars mean."""
    handles = [Patch(facecolor=s.colour, hatch=s.hatch, edgecolor="black", linewidth=0.6, label=s.label)
               for s in styles]
    handles += [Patch(facecolor="darkgray", edgecolor="black", linewidth=0.6, label="paper: solid"),
                Patch(facecolor=(0.66, 0.66, 0.66, MODEL_ALPHA), edgecolor="black", linewidth=0.6, linestyle="--",
                      label="modelled: lighter, dashed edge")]
    if any(v == OOM for r in t.rows for v in r.values) or any(c.status == "oom" for c in cells):
        handles.append(Patch(fill=False, edgecolor="dimgray", label="out of memory: empty bar marked OOM"))
    legend_outside(ax, handles, [h.get_label() for h in handles], fontsize=7)


def paper_figure(t: PaperTable, cells: list[Cell], out: Path, provenance: str) -> Path:
    panels = _panels(t)
    styles = row_styles(t, cells)
    # room for every bar: two per row in each setting's group
    widths = [max(2.8, 0.13 * 2 * len(t.rows) * len(cols) + 0.8) for _, cols in panels]
    # the legend sits outside, right of the last panel: its width is added, not taken from the panels
    fig, axs = plt.subplots(1, len(panels), figsize=(sum(widths) + 3.2, 4.6), squeeze=False,
                            gridspec_kw={"width_ratios": widths})
    for ax, (quantity, cols) in zip(axs[0], panels):
        _panel(ax, t, cells, cols, styles, quantity)
        if len(panels) > 1:
            ax.set_title(QUANTITIES[quantity].label, fontsize=9)
    _legend(axs[0][-1], t, cells, styles)
    fig.suptitle(f"{t.id}: {t.title}, paper vs modelled", fontsize=10)
    fig.tight_layout()
    fig.text(0.5, 0.0, provenance, ha="center", va="top", fontsize=7, color="dimgray", gid=FOOTER_GID)
    return save_figure(fig, out)
