"""Figures and tables for model-level records (``measure.level: model``), from results files only.

``experiments.plots.draw_experiment`` hands an experiment here when its records are model-level. A
*row* is what the papers' legends and tables list: a spec's variant label (``model.variants``), else the
method, "+ZeRO" when its weights are FSDP2
sharded, and the kernel's variant ("without LAO" for a ring method on the ``math`` kernel, "without
FlashAttention" for TP on it). A row's colour is its method's; rows that share a method differ by marker in
the line figures and by hatch in the bars (``row_marks``). ``plots/<experiment>/`` gets, where the sweep has
the axis:

* ``model_tokens_per_s_vs_seqlen.png``: tokens/s per rank (median; bars from the p10/p90 step times);
* ``model_mfu_vs_seqlen.png``: MFU (GPU records), else model TFLOP/s per rank, with the FLOP convention;
* ``model_memory_vs_seqlen.png``: peak memory per rank: weights + gradients + optimizer state, plus the
  step's peak above them (measured);
* ``model_tokens_per_s_vs_batch.png``: throughput vs batch (Fig. 4b);
* ``model_summary.png`` (one sequence length and batch, e.g. Fig. 3's rows): tokens/s per rank and memory
  per rank as bars per row;
* ``model_comm_per_layer.png``: bytes per layer, measured next to the formula;
* ``prefill_latency.md`` / ``.csv``: first-token latency table (rows x sequence lengths), Tables 2/3 style.
"""
from __future__ import annotations

from pathlib import Path

import pandas as pd

from . import figure_parts as FP
from .figstyle import _method_order, color, legend_outside, save_figure  # first: it selects Agg
import matplotlib.pyplot as plt  # after figstyle: it chose the backend
from matplotlib.patches import Patch
from .harness.axes import human

TITLE_MODE = {"train": "training step", "prefill": "prefill (first token)"}


def row_label(r) -> str:
    variant = r.get("variant_label")
    if isinstance(variant, str) and variant:      # a spec's named row (model_cases.ModelVariant)
        return variant + ("+ZeRO" if bool(r.get("zero")) else "")
    label = str(r["method"]) + ("+ZeRO" if bool(r.get("zero")) else "")
    if r.get("kernel") == "math":
        label += " without FlashAttention" if str(r["method"]).startswith("tp_") else " without LAO"
    return label


def _rows(df: pd.DataFrame) -> pd.DataFrame:
    df = df.copy()
    df["row"] = [row_label(r) for _, r in df.iterrows()]
    return df


ROW_MARKERS = ("o", "s", "D", "^", "v", "P", "X", "*")
ROW_HATCHES = ("", "//", "..", "xx", "\\\\", "oo", "++", "--")


def row_marks(pairs) -> dict[str, int]:
    """Each row's place among the rows of its method, in the order given: its marker or hatch, so rows that
    share a method and so a colour (Burst-USP and LoongTrain-USP, the ablation's steps) stay apart."""
    out: dict[str, int] = {}
    seen: dict[str, int] = {}
    for row, method in pairs:
        if row not in out:
            out[row] = seen[method] = seen.get(method, -1) + 1
    return out


def _style(row: str, method: str, mark: int) -> dict:
    dashed = "+ZeRO" in row or "without" in row
    return {"color": color(method), "linestyle": "--" if dashed else "-",
            "marker": ROW_MARKERS[mark % len(ROW_MARKERS)]}


def _title(df: pd.DataFrame, meta: dict, what: str) -> str:
    r = df.iloc[0]
    ref = f" ({meta['paper_ref']})" if meta.get("paper_ref") else ""
    # the model's name: "model_config" in a modelled model-level record, "model" (its config) in every record
    model = r.get("model_config") if isinstance(r.get("model_config"), str) else r.get("model")
    gs = "/".join(str(g) for g in sorted(df["world_size"].unique()))     # a main table's cells differ in G
    return (f"{r['experiment']}{ref}: {what}\nmodel {model}, {TITLE_MODE.get(r['mode'], r['mode'])}, "
            f"G={gs}, B={r['batch']}, {r['dtype']}, {r['layout']}")


def _world_sizes(df: pd.DataFrame, x: str) -> dict | None:
    """Tick names 'N / G=<ranks>' where each sequence length ran on its own number of ranks (BurstEngine's
    2M on 32, 4M on 64): the line then joins settings that differ in G too, and the axis says so."""
    per = df.groupby(x)["world_size"].unique()
    if x != "seqlen" or df["world_size"].nunique() < 2 or any(len(g) != 1 for g in per):
        return None
    return {int(v): f"{human(int(v))}\nG={int(g[0])}" for v, g in per.items()}


def _lines(df: pd.DataFrame, x: str, y: str, ylabel: str, what: str, meta: dict, out: Path, *,
           band: tuple[str, str] | None = None, logy: bool = False) -> Path | None:
    ok = df[df["status"] == "ok"]
    if y not in ok or ok[y].isna().all():
        return None
    fig, ax = plt.subplots(figsize=(7.8, 5.0))
    groups = sorted(df.groupby("row"), key=lambda kv: (_method_order(kv[1]["method"].iloc[0]), kv[0]))
    marks = row_marks((row, part["method"].iloc[0]) for row, part in groups)
    for row, part in groups:
        method = part["method"].iloc[0]
        good = part[(part["status"] == "ok") & part[y].notna()].sort_values(x)
        if len(good):
            kw = _style(row, method, marks[row])
            if band is not None and all(c in good for c in band):
                ax.errorbar(good[x], good[y], yerr=[good[y] - good[band[0]], good[band[1]] - good[y]],
                            label=row, capsize=3, **kw)
            else:
                ax.plot(good[x], good[y], label=row, **kw)
        FP.mark_bad(ax, part.assign(method=row), x, row)
    FP.log2_x(ax, df[x], _world_sizes(df, x))
    if logy:
        ax.set_yscale("log")
    ax.set_xlabel({"seqlen": "sequence length N (tokens)", "batch": "batch size B"}[x])
    ax.set_ylabel(ylabel)
    ax.grid(True, which="both", alpha=0.3)
    FP.status_legend(ax, df)
    ax.set_title(_title(df, meta, what), fontsize=9)
    fig.tight_layout()
    FP.footer(fig, df, meta)
    return save_figure(fig, out)


def _time_bounds(df: pd.DataFrame) -> tuple[pd.Series, pd.Series]:
    """(fast end, slow end) of each step time: the median's 95% interval where the record has one, else
    p10/p90, else the median itself (modelled records carry no spread)."""
    lo, hi = df["time_median_s"].copy(), df["time_median_s"].copy()
    for lo_col, hi_col in (("time_p10_s", "time_p90_s"), ("time_ci_lo_s", "time_ci_hi_s")):
        if lo_col in df and hi_col in df:
            have = df[lo_col].notna() & df[hi_col].notna()
            lo[have], hi[have] = df.loc[have, lo_col], df.loc[have, hi_col]
    return lo.astype(float), hi.astype(float)


def _with_rates(df: pd.DataFrame) -> pd.DataFrame:
    """tokens/s per rank at the median and at the slow and fast ends of the step time (_time_bounds)."""
    df = df.copy()
    tokens = df["batch"] * df["seqlen"] / df["world_size"]
    fast, slow = _time_bounds(df)
    df["tok_rank"] = tokens / df["time_median_s"]
    df["tok_rank_lo"] = tokens / slow
    df["tok_rank_hi"] = tokens / fast
    if "mem_peak_bytes" in df:
        state = df.get("mem_state_bytes_per_rank")
        base = state.map(lambda v: max(v) if isinstance(v, list) and v else 0) if state is not None else 0
        df["mem_total_gib"] = (df["mem_peak_bytes"] + base) / 2 ** 30
    if "mfu" in df:
        df["mfu_pct"] = df["mfu"].astype(float) * 100
    return df


def prefill_table(df: pd.DataFrame) -> pd.DataFrame:
    """Rows x sequence lengths of first-token latency in ms (median [interval of _time_bounds]),
    'OOM' / 'failed' where so."""
    cells: dict[str, dict[int, str]] = {}
    df = df.sort_values("seqlen")
    df["_fast"], df["_slow"] = _time_bounds(df) if "time_median_s" in df else (None, None)
    for _, r in df.iterrows():
        if r["status"] == "ok":
            cell = f"{r['time_median_s'] * 1e3:.1f} [{r['_fast'] * 1e3:.1f}, {r['_slow'] * 1e3:.1f}]"
        else:
            cell = {"oom": "OOM", "failed": "failed"}.get(r["status"], r["status"])
        cells.setdefault(r["row"], {})[int(r["seqlen"])] = cell
    order = sorted(cells, key=lambda row: (_method_order(row.split("+")[0].split(" ")[0]), row))
    table = pd.DataFrame([cells[r] for r in order], index=order)
    table.index.name = "first-token latency, ms median [95% interval, else p10-p90]"
    return table.reindex(columns=sorted(table.columns)).fillna("-")


def _write_table(df: pd.DataFrame, meta: dict, out_dir: Path) -> list[Path]:
    table = prefill_table(df)
    out_dir.mkdir(parents=True, exist_ok=True)
    csv, md = out_dir / "prefill_latency.csv", out_dir / "prefill_latency.md"
    table.to_csv(csv)
    head = table.rename(columns=human)
    lines = ["| " + " | ".join([table.index.name, *map(str, head.columns)]) + " |",
             "|" + "---|" * (len(head.columns) + 1)]
    lines += ["| " + " | ".join([idx, *map(str, row)]) + " |" for idx, row in head.iterrows()]
    md.write_text(_title(df, meta, "first-token latency") + "\n\n" + FP.provenance(df, meta) + "\n\n"
                  + "\n".join(lines) + "\n")
    return [csv, md]


# BurstAttention Table 4's row names, by (method, kernel) of a perplexity record ("math": materialised scores)
PAPER_ROWS = {("tp_v1", "math"): "TP (V1)", ("tp_v3", "math"): "TP (V3)", ("tp_v1", "auto"): "TP + FlashAttention (V1)",
              ("tp_v3", "auto"): "TP + FlashAttention (V3)", ("ring_rsa", "auto"): "RingAttention",
              ("burst", "math"): "Burst without LAO", ("burst", "auto"): "BurstAttention"}


def perplexity_table(df: pd.DataFrame, meta: dict, out_dir: Path) -> list[Path]:
    """``perplexity.md``: each row's held-out perplexity next to the single-process model's (Table 4)."""
    ok = df[df["status"] == "ok"]
    lines = [_title(df, meta, "held-out perplexity after training (Table 4)"), "",
             "| paper row | method (kernel) | perplexity before training | perplexity | single-process | "
             "relative difference | tolerance | equal |", "|---|---|---:|---:|---:|---:|---:|---|"]
    for _, r in ok.sort_values("row", key=lambda s: [_method_order(x.split(" ")[0]) for x in s]).iterrows():
        kernel = "math" if r.get("config", {}).get("kernel") == "math" else "auto"
        lines.append(f"| {PAPER_ROWS.get((r['method'], kernel), '')} | {r['row']} ({r['kernel']}) | "
                     f"{r['perplexity_before']:.4f} | {r['perplexity']:.6f} | {r['perplexity_reference']:.6f} | "
                     f"{r['perplexity_rel_diff']:.1e} | {r['perplexity_rtol']:.0e} | "
                     f"{'yes' if r['perplexity_equal'] else 'NO'} |")
    bad = df[df["status"] != "ok"]
    lines += [f"| – | {r['row']} | {r['status']}: {str(r['reason'])[:100]} | | | | | |" for _, r in bad.iterrows()]
    r0 = ok.iloc[0] if len(ok) else None
    if r0 is not None:
        lines += ["", f"{int(r0['train_steps'])} AdamW steps at lr {r0['lr']:g} on corpus {r0['corpus']!r} "
                      f"(seeded, burst_impl/model/data.py), then {int(r0['eval_tokens'])} held-out tokens; "
                      f"reference: {r0['reference']}."]
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "perplexity.md"
    path.write_text("\n".join(lines) + "\n")
    return [path]


def draw_model_experiment(df: pd.DataFrame, meta: dict, out: Path) -> list[Path]:
    """Every model-level figure and table of one experiment (records already without 'skipped')."""
    files: list = []
    df = _rows(df)
    if (df["mode"] == "perplexity").any():       # a correctness result: a table, no timing figures
        files += perplexity_table(df[df["mode"] == "perplexity"], meta, out)
        df = df[df["mode"] != "perplexity"]
        if df.empty:
            return files
    df = _with_rates(df)
    for mode, part in df.groupby("mode"):
        # a modelled figure says so in its file name too, as experiments.plots' figures do
        sfx = (f"_{mode}" if df["mode"].nunique() > 1 else "") + ("_modelled" if FP.source(part) == "modelled" else "")
        if part["seqlen"].nunique() > 1:
            files.append(_lines(part, "seqlen", "tok_rank", "tokens/s per rank", "throughput per rank", meta,
                                out / f"model_tokens_per_s_vs_seqlen{sfx}.png", band=("tok_rank_lo", "tok_rank_hi")))
            has_mfu = "mfu_pct" in part and part["mfu_pct"].notna().any()
            conv = part["flops_convention"].dropna().iloc[0] if "flops_convention" in part and \
                part["flops_convention"].notna().any() else ""
            files.append(_lines(part, "seqlen", "mfu_pct" if has_mfu else "tflops_per_rank",
                                "MFU (%)" if has_mfu else "model TFLOP/s per rank",
                                ("MFU" if has_mfu else "model TFLOP/s per rank") + f"\nFLOPs: {conv[:110]}",
                                meta, out / f"model_mfu_vs_seqlen{sfx}.png"))
            files.append(_lines(part, "seqlen", "mem_total_gib",
                                f"GiB per rank (state + step peak, {FP.source(part)})", "peak memory per rank",
                                meta, out / f"model_memory_vs_seqlen{sfx}.png", logy=True))
        if part["seqlen"].nunique() == 1 and part["batch"].nunique() == 1:
            files.append(_summary_bars(part, meta, out / f"model_summary{sfx}.png"))
        if part["batch"].nunique() > 1:
            files.append(_lines(part, "batch", "tok_rank", "tokens/s per rank", "throughput vs batch", meta,
                                out / f"model_tokens_per_s_vs_batch{sfx}.png", band=("tok_rank_lo", "tok_rank_hi")))
        files.append(_comm_per_layer(part, meta, out / f"model_comm_per_layer{sfx}.png"))
        if mode == "prefill":
            files.extend(_write_table(part, meta, out))
    return [f for f in files if f is not None]


def _comm_per_layer(df: pd.DataFrame, meta: dict, out: Path) -> Path | None:
    ok = df[(df["status"] == "ok")]
    if "comm_layer_bytes" not in ok or ok["comm_layer_bytes"].isna().all():
        return None
    n = ok["seqlen"].max()
    sel = ok[(ok["seqlen"] == n) & (ok["batch"] == ok["batch"].min())].drop_duplicates("row")
    sel = sel.sort_values("row", key=lambda s: [_method_order(r.split("+")[0].split(" ")[0]) for r in s])
    fig, ax = plt.subplots(figsize=(max(6.5, 1.2 * len(sel) + 2), 4.8))
    xs = range(len(sel))
    ax.bar([x - 0.2 for x in xs], sel["comm_layer_bytes"] / 2 ** 20, 0.4, label="measured", color="tab:blue")
    ax.bar([x + 0.2 for x in xs], sel["comm_layer_formula_bytes"] / 2 ** 20, 0.4, label="formula", hatch="//",
           color="tab:blue", alpha=0.45, edgecolor="black", linewidth=0.5)
    ax.set_xticks(list(xs))
    ax.set_xticklabels(list(sel["row"]), rotation=20, fontsize=8)
    ax.set_ylabel("MiB sent per rank per layer (max over ranks)")
    ax.grid(True, axis="y", alpha=0.3)
    legend_outside(ax)
    ax.set_title(_title(sel, meta, f"bytes per layer at N={human(int(n))}"), fontsize=9)
    fig.tight_layout()
    FP.footer(fig, df, meta)
    return save_figure(fig, out)


def _variant_order(meta: dict) -> list[str]:
    """A spec's variant names in its order (an ablation's rows are cumulative: the order is the point)."""
    model = meta.get("model")
    if isinstance(model, dict) and model.get("variants"):         # measured: the resolved spec
        return [v["name"] for v in model["variants"]]
    return [r["name"] for r in meta.get("rows") or []]           # modelled: model_figures' meta


def _in_row_order(ok: pd.DataFrame, meta: dict) -> pd.DataFrame:
    order = _variant_order(meta)
    if order and "variant" in ok and ok["variant"].isin(order).all():
        return ok.sort_values("variant", key=lambda s: [order.index(v) for v in s])
    return ok.sort_values("row", key=lambda s: [(_method_order(r.split("+")[0].split(" ")[0]), r) for r in s])


def _summary_bars(df: pd.DataFrame, meta: dict, out: Path) -> Path | None:
    """Tokens/s per rank (p10/p90 step times as whiskers) and memory per rank (state + step peak), one bar per row."""
    ok = df[df["status"] == "ok"]
    if ok.empty:
        return None
    ok = _in_row_order(ok, meta)
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(max(9.0, 2.2 * len(ok) + 3), 4.8))
    xs = list(range(len(ok)))
    cols = [color(m) for m in ok["method"]]
    marks = row_marks(zip(ok["row"], ok["method"]))
    hatches = [ROW_HATCHES[marks[r] % len(ROW_HATCHES)] for r in ok["row"]]
    a1.bar(xs, ok["tok_rank"], color=cols, hatch=hatches, edgecolor="black", linewidth=0.5,
           yerr=[ok["tok_rank"] - ok["tok_rank_lo"], ok["tok_rank_hi"] - ok["tok_rank"]], capsize=4)
    a1.set_ylabel("tokens/s per rank (median; whiskers p90/p10 step times)")
    if "mem_total_gib" in ok:
        state = ok["mem_state_bytes_per_rank"].map(lambda v: max(v) / 2 ** 30 if isinstance(v, list) and v else 0.0)
        kept = "weights + grads + optimizer state" if FP.source(ok) == "measured" else \
            "weights + optimizer state (modelled: the gradients are in the step's peak)"
        # the parts differ by shade, since the hatch tells rows of one method apart
        a2.bar(xs, state, color=cols, alpha=0.4, hatch=hatches, edgecolor="black", linewidth=0.5)
        a2.bar(xs, ok["mem_total_gib"] - state, bottom=state, color=cols, hatch=hatches, edgecolor="black",
               linewidth=0.5)
        a2.set_ylabel(f"GiB per rank ({FP.source(ok)})")
        legend_outside(a2, [Patch(facecolor="darkgray", alpha=0.4, edgecolor="black", label=f"lighter: {kept}"),
                            Patch(facecolor="darkgray", edgecolor="black", label="solid: step peak above them")],
                       [f"lighter: {kept}", "solid: step peak above them"])
    for ax in (a1, a2):
        ax.set_xticks(xs)
        ax.set_xticklabels(list(ok["row"]), rotation=20, fontsize=8)
        ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle(_title(ok, meta, f"N={human(int(ok['seqlen'].iloc[0]))}: throughput and memory per rank"),
                 fontsize=9)
    fig.tight_layout()
    FP.footer(fig, df, meta)
    return save_figure(fig, out)
