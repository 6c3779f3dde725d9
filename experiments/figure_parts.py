"""What every figure of the suite draws besides its data: the provenance footer (machine, commit,
date, results folder, or "modelled"), OOM / failed / skipped marks on the x axis and their legend,
and the log2 sequence-length axis. Shared by ``plots`` and ``plots_model``."""
from __future__ import annotations

import textwrap

import matplotlib.transforms as mtransforms
import pandas as pd
from matplotlib.lines import Line2D

from .figstyle import color
from .harness import axes
from .harness.env import machine_slug


def source(df: pd.DataFrame) -> str:
    """'modelled' when every record comes from the performance model (experiments.perfmodel)."""
    return "modelled" if "source" in df and (df["source"] == "modelled").all() else "measured"


def hw_and_date(df: pd.DataFrame, meta: dict | None = None) -> str:
    """'measured on <machine> (<hardware>) at <commit> · <date> · <results folder>', or 'modelled ...'."""
    hw = df["hardware"].dropna()
    summary = hw.iloc[0].get("summary", "") if len(hw) else "unknown hardware"
    nodes = hw.iloc[0].get("nodes", 1) if len(hw) else 1
    date = str(df["timestamp"].max())[:10] if "timestamp" in df else ""
    extra = f", {nodes} nodes" if nodes and nodes > 1 and "node" not in summary else ""
    origin = (meta or {}).get("origin", "")
    if source(df) == "modelled":
        return f"modelled for {summary}{extra} · {date}" + (f" · {origin}" if origin else "")
    # records written before they named their machine: the slug of the hardware they recorded
    machines = sorted({str(r["machine"]) if isinstance(r.get("machine"), str) else machine_slug(r["hardware"])
                       for r in df.to_dict("records") if isinstance(r.get("hardware"), dict)}) or ["unknown machine"]
    commits = sorted({str((g or {}).get("commit") or "?")[:7] + ("+dirty" if (g or {}).get("dirty") else "")
                      for g in df["git"]}) if "git" in df else ["?"]
    return textwrap.fill(f"measured on {', '.join(machines)} ({summary}{extra}) at {', '.join(commits)} · {date}"
                         + (f" · {origin}" if origin else ""), 100) + cluster_note(df)


def cluster_note(df: pd.DataFrame) -> str:
    """Emulated cluster (profile, link rates) or its loopback fallback, as the records say."""
    if "cluster" not in df:
        return ""
    infos = [c for c in df["cluster"].dropna() if isinstance(c, dict) and c.get("scheduler") == "emulated"]
    return "\n" + textwrap.fill(infos[0].get("summary", ""), 95) if infos else ""


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


def status_legend(ax, df: pd.DataFrame) -> None:
    handles, labels = ax.get_legend_handles_labels()
    if (df["status"] == "oom").any():
        handles.append(Line2D([], [], marker="v", color="tab:orange", linestyle="none"))
        labels.append("out of memory (OOM)")
    if (df["status"] == "failed").any():
        handles.append(Line2D([], [], marker="X", color="tab:red", linestyle="none"))
        labels.append("failed (see results reason)")
    if (df["status"] == "skipped").any():
        handles.append(Line2D([], [], marker="s", color="dimgray", linestyle="none"))
        labels.append("skipped: cannot run here (reason below)")
    ax.legend(handles, labels, fontsize=8, loc="best")


def log2_x(ax, values) -> None:
    vals = sorted(set(int(v) for v in values))
    if len(vals) > 1 and vals[-1] / max(vals[0], 1) >= 4:
        ax.set_xscale("log", base=2)
    ax.set_xticks(vals)
    ax.set_xticklabels([axes.human(v) for v in vals], rotation=0, fontsize=8)
    ax.minorticks_off()
