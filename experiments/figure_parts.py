"""What every figure of the suite draws besides its data: the provenance footer (machine, commit,
date, results folder, or "modelled"; one line), OOM / failed / skipped marks on the x axis and their
legend (outside the axes), and the log2 sequence-length axis. Shared by ``plots`` and ``plots_model``."""
from __future__ import annotations

from pathlib import Path

import matplotlib.transforms as mtransforms
import pandas as pd
from matplotlib.lines import Line2D

from .figstyle import FOOTER_GID, color, legend_outside
from .harness import axes
from .harness.env import machine_slug


def source(df: pd.DataFrame) -> str:
    """'modelled' when every record comes from the performance model (experiments.perfmodel)."""
    return "modelled" if "source" in df and (df["source"] == "modelled").all() else "measured"




def _origin(meta: dict | None) -> str:
    """The results folder, relative: a folder outside the repository (a test's temp dir) by its last part."""
    origin = str((meta or {}).get("origin", ""))
    return origin if not origin.startswith("/") else ".../" + Path(origin).name


def provenance(df: pd.DataFrame, meta: dict | None = None) -> str:
    """One line: 'measured on <machine> (<hardware>[, emulated <profile>]) · <commit> · <date> · <results
    folder>', or 'modelled for <hardware profile> ...'."""
    hw = df["hardware"].dropna() if "hardware" in df else pd.Series(dtype=object)
    summary = hw.iloc[0].get("summary", "") if len(hw) else "unknown hardware"
    nodes = hw.iloc[0].get("nodes", 1) if len(hw) else 1
    date = str(df["timestamp"].max())[:10] if "timestamp" in df else ""
    extra = f", {nodes} nodes" if nodes and nodes > 1 and "node" not in summary else ""
    commits = sorted({str((g or {}).get("commit") or "?")[:7] + ("+dirty" if (g or {}).get("dirty") else "")
                      for g in df["git"]}) if "git" in df else ["?"]
    tail = " · ".join(x for x in (", ".join(commits), date, _origin(meta)) if x)
    if source(df) == "modelled":
        return f"modelled for {summary.replace('MODELLED: ', '')}{extra} · {tail}"
    # records written before they named their machine: the slug of the hardware they recorded
    machines = sorted({str(r["machine"]) if isinstance(r.get("machine"), str) else machine_slug(r["hardware"])
                       for r in df.to_dict("records") if isinstance(r.get("hardware"), dict)}) or ["unknown machine"]
    return f"measured on {', '.join(machines)} ({summary}{extra}{cluster_note(df)}) · {tail}"


hw_and_date = provenance        # the old name


def cluster_note(df: pd.DataFrame) -> str:
    """', emulated <profile>' where the records ran on the emulated cluster (its rates: the records')."""
    if "cluster" not in df:
        return ""
    infos = [c for c in df["cluster"].dropna() if isinstance(c, dict) and c.get("scheduler") == "emulated"]
    if not infos:
        return ""
    # where namespaces were not permitted the "emulated" profile ran on plain loopback: said so
    c = infos[0]
    return f", emulated cluster {c.get('profile')}" if c.get("emulated", True) else \
        f", {c.get('profile')} not emulated (plain loopback)"


def footer(fig, df: pd.DataFrame, meta: dict | None = None) -> None:
    """The provenance as the figure's one footer line, below everything else (saving keeps it in the frame)."""
    fig.text(0.5, 0.0, provenance(df, meta), ha="center", va="top", fontsize=7, color="dimgray", gid=FOOTER_GID)


_BAD = (("oom", "v", "tab:orange", "OOM"), ("failed", "X", "tab:red", "fail"), ("skipped", "s", "dimgray", "skip"))


def mark_bad(ax, part: pd.DataFrame, x: str, method: str) -> None:
    """OOM / failed / skipped cases as markers on the x axis, so a missing point is visibly missing."""
    trans = mtransforms.blended_transform_factory(ax.transData, ax.transAxes)
    for status, marker, col, text in _BAD:
        bad = part[(part["method"] == method) & (part["status"] == status)]
        for xv in bad[x]:
            ax.plot([xv], [0.03], marker=marker, color=col, markersize=9, transform=trans, clip_on=False,
                    markeredgecolor=color(method), markeredgewidth=1.5, linestyle="none")
            ax.annotate(f"{method} {text}", (xv, 0.03), xycoords=trans, textcoords="offset points",
                        xytext=(4, 6), fontsize=7, color=col, rotation=30)


def status_legend(ax, df: pd.DataFrame, axes_from=()) -> None:
    """The methods' legend with the OOM / failed / skipped marks, outside the axes (right), gathering
    the lines of ``axes_from`` too so a row of panels has one legend."""
    handles, labels = ax.get_legend_handles_labels()
    for other in axes_from:
        for h, lab in zip(*other.get_legend_handles_labels()):
            if lab not in labels:
                handles.append(h)
                labels.append(lab)
    if (df["status"] == "oom").any():
        handles.append(Line2D([], [], marker="v", color="tab:orange", linestyle="none"))
        labels.append("out of memory (OOM)")
    if (df["status"] == "failed").any():
        handles.append(Line2D([], [], marker="X", color="tab:red", linestyle="none"))
        labels.append("failed (see results reason)")
    if (df["status"] == "skipped").any():
        handles.append(Line2D([], [], marker="s", color="dimgray", linestyle="none"))
        labels.append("skipped: cannot run here (reason below)")
    legend_outside(ax, handles, labels)


def log2_x(ax, values, names: dict | None = None) -> None:
    """A log2 axis where the values span 4x or more, ticked at the values (``names``: a tick's own text)."""
    vals = sorted(set(int(v) for v in values))
    if len(vals) > 1 and vals[-1] / max(vals[0], 1) >= 4:
        ax.set_xscale("log", base=2)
    ax.set_xticks(vals)
    ax.set_xticklabels([(names or {}).get(v, axes.human(v)) for v in vals], rotation=0, fontsize=8)
    ax.minorticks_off()
