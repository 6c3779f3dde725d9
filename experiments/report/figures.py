"""The papers' tables and figures drawn in their own form, with the model's values beside them: lines
over sequence length where the paper sweeps it (Tables 2/3, the attention-only benchmark), bars per row
where its rows are methods or cumulative steps (Fig. 2/3 raw logs, Table 4, the ablation). The paper
solid, the model hatched or dashed; OOM written where a value is out of memory. One footer line says
where the numbers come from."""
from __future__ import annotations

import textwrap
from pathlib import Path

from matplotlib.lines import Line2D
from matplotlib.transforms import blended_transform_factory

from ..figstyle import FOOTER_GID, color, legend_outside, plt, save_figure
from .model_error import Cell
from .paper import OOM, PaperTable
from .quantities import QUANTITIES


def _seqlen_columns(t: PaperTable) -> list[int] | None:
    ns = [c.select.get("seqlen") for c in t.columns]
    return ns if len(ns) > 1 and all(isinstance(n, int) for n in ns) else None


def _lines(ax, t: PaperTable, cells: list[Cell], ns: list[int]) -> None:
    ncol = len(t.columns)
    for i, row in enumerate(t.rows):
        row_cells = cells[i * ncol:(i + 1) * ncol]
        c = color(row_cells[0].paper.method.method)
        paper = [(n, v) for n, v in zip(ns, row.values) if isinstance(v, (int, float))]
        ours = [(n, x.ours) for n, x in zip(ns, row_cells) if x.ours is not None]
        if paper:
            ax.plot(*zip(*paper), color=c, marker="o", linestyle="-", label=f"{row.label} (paper)")
        if ours:
            ax.plot(*zip(*ours), color=c, marker="o", markerfacecolor="none", linestyle="--",
                    label=f"{row.label} (modelled)")
        for n, v, x in zip(ns, row.values, row_cells):
            # OOM as the suite's other figures mark it: a triangle on the x axis (paper filled, model
            # hollow), each row shifted a little so marks at one length stay apart
            xo = n * 2 ** (0.05 * (i - (len(t.rows) - 1) / 2))
            for oom, face in ((v == OOM, c), (x.status == "oom", "none")):
                if oom:
                    ax.plot([xo], [0.03], marker="v", color=c, markerfacecolor=face, markersize=8, linestyle="none",
                            transform=blended_transform_factory(ax.transData, ax.transAxes), clip_on=False)
    ax.set_xscale("log", base=2)
    ax.set_xticks(ns, [c.label for c in t.columns])
    ax.minorticks_off()
    ax.set_xlabel("sequence length (tokens)")
    if QUANTITIES[t.quantity].unit == "s":
        ax.set_yscale("log")


def _bars(ax, t: PaperTable, cells: list[Cell], ci: int) -> None:
    ncol, xs = len(t.columns), range(len(t.rows))
    for i, row in enumerate(t.rows):
        x = cells[i * ncol + ci]
        c = color(x.paper.method.method)
        v = row.values[ci]
        ax.bar(i - 0.2, v if isinstance(v, (int, float)) else 0, 0.4, color=c, edgecolor="black", linewidth=0.5,
               label="paper" if i == 0 else None)
        ax.bar(i + 0.2, x.ours or 0, 0.4, color=c, alpha=0.45, hatch="//", edgecolor="black", linewidth=0.5,
               label="modelled" if i == 0 else None)
        for dx, text in ((-0.2, "OOM" if v == OOM else "—" if v is None else ""),
                         (0.2, "OOM" if x.status == "oom" else "n/a" if x.record is None else "")):
            if text:
                ax.text(i + dx, 0, text, rotation=90, fontsize=7, ha="center", va="bottom")
    # wrapped, not rotated: the rows are the paper's words (the ablation's steps) and read across
    ax.set_xticks(list(xs), [textwrap.fill(r.label, 14) for r in t.rows], fontsize=7)
    q = QUANTITIES[t.columns[ci].quantity or t.quantity]
    ax.set_ylabel(f"{q.label} ({q.unit})" if q.unit else q.label)
    ax.set_title(t.columns[ci].label, fontsize=9)


def paper_figure(t: PaperTable, cells: list[Cell], out: Path, provenance: str) -> Path:
    ns = _seqlen_columns(t)
    panels = 1 if ns else len(t.columns)
    # bar panels get room for the rows' wrapped names side by side
    width = 7.0 if ns else max(4.0, 1.25 * len(t.rows)) * panels
    fig, axs = plt.subplots(1, panels, figsize=(width, 4.6), squeeze=False)
    if ns:
        _lines(axs[0][0], t, cells, ns)
        q = QUANTITIES[t.quantity]
        axs[0][0].set_ylabel(f"{q.label} ({q.unit})")
    else:
        for ci, ax in enumerate(axs[0]):
            _bars(ax, t, cells, ci)
    for ax in axs[0]:
        ax.grid(True, axis="y", alpha=0.3)
    handles, labels = axs[0][-1].get_legend_handles_labels()
    if ns and any(v == OOM for r in t.rows for v in r.values) or any(x.status == "oom" for x in cells):
        handles.append(Line2D([], [], marker="v", color="grey", markerfacecolor="grey", linestyle="none"))
        labels.append("out of memory (filled: paper, hollow: model)")
    legend_outside(axs[0][-1], handles, labels, fontsize=7)
    fig.suptitle(f"{t.id}: {t.title}, paper vs modelled", fontsize=10)
    fig.tight_layout()
    fig.text(0.5, 0.0, provenance, ha="center", va="top", fontsize=7, color="dimgray", gid=FOOTER_GID)
    return save_figure(fig, out)
