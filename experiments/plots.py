"""Figures from results files only (never runs anything).

    python -m experiments.plots                    # every experiment under results/
    python -m experiments.plots cpu_fig2_train --results results --out plots

For each experiment ``plots/<experiment>/`` gets, where the sweep has the axis:
speedup over the spec's baseline vs sequence length, time vs sequence length,
TFLOP/s per rank vs sequence length, peak memory per rank vs sequence length,
communication volume per method (measured next to the formula, forward and
backward), time vs world size (scaling) and throughput vs batch. Every figure
says in its title what it was measured on (machine, commit, results folder) or
"modelled"; OOM, failed and skipped cases are marked on the x axis. Times are
drawn with the 95% interval of the median (records without one: p10-p90, said
so in the axis label), speedups with their bootstrap interval; methods differ
by marker and line style so identical lines stay visible. Bytes that an adapter
records from a formula (``bytes_source: formula``) are hatched, not solid.
Where the masks vary (``mask`` axis): time, TFLOP/s per rank and the work
balance of each layout per mask (grouped bars, ``masks_*.png``). All numbers
are measurements; the only formula drawn is
the communication formula, beside the measured bytes and labelled as such.
Records of the performance model (``"source": "modelled"``, experiments.perfmodel)
are drawn by the same code, with "modelled" in every title and file name.
"""
from __future__ import annotations

import argparse
import math
import textwrap
from pathlib import Path

import pandas as pd
import yaml

from baselines.registry import METHODS

from .cli import prog, run_cli
from .figstyle import _SERIES_COLOURS, _method_order, legend_outside, save_figure, style  # first: it selects Agg
import matplotlib.pyplot as plt  # after figstyle: it chose the backend
from matplotlib.patches import Patch
from .figure_parts import footer, log2_x, mark_bad, source, status_legend
from .harness import axes
from .harness import results as R
from .plots_model import draw_model_experiment
from burst_impl.flops import case_flops
from .harness.env import REPO, repo_relative
from .harness.speedup import speedup

MODE_LABEL = {"forward": "forward", "backward": "backward", "fwd_bwd": "forward+backward",
              # inference records (experiments/harness/inference_cases.py INFERENCE_MODES)
              "ttft": "prefill to the first token", "decode": "decode step", "kv_capacity": "KV capacity"}
FACET_AXES = ("mode", *axes.NEST_ORDER)   # panels split by every one of these that varies


def _offset(xs, k: int, n: int):
    """x positions shifted by a few percent per method (log axes), so coincident points and their
    interval bars do not hide each other; the figure's note says so."""
    return [x * 2 ** (0.035 * (k - (n - 1) / 2)) for x in xs]


def _spec_meta(results_root: Path, exp: str) -> dict:
    p = R.experiment_dir(results_root, exp) / "spec.resolved.yaml"
    return yaml.safe_load(p.read_text()) if p.exists() else {}


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


def _line_figure(df: pd.DataFrame, x: str, ycol: str, ylabel: str, title: str, meta: dict, out: Path, *,
                 logy: bool, transform=None, ref_line: float | None = None, errbars: bool = False,
                 methods: list[str] | None = None) -> Path | None:
    facets = _facets(df, x)
    if not facets:
        return None
    fig, axes = plt.subplots(1, len(facets), figsize=(max(7.5, 6.2 * len(facets)), 5.0), squeeze=False)
    drew = False
    for ax, (label, part) in zip(axes[0], facets):
        order = methods or sorted(part["method"].unique(), key=_method_order)
        for k, method in enumerate(order):
            ok = part[(part["method"] == method) & (part["status"] == "ok")].sort_values(x)
            if transform is not None:
                ok = transform(ok, part, method)
            ok = ok[ok[ycol].notna()] if ycol in ok else ok.iloc[0:0]
            if len(ok):
                drew = True
                xs = _offset(list(ok[x]), k, len(order))
                lo, hi = _interval(ok, ycol) if errbars else (None, None)
                if lo is not None:
                    yerr = [(ok[ycol] - lo).clip(lower=0), (hi - ok[ycol]).clip(lower=0)]
                    ax.errorbar(xs, ok[ycol], yerr=yerr, label=method, capsize=3, **style(method))
                else:
                    ax.plot(xs, ok[ycol], label=method, **style(method))
            mark_bad(ax, part, x, method)
        if ref_line is not None:
            ax.axhline(ref_line, color="grey", linestyle="--", linewidth=1)
        log2_x(ax, part[x])
        if logy:
            ax.set_yscale("log")
        ax.set_xlabel({"seqlen": "sequence length N (tokens)", "world_size": "world size G (processes)",
                       "batch": "batch size B"}[x])
        ax.set_ylabel(ylabel)
        ax.set_title(label, fontsize=8)
        ax.grid(True, which="both", alpha=0.3)
    # one legend for the row of panels, right of the last one: never over the data
    status_legend(axes[0][-1], df, axes_from=list(axes[0][:-1]))
    if not drew and not (df["status"].isin(["oom", "failed", "skipped"])).any():
        plt.close(fig)
        return None
    ref = f"\n{meta['paper_ref']}" if meta.get("paper_ref") else ""
    fig.suptitle(f"{df['experiment'].iloc[0]}: {title}{ref}", fontsize=10)
    fig.tight_layout()
    note = "; ".join(n for n in (meta.get("skipped_note"), "points offset horizontally by a few % per method "
                                 "so equal values stay visible") if n)
    fig.subplots_adjust(bottom=0.18)
    fig.text(0.5, 0.01, textwrap.fill(note, int(fig.get_figwidth() * 17)), ha="center", va="bottom", fontsize=7,
             color="dimgray")
    footer(fig, df, meta)
    return save_figure(fig, out)


def _interval(ok: pd.DataFrame, ycol: str):
    """(lo, hi) columns of the interval drawn around ``ycol``: the median's 95% interval for times,
    the bootstrap interval for speedups; p10-p90 for records that have no interval (fewer than 6
    samples, or written before intervals were recorded); (None, None) when there is nothing."""
    if ycol == "speedup" and "speedup_lo" in ok and ok["speedup_lo"].notna().any():
        return ok["speedup_lo"], ok["speedup_hi"]      # an exact (modelled) speedup has none: a plain line
    if ycol == "time_median_s":
        if "time_ci_lo_s" in ok and ok["time_ci_lo_s"].notna().all():
            return ok["time_ci_lo_s"].astype(float), ok["time_ci_hi_s"].astype(float)
        if "time_p10_s" in ok:
            return ok["time_p10_s"], ok["time_p90_s"]
    return None, None


def _time_label(df: pd.DataFrame) -> str:
    ok = df[df["status"] == "ok"]
    full = "time_ci_lo_s" in ok and len(ok) and ok["time_ci_lo_s"].notna().all()
    return "time per step (s, median)\nbars: " + ("95% interval of the median" if full else
                                                  "95% interval of median (p10-p90 if n < 6)")


def _speedup(baseline: str):
    def f(ok: pd.DataFrame, part: pd.DataFrame, method: str) -> pd.DataFrame:
        keyed = part[(part["method"] == baseline) & (part["status"] == "ok")].set_index("seqlen")
        ok = ok.copy()
        rows = [(speedup(r.to_dict(), keyed.loc[n].to_dict()) if n in keyed.index else None)
                for n, (_, r) in zip(ok["seqlen"], ok.iterrows())]
        for col, field in (("speedup", "value"), ("speedup_lo", "lo"), ("speedup_hi", "hi")):
            # no value or no interval (None): NaN, which draws nothing
            ok[col] = [math.nan if r is None or getattr(r, field) is None else getattr(r, field) for r in rows]
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
    word = source(df)
    series = [("comm_fwd_bytes", f"forward, {word}", "", 0), ("comm_fwd_formula_bytes", "forward, formula", "//", 1),
              ("comm_bwd_bytes", f"backward, {word}", "", 2), ("comm_bwd_formula_bytes", "backward, formula", "//", 3)]
    if mode == "forward":   # nothing was sent backward: no backward bars, not even formula ones
        series = series[:2]
    # records written before bytes_source existed: the method's registry entry says
    registry = pd.Series([bool(METHODS[m].bytes_by_formula) if m in METHODS else False for m in sel.index],
                         index=sel.index)
    by_formula = (sel["bytes_source"].fillna("").map({"formula": True, "counted": False}).fillna(registry)
                  .astype(bool) if "bytes_source" in sel else registry)
    for col, label, hatch, k in series:
        if col not in sel or sel[col].isna().all():
            continue
        vals = [v / 2 ** 20 if v == v and v is not None else 0 for v in sel[col]]
        # "measured" bars of adapters that record bytes from a formula (bytes_source) are hatched "xx"
        hatches = [("xx" if (not hatch and f) else hatch) for f in by_formula]
        bars = ax.bar([x + (k - 1.5) * width for x in xs], vals, width, label=label,
                      color=("tab:blue" if "forward" in label else "tab:purple"), alpha=1.0 if not hatch else 0.45,
                      edgecolor="black", linewidth=0.5)
        for b, h in zip(bars, hatches):
            b.set_hatch(h)
    if by_formula.any():
        ax.add_artist(ax.legend(handles=[Patch(facecolor="white", edgecolor="black", hatch="xx",
                                               label="recorded from a formula by the adapter\n(not counted): "
                                                     + ", ".join(sel.index[by_formula]))],
                                fontsize=7, loc="lower left", bbox_to_anchor=(1.02, 0.0), borderaxespad=0.0))
    ax.set_xticks(list(xs))
    ax.set_xticklabels(list(sel.index), rotation=20)
    ax.set_ylabel("MiB sent per rank (max over ranks)")
    vals = sel[[c for c, *_ in series if c in sel]].fillna(0).values
    pos = vals[vals > 0]
    if pos.size and pos.max() / pos.min() > 30:  # log only where the range needs it
        ax.set_yscale("log")
    ax.grid(True, axis="y", alpha=0.3)
    legend_outside(ax)
    r = sel.reset_index().iloc[0]
    ids = ", ".join(x for x in (axes.label(a, r[a]) for a in axes.ID_ORDER) if x)
    ax.set_title(f"{df['experiment'].iloc[0]}: bytes per rank, {word} (solid) vs formula (hatched)\n"
                 f"{ids}, {MODE_LABEL.get(mode, mode)}", fontsize=9)
    fig.tight_layout()
    footer(fig, df, meta)
    return save_figure(fig, out)


def _mask_name(r) -> str:
    """The mask spec, with " full" where a mask is not intersected with causal (varlen-full: "docs:... full")."""
    if isinstance(r.get("mask"), str) and r["mask"]:
        return r["mask"] + ("" if r["causal"] else " full")
    return "causal" if r["causal"] else "full"


def mask_figure(df: pd.DataFrame, ycol: str, ylabel: str, title: str, meta: dict, out: Path, *,
                per_method: bool = True, second: str | None = None, errbars: bool = False) -> Path | None:
    """Grouped bars: x = mask, one bar per layout; one panel per (world size, method), or per world
    size when the quantity is the layout's (``per_method=False``: the work balance). ``second``: a
    column drawn hatched beside ``ycol`` (the column work next to the row work); ``errbars``: the
    p10-p90 interval of the time samples as whiskers."""
    ok = df[(df["status"] == "ok") & df[ycol].notna()] if ycol in df else df.iloc[0:0]
    if ok.empty:
        return None
    ok = ok.assign(mask_name=[_mask_name(r) for _, r in ok.iterrows()])
    if not per_method:
        ok = ok.drop_duplicates(["world_size", "mask_name", "layout"])
    keys = sorted({(g, m if per_method else "") for g, m in zip(ok["world_size"], ok["method"])},
                  key=lambda k: (k[0], _method_order(k[1])))
    masks_ = list(dict.fromkeys(_mask_name(r) for _, r in df.iterrows()))
    layouts = list(dict.fromkeys(df["layout"]))
    # one row of panels per world size, one column per method (a spec with many methods stays readable)
    gs, ms = sorted({k[0] for k in keys}), list(dict.fromkeys(k[1] for k in keys))
    fig, axs = plt.subplots(len(gs), len(ms), figsize=(max(7.0, max(3.0, 0.3 * len(masks_) * len(layouts)) * len(ms)),
                                                        4.8 * len(gs)), squeeze=False)
    for ax in axs.flat:
        ax.set_visible(False)
    width = 0.8 / (len(layouts) * (2 if second else 1))
    for (g, method) in keys:
        ax = axs[gs.index(g)][ms.index(method)]
        ax.set_visible(True)
        part = ok[(ok["world_size"] == g) & ((ok["method"] == method) if per_method else True)]
        for li, lay in enumerate(layouts):
            for si, col in enumerate([ycol] + ([second] if second else [])):
                sel = [part[(part["mask_name"] == m) & (part["layout"] == lay)] for m in masks_]
                ys = [float(v[col].iloc[0]) if len(v) else 0.0 for v in sel]
                yerr = None
                if errbars and "time_p10_s" in part:
                    yerr = [[y - float(v["time_p10_s"].iloc[0]) if len(v) else 0.0 for y, v in zip(ys, sel)],
                            [float(v["time_p90_s"].iloc[0]) - y if len(v) else 0.0 for y, v in zip(ys, sel)]]
                xs = [i + (li * (2 if second else 1) + si) * width - 0.4 + width / 2 for i in range(len(masks_))]
                ax.bar(xs, ys, width, color=_SERIES_COLOURS[li % len(_SERIES_COLOURS)], hatch="//" if si else "",
                       alpha=0.5 if si else 1.0, edgecolor="black", linewidth=0.4, yerr=yerr, capsize=2,
                       label=f"{lay}" + (" (columns)" if si else (" (rows)" if second else "")))
        ax.set_xticks(range(len(masks_)))
        ax.set_xticklabels(masks_, rotation=15, fontsize=8)
        ax.set_ylabel(ylabel)
        ns = sorted(set(part["seqlen"]))      # a spec growing N with G (tokens per rank fixed) says which N
        ax.set_title(f"G={g}" + (f", N={axes.human(int(ns[0]))}" if len(ns) == 1 and ok["seqlen"].nunique() > 1
                                 else "") + (f", {method}" if method else ""), fontsize=9)
        ax.grid(True, axis="y", alpha=0.3)
        if not per_method:
            ax.axhline(1.0, color="grey", linestyle="--", linewidth=1)
    # the layouts are the same in every panel: one legend, on the first row's last drawn panel
    legend_outside(next(ax for ax in reversed(axs[0]) if ax.get_visible()), fontsize=7)
    r = ok.iloc[0]
    fixed = ", ".join(axes.label(a, r[a]) for a in ("seqlen", "batch", "heads", "kv_heads", "head_dim", "dtype")
                      if a != "seqlen" or ok["seqlen"].nunique() == 1)
    fig.suptitle(f"{df['experiment'].iloc[0]}: {title}\n{fixed}, {MODE_LABEL.get(r['mode'], r['mode'])}", fontsize=9)
    fig.tight_layout()
    footer(fig, df, meta)
    return save_figure(fig, out)


# The statuses a figure shows: a time, or an out-of-memory mark (figure_parts); failed and skipped cases are
# named in the footer only.
DRAWN = ("ok", "oom")


def _nothing_to_draw(df: pd.DataFrame, exp: str) -> bool:
    """No case ran to draw (every one failed or was skipped): said, instead of failing on an empty axis."""
    if df["status"].isin(DRAWN).any():
        return False
    print(f"{exp}: no figure: none of its {len(df)} case(s) is ok (their records say why)")
    return True


def draw_experiment(results_root: Path, plots_root: Path, exp: str) -> list[Path]:
    df = R.load_results(results_root, exp)
    if df.empty:
        return []
    skipped = df[df["status"] == "skipped"]
    if _nothing_to_draw(df, exp):
        return []
    meta = dict(_spec_meta(results_root, exp))
    meta["origin"] = _origin(results_root)
    if len(skipped):
        # methods that could not run on this machine are named, not silently absent
        reasons = skipped.drop_duplicates("method").set_index("method")["reason"].fillna("")
        meta["skipped_note"] = "not run: " + "; ".join(str(r) or m for m, r in reasons.items())
    out = plots_root / exp
    if "level" in df and (df["level"] == "model").all():
        return draw_model_experiment(df, meta, out)
    sfx = "_modelled" if source(df) == "modelled" else ""   # a modelled figure says so in its file name
    files: list[Path] = []
    methods = sorted(df["method"].unique(), key=_method_order)
    baseline = meta.get("baseline") or (methods[0] if methods else None)
    # N grown with G (a fixed number of tokens per rank, varlen_magiattention_h100): every panel of a line over N
    # would hold one point; the mask figures below and the table carry those cases
    with_g = df["world_size"].nunique() > 1 and df.groupby("world_size")["seqlen"].nunique().max() == 1
    if df["seqlen"].nunique() > 1 and not with_g:
        seq_files, df = _seqlen_figures(df, meta, out, sfx, baseline)
        files += seq_files
    varies_mask = "mask" in df and (df["mask"].fillna("").nunique() > 1 or df["layout"].nunique() > 1) \
        and (df["mask"].fillna("") != "").any()
    if varies_mask:
        files.append(mask_figure(df, "time_median_s", "time per step (s, median; bars p10-p90)",
                                 "time per mask and layout", meta, out / f"masks_time{sfx}.png", errbars=True))
        files.append(mask_figure(df, "tflops_per_rank", "TFLOP/s per rank (live entries only)",
                                 "throughput per mask and layout", meta, out / f"masks_tflops{sfx}.png"))
        files.append(mask_figure(df, "work_imbalance_rows", "work max/mean over ranks (1 = even)",
                                 "work balance of each layout (live score entries per rank: rows solid, "
                                 "columns hatched)", meta, out / f"masks_balance{sfx}.png", per_method=False,
                                 second="work_imbalance_cols"))
    elif df["world_size"].nunique() > 1:
        files.append(_line_figure(df, "world_size", "time_median_s", _time_label(df),
                                  "scaling with world size", meta, out / f"scaling_world_size{sfx}.png", logy=True,
                                  errbars=True))
    if df["batch"].nunique() > 1:
        files.append(_line_figure(df, "batch", "tokens_per_s", "tokens/s", "throughput vs batch size", meta,
                                  out / f"throughput_vs_batch{sfx}.png", logy=False))
    files.append(comm_figure(df, meta, out / f"comm_volume{sfx}.png"))
    return [f for f in files if f is not None]


def _seqlen_figures(df: pd.DataFrame, meta: dict, out: Path, sfx: str,
                    baseline: str | None) -> tuple[list[Path], pd.DataFrame]:
    """The line figures over N (speedup, time, TFLOP/s, memory); the frame with TFLOP/s from the one formula."""
    files: list[Path] = []
    if baseline in set(df["method"]):
        files.append(_line_figure(df, "seqlen", "speedup", f"speedup over {baseline} (x)",
                                  f"speedup over {baseline} vs sequence length"
                                  + ("" if sfx else " (bars: 95% bootstrap interval)"),
                                  meta, out / f"speedup_vs_seqlen{sfx}.png", logy=False,
                                  transform=_speedup(baseline), ref_line=1.0, errbars=True))
    files.append(_line_figure(df, "seqlen", "time_median_s", _time_label(df),
                              "time vs sequence length", meta, out / f"time_vs_seqlen{sfx}.png", logy=True,
                              errbars=True))
    # TFLOP/s from the one formula for what was timed (records written before flops_scope divided
    # attention-only FLOPs by a layer's time): the layer's FLOPs at level "layer"

    ok = df["status"] == "ok"
    def flops_of(r: dict) -> tuple[float, str]:
        try:   # a level without a formula here keeps its record's value
            return case_flops(r["level"], axes.shape_from(r), r["mode"])
        except ValueError:
            return r.get("tflops_per_rank", math.nan) * 1e12 * r["time_median_s"] * r["world_size"], \
                str(r.get("flops_scope") or r["level"])

    fl = [flops_of(r) if o else (math.nan, "") for r, o in zip(df.to_dict("records"), ok)]
    df = df.assign(tflops_per_rank=[f / t / 1e12 / w if o else math.nan for (f, _), t, w, o in
                                    zip(fl, df["time_median_s"] if "time_median_s" in df else [math.nan] * len(df),
                                        df["world_size"], ok)])
    scope = next((sc for (_, sc), o in zip(fl, ok) if o), "attention")
    scope = "attention layer" if "layer" in scope else scope      # the long form is in the records
    files.append(_line_figure(df, "seqlen", "tflops_per_rank", f"TFLOP/s per rank ({scope} FLOPs)",
                              f"throughput: {scope} FLOPs / {scope} time"
                              + (" (QKV, output projections and attention)" if scope == "attention layer" else ""),
                              meta,
                              out / f"tflops_vs_seqlen{sfx}.png", logy=False))
    if "mem_peak_bytes" in df:
        dfm = df.assign(mem_peak_mib=df["mem_peak_bytes"] / 2 ** 20)
        files.append(_line_figure(dfm, "seqlen", "mem_peak_mib",
                                  f"peak memory per rank: inputs + peak increase (MiB, {source(df)})",
                                  "peak memory per rank vs sequence length", meta,
                                  out / f"memory_vs_seqlen{sfx}.png", logy=True))
    return files, df


def _origin(results_root: Path) -> str:
    """The results folder a figure was drawn from, relative to the repository (e.g. 'results/reference/<machine>')."""
    return repo_relative(results_root)


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
    ap = argparse.ArgumentParser(prog=prog("python -m experiments.plots"), description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("experiments", nargs="*", help="experiment names (default: all under --results)")
    ap.add_argument("--results", default=str(REPO / "results"),
                    help="a results root, or a folder of roots (default results/: every results/<machine>/, "
                         "results/reference/<machine>/, results/modelled/), drawn to the same place under --out")
    ap.add_argument("--out", default=str(REPO / "plots"))
    args = ap.parse_args(argv)
    base, files = Path(args.results), []
    roots = R.result_roots(base)
    if not roots:
        raise ValueError(f"--results={args.results}: no results under it (no <experiment>/{R.RESULTS_FILE})")
    known = {p.parent.name for root in roots for p in root.glob(f"*/{R.RESULTS_FILE}")}
    unknown = sorted(set(args.experiments) - known)
    if unknown:
        raise ValueError(f"experiments {unknown} have no results under --results={args.results}; "
                         f"those with results: {sorted(known)}")
    for root in roots:
        files += draw_all(root, Path(args.out) / root.relative_to(base), args.experiments or None)
    for f in files:
        print(f)
    print(f"{len(files)} figure(s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(run_cli(main))
