"""Figures from results files only (never runs anything).

    python -m experiments.plots                    # every experiment under results/
    python -m experiments.plots cpu_fig2_train --results results --out plots

For each experiment ``plots/<experiment>/`` gets, where the sweep has the axis:
speedup over the spec's baseline vs sequence length, time vs sequence length,
TFLOP/s per rank vs sequence length, peak memory per rank vs sequence length,
communication volume per method (measured next to the formula, forward and
backward), time vs world size (scaling) and throughput vs batch. Every figure
states the hardware and the date in its title; OOM and failed cases are
marked on the x axis. All numbers are measurements; the only formula drawn is
the communication formula, beside the measured bytes and labelled as such.
Records of the performance model (``"source": "modelled"``, experiments.perfmodel)
are drawn by the same code, with "modelled" in every title and file name.
"""
from __future__ import annotations

import argparse
import math
import textwrap
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import matplotlib.transforms as mtransforms  # noqa: E402
import pandas as pd  # noqa: E402
import yaml  # noqa: E402

from .harness import axes, results as R  # noqa: E402
from baselines.registry import METHODS  # noqa: E402

MODE_LABEL = {"forward": "forward", "backward": "backward", "fwd_bwd": "forward+backward"}
FACET_AXES = ("mode", *axes.NEST_ORDER)   # panels split by every one of these that varies
_PALETTE = plt.get_cmap("tab10").colors


def color(method: str) -> tuple:
    # registry order: a method keeps its colour in every figure and every run
    return _PALETTE[_method_order(method) % len(_PALETTE)]


def _spec_meta(results_root: Path, exp: str) -> dict:
    p = R.experiment_dir(results_root, exp) / "spec.resolved.yaml"
    return yaml.safe_load(p.read_text()) if p.exists() else {}


def _source(df: pd.DataFrame) -> str:
    """'modelled' when every record comes from the performance model (experiments.perfmodel)."""
    return "modelled" if "source" in df and (df["source"] == "modelled").all() else "measured"


def _hw_and_date(df: pd.DataFrame) -> str:
    hw = df["hardware"].dropna()
    summary = hw.iloc[0].get("summary", "") if len(hw) else "unknown hardware"
    nodes = hw.iloc[0].get("nodes", 1) if len(hw) else 1
    date = str(df["timestamp"].max())[:10] if "timestamp" in df else ""
    extra = f", {nodes} nodes" if nodes and nodes > 1 and "node" not in summary else ""
    return f"{summary}{extra} · {_source(df)} {date}{_cluster_note(df)}"


def _cluster_note(df: pd.DataFrame) -> str:
    """Emulated cluster (profile, link rates) or its loopback fallback, as the records say."""
    if "cluster" not in df:
        return ""
    infos = [c for c in df["cluster"].dropna() if isinstance(c, dict) and c.get("scheduler") == "emulated"]
    return "\n" + textwrap.fill(infos[0].get("summary", ""), 95) if infos else ""


def _facets(df: pd.DataFrame, x: str) -> list[tuple[str, pd.DataFrame]]:
    """Split by every axis that varies except ``x`` and method; a label for each part."""
    varying = [a for a in FACET_AXES if a != x and a in df and df[a].nunique() > 1]
    if not varying:
        return [(_fixed_label(df, x), df)]
    out = []
    for key, part in df.groupby(varying, sort=True):
        key = key if isinstance(key, tuple) else (key,)
        out.append((", ".join(f"{a}={v}" for a, v in zip(varying, key)) + "\n" + _fixed_label(part, x), part))
    return out


def _fixed_label(df: pd.DataFrame, x: str) -> str:
    """What every line of a panel shares: mode, level and the case-name label of each fixed axis."""
    r = df.iloc[0]
    bits = [MODE_LABEL.get(r["mode"], r["mode"]), f"{r['level']}-level"]
    bits += [axes.label(a, r[a]) for a in axes.ID_ORDER if a != x and a in df and df[a].nunique() == 1]
    return ", ".join(b for b in bits if b)


def _mark_bad(ax, part: pd.DataFrame, x: str, method: str) -> None:
    """OOM / failed cases as markers on the x axis, so a missing point is visibly missing."""
    trans = mtransforms.blended_transform_factory(ax.transData, ax.transAxes)
    for status, marker, col, text in (("oom", "v", "tab:orange", "OOM"), ("failed", "X", "tab:red", "fail")):
        bad = part[(part["method"] == method) & (part["status"] == status)]
        for xv in bad[x]:
            ax.plot([xv], [0.03], marker=marker, color=col, markersize=9, transform=trans, clip_on=False,
                    markeredgecolor=color(method), markeredgewidth=1.5, linestyle="none")
            ax.annotate(f"{method} {text}", (xv, 0.03), xycoords=trans, textcoords="offset points",
                        xytext=(4, 6), fontsize=7, color=col, rotation=30)


def _status_legend(ax, df: pd.DataFrame) -> None:
    from matplotlib.lines import Line2D

    handles, labels = ax.get_legend_handles_labels()
    if (df["status"] == "oom").any():
        handles.append(Line2D([], [], marker="v", color="tab:orange", linestyle="none"))
        labels.append("out of memory (OOM)")
    if (df["status"] == "failed").any():
        handles.append(Line2D([], [], marker="X", color="tab:red", linestyle="none"))
        labels.append("failed (see results reason)")
    ax.legend(handles, labels, fontsize=8, loc="best")


def _log2_x(ax, values) -> None:
    vals = sorted(set(int(v) for v in values))
    if len(vals) > 1 and vals[-1] / max(vals[0], 1) >= 4:
        ax.set_xscale("log", base=2)
    ax.set_xticks(vals)
    ax.set_xticklabels([_human(v) for v in vals], rotation=0, fontsize=8)
    ax.minorticks_off()


def _human(v: int) -> str:
    if v >= 1 << 20 and v % (1 << 20) == 0:
        return f"{v >> 20}M"
    if v >= 1024 and v % 1024 == 0:
        return f"{v >> 10}K"
    return str(v)


def _line_figure(df: pd.DataFrame, x: str, ycol: str, ylabel: str, title: str, meta: dict, out: Path, *,
                 logy: bool, transform=None, ref_line: float | None = None, errbars: bool = False,
                 methods: list[str] | None = None) -> Path | None:
    facets = _facets(df, x)
    if not facets:
        return None
    fig, axes = plt.subplots(1, len(facets), figsize=(max(7.5, 6.2 * len(facets)), 5.0), squeeze=False)
    drew = False
    for ax, (label, part) in zip(axes[0], facets):
        for method in methods or sorted(part["method"].unique(), key=_method_order):
            ok = part[(part["method"] == method) & (part["status"] == "ok")].sort_values(x)
            if transform is not None:
                ok = transform(ok, part, method)
            ok = ok[ok[ycol].notna()] if ycol in ok else ok.iloc[0:0]
            if len(ok):
                drew = True
                if errbars and "time_p10_s" in ok:
                    yerr = [ok[ycol] - ok["time_p10_s"], ok["time_p90_s"] - ok[ycol]]
                    ax.errorbar(ok[x], ok[ycol], yerr=yerr, marker="o", label=method, color=color(method),
                                capsize=3)
                else:
                    ax.plot(ok[x], ok[ycol], marker="o", label=method, color=color(method))
            _mark_bad(ax, part, x, method)
        if ref_line is not None:
            ax.axhline(ref_line, color="grey", linestyle="--", linewidth=1)
        _log2_x(ax, part[x])
        if logy:
            ax.set_yscale("log")
        ax.set_xlabel({"seqlen": "sequence length N (tokens)", "world_size": "world size G (processes)",
                       "batch": "batch size B"}[x])
        ax.set_ylabel(ylabel)
        ax.set_title(label, fontsize=8)
        ax.grid(True, which="both", alpha=0.3)
        _status_legend(ax, part)
    if not drew and not (df["status"].isin(["oom", "failed"])).any():
        plt.close(fig)
        return None
    ref = f"\n{meta['paper_ref']}" if meta.get("paper_ref") else ""
    fig.suptitle(f"{df['experiment'].iloc[0]}: {title}{ref}\n{_hw_and_date(df)}", fontsize=10)
    fig.tight_layout()
    if meta.get("skipped_note"):
        fig.subplots_adjust(bottom=0.16)
        fig.text(0.5, 0.01, meta["skipped_note"], ha="center", va="bottom", fontsize=8, color="dimgray")
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def _method_order(m: str) -> int:
    order = list(METHODS)
    return order.index(m) if m in order else len(order)


def _speedup(baseline: str):
    def f(ok: pd.DataFrame, part: pd.DataFrame, method: str) -> pd.DataFrame:
        base = part[(part["method"] == baseline) & (part["status"] == "ok")].set_index("seqlen")["time_median_s"]
        ok = ok.copy()
        ok["speedup"] = [base.get(n, math.nan) / t for n, t in zip(ok["seqlen"], ok["time_median_s"])]
        return ok
    return f


def comm_figure(df: pd.DataFrame, meta: dict, out: Path) -> Path | None:
    ok = df[(df["status"] == "ok") & df.get("comm_fwd_bytes", pd.Series(dtype=float)).notna()] \
        if "comm_fwd_bytes" in df else df.iloc[0:0]
    if ok.empty:
        return None
    # One representative shape: the largest sequence length that most methods finished.
    per_n = ok.groupby("seqlen")["method"].nunique()
    n = max(s for s, c in per_n.items() if c == per_n.max())
    sel = ok[ok["seqlen"] == n]
    g = sel["world_size"].max()
    sel = sel[sel["world_size"] == g]
    mode = "fwd_bwd" if (sel["mode"] == "fwd_bwd").any() else sel["mode"].iloc[0]
    sel = sel[sel["mode"] == mode].drop_duplicates("method")
    sel = sel.set_index("method").loc[sorted(sel["method"], key=_method_order)]
    fig, ax = plt.subplots(figsize=(max(6.5, 1.3 * len(sel) + 2), 4.8))
    width = 0.2
    xs = range(len(sel))
    word = _source(df)
    series = [("comm_fwd_bytes", f"forward, {word}", "", 0), ("comm_fwd_formula_bytes", "forward, formula", "//", 1),
              ("comm_bwd_bytes", f"backward, {word}", "", 2), ("comm_bwd_formula_bytes", "backward, formula", "//", 3)]
    for col, label, hatch, k in series:
        if col not in sel or sel[col].isna().all():
            continue
        vals = [v / 2 ** 20 if v == v and v is not None else 0 for v in sel[col]]
        ax.bar([x + (k - 1.5) * width for x in xs], vals, width, label=label, hatch=hatch,
               color=("tab:blue" if "forward" in label else "tab:purple"), alpha=1.0 if not hatch else 0.45,
               edgecolor="black", linewidth=0.5)
    ax.set_xticks(list(xs))
    ax.set_xticklabels(list(sel.index), rotation=20)
    ax.set_ylabel("MiB sent per rank (max over ranks)")
    vals = sel[[c for c, *_ in series if c in sel]].fillna(0).values
    pos = vals[vals > 0]
    if pos.size and pos.max() / pos.min() > 30:  # log only where the range needs it
        ax.set_yscale("log")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    r = sel.reset_index().iloc[0]
    ref = f" ({meta['paper_ref']})" if meta.get("paper_ref") else ""
    ax.set_title(f"{df['experiment'].iloc[0]}{ref}\ncommunication per layer, {word} (solid) vs formula (hatched)\n"
                 f"{', '.join(axes.label(a, r[a]) for a in axes.ID_ORDER)}, {MODE_LABEL[mode]}\n"
                 f"{_hw_and_date(df)}", fontsize=9)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def draw_experiment(results_root: Path, plots_root: Path, exp: str) -> list[Path]:
    df = R.load_results(results_root, exp)
    if df.empty:
        return []
    skipped = df[df["status"] == "skipped"]
    df = df[df["status"] != "skipped"]
    if df.empty:
        return []
    meta = dict(_spec_meta(results_root, exp))
    if len(skipped):
        # methods that could not run on this machine are named, not silently absent
        reasons = skipped.drop_duplicates("method").set_index("method")["reason"].fillna("")
        meta["skipped_note"] = "not run: " + "; ".join(str(r) or m for m, r in reasons.items())
    out = plots_root / exp
    if "level" in df and (df["level"] == "model").all():
        from .plots_model import draw_model_experiment   # model-level records: their own figures and table

        return draw_model_experiment(df, meta, out)
    sfx = "_modelled" if _source(df) == "modelled" else ""   # a modelled figure says so in its file name
    files: list[Path] = []
    methods = sorted(df["method"].unique(), key=_method_order)
    baseline = meta.get("baseline") or (methods[0] if methods else None)
    if df["seqlen"].nunique() > 1:
        if baseline in set(df["method"]):
            files.append(_line_figure(df, "seqlen", "speedup", f"speedup over {baseline} (x)",
                                      f"speedup over {baseline} vs sequence length", meta,
                                      out / f"speedup_vs_seqlen{sfx}.png", logy=False, transform=_speedup(baseline),
                                      ref_line=1.0))
        files.append(_line_figure(df, "seqlen", "time_median_s", "time per step (s, median; bars p10-p90)",
                                  "time vs sequence length", meta, out / f"time_vs_seqlen{sfx}.png", logy=True,
                                  errbars=True))
        files.append(_line_figure(df, "seqlen", "tflops_per_rank", "TFLOP/s per rank",
                                  "attention throughput (FLOPs of PAPER.md convention)", meta,
                                  out / f"tflops_vs_seqlen{sfx}.png", logy=False))
        if "mem_peak_bytes" in df:
            dfm = df.assign(mem_peak_mib=df["mem_peak_bytes"] / 2 ** 20)
            files.append(_line_figure(dfm, "seqlen", "mem_peak_mib", f"peak memory per rank above inputs (MiB, {_source(df)})",
                                      "peak memory per rank vs sequence length", meta,
                                      out / f"memory_vs_seqlen{sfx}.png", logy=True))
    if df["world_size"].nunique() > 1:
        files.append(_line_figure(df, "world_size", "time_median_s", "time per step (s, median; bars p10-p90)",
                                  "scaling with world size", meta, out / f"scaling_world_size{sfx}.png", logy=True,
                                  errbars=True))
    if df["batch"].nunique() > 1:
        files.append(_line_figure(df, "batch", "tokens_per_s", "tokens/s", "throughput vs batch size", meta,
                                  out / f"throughput_vs_batch{sfx}.png", logy=False))
    files.append(comm_figure(df, meta, out / f"comm_volume{sfx}.png"))
    return [f for f in files if f is not None]


def draw_all(results_root: Path, plots_root: Path, experiments: list[str] | None = None) -> list[Path]:
    results_root, plots_root = Path(results_root), Path(plots_root)
    if experiments is None:
        experiments = sorted(p.name for p in results_root.iterdir()
                             if p.is_dir() and (p / R.RESULTS_FILE).exists()) if results_root.exists() else []
    files: list[Path] = []
    for exp in experiments:
        if (R.experiment_dir(results_root, exp) / R.RESULTS_FILE).exists():
            files.extend(draw_experiment(results_root, plots_root, exp))
    return files


def main(argv: list[str] | None = None) -> int:
    from .harness.env import REPO

    ap = argparse.ArgumentParser(prog="python -m experiments.plots", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("experiments", nargs="*", help="experiment names (default: all under --results)")
    ap.add_argument("--results", default=str(REPO / "results"))
    ap.add_argument("--out", default=str(REPO / "plots"))
    args = ap.parse_args(argv)
    files = draw_all(Path(args.results), Path(args.out), args.experiments or None)
    for f in files:
        print(f)
    print(f"{len(files)} figure(s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
