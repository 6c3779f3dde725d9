"""Measured vs predicted time ratios of an experiment run on an emulated cluster.

For each case (one sequence length, one method) of ``results/<experiment>``:

* measured: the median step time and a distribution-free interval for it (order statistics of the raw
  samples: [min, max] of 5 samples covers the median with probability 1 - 2/2^5 = 94%);
* predicted from bytes and compute:
    t_comm = bytes sent per rank (counted, max over ranks) / the emulated inter-node rate per rank
             (in a 2-node ring or pairwise all-to-all every lock-step round waits on an inter-node hop);
    t_comp = the same case's median on plain loopback (``--compute-from``, where a byte costs almost
             nothing), else FLOPs per rank / the calibrated FLOP/s per rank (``flops.py``; methods that do
             more work than the FLOP formula, ring_rsa's materialised scores, are then under-predicted);
  and two bounds: serial t_comp + t_comm (no overlap) and overlapped max(t_comp, t_comm).
Ratios are t(method) / t(``--ref``) (default burst), with the interval of ``harness.speedup`` (the bootstrap
of the ratio of medians, paired by round where the two were timed in the same interleaved rounds; the one
definition the summaries, figures and claims page use). A ratio whose interval contains 1 is not a speedup.

``with_model`` adds the performance model's prediction of every case (``experiments.perfmodel.emulated.validate``:
its schedules on this machine as emulated), predicted / measured, next to these two bounds.

``ratios(records)`` (``python -m experiments.cluster ratios <experiment>``) is the comparison of an
experiment with overlap variants (cpu_double_ring_emulated): per N, each method's speedup over ``ref``
(median(ref) / median(method), with the interval of ``harness.speedup``), and per method with
a ``<method>_no_overlap`` twin the overlap gain median(off) / median(on) and the fraction of
communication hidden, (median(off) - median(on)) / c_off, where c_off is the communication time of the
no-overlap run: the seconds its ranks waited on transfers in the counted step (median over ranks; with
overlap off every transfer is waited for right after it is posted, so the waits are the serialised
communication). The hidden fraction's interval maps the gain's: median(on) x (gain - 1) / c_off.
"""
from __future__ import annotations

import math
import statistics
from pathlib import Path

from burst_impl.shape import AttnShape

from ..figstyle import FOOTER_GID, legend_outside, save_figure  # first: it selects the Agg backend
import matplotlib.pyplot as plt  # after figstyle

from ..harness import results as R
from ..harness.env import git_info
from burst_impl.flops import attention_flops
from ..harness.speedup import Speedup, speedup
from ..perfmodel.emulated.cases import row_label
from ..perfmodel.emulated.validate import validate_experiment

NO_OVERLAP = "_no_overlap"


def results_root_of(results_root: str | Path | None) -> Path:
    """Where the records are: ``results_root``, else this machine's ``results/<machine>/`` (where the runner writes)."""
    return Path(results_root) if results_root else R.machine_root()


def _nan(v: float | None) -> float:
    """A value the tables print: none (no interval, no time) reads nan."""
    return math.nan if v is None else v


def _interval(samples: list[float]) -> tuple[float, float]:
    xs = sorted(samples)
    return (xs[0], xs[-1]) if xs else (math.nan, math.nan)


def _flops(r) -> float:
    """The step's FLOPs: a whole model's from its record (the model FLOP convention, ``flops``), an attention
    step's from ``attention_flops``."""
    if r.get("level") == "model":
        return float(r["flops"])
    return attention_flops(AttnShape(r["batch"], int(r["seqlen"]), r["heads"], r.get("kv_heads"), r["head_dim"],
                                     r["world_size"], causal=bool(r["causal"]), mask=r.get("mask") or ""),
                           mode=r["mode"])


def _rows(df) -> dict:
    ok = df[df["status"] == "ok"] if len(df) else df
    return {(int(r["seqlen"]), row_label(r)): r for _, r in ok.iterrows()}


def report(experiment: str, *, results_root: str | Path | None = None, compute_from: str | None = None,
           ref: str = "burst") -> dict:
    root = results_root_of(results_root)
    rows = _rows(R.load_results(root, experiment))
    if not rows:
        raise ValueError(f"no ok records for experiment {experiment!r} under {root}")
    base = _rows(R.load_results(root, compute_from)) if compute_from else {}
    out_rows = []
    for (n, method), r in sorted(rows.items()):
        cl = r.get("cluster") or {}
        links = cl.get("links") or {}
        inter = (links.get("inter") or links.get("intra") or {}).get("bytes_per_s")
        cal = (cl.get("calibration") or {}).get("per_rank_flops_s")
        sent = (r.get("comm_fwd_bytes") or 0) + (r.get("comm_bwd_bytes") or 0)
        t_comm = sent / inter if inter else math.nan
        if (n, method) in base:
            t_comp, comp_src = float(base[(n, method)]["time_median_s"]), "loopback"
        elif cal:
            t_comp, comp_src = _flops(r) / r["world_size"] / cal, "flops"
        else:
            t_comp, comp_src = math.nan, "-"
        lo, hi = _interval(list(r["time_samples_s"]))
        out_rows.append({"seqlen": n, "method": method, "median_s": float(r["time_median_s"]), "lo_s": lo,
                         "hi_s": hi, "n": len(r["time_samples_s"]), "bytes_per_rank": sent, "t_comm_s": t_comm,
                         "t_comp_s": t_comp, "t_comp_from": comp_src, "serial_s": t_comp + t_comm,
                         "overlap_s": max(t_comp, t_comm), "cluster": cl.get("summary", ""),
                         "machine": (r.get("hardware") or {}).get("summary", ""),
                         "date": str(r.get("timestamp", ""))[:10]})
    by = {(x["seqlen"], x["method"]): x for x in out_rows}
    for x in out_rows:
        b = by.get((x["seqlen"], ref))
        if b is None:
            continue
        # t(method) / t(ref) is the speedup of ref over the method
        s = speedup(rows[(x["seqlen"], ref)], rows[(x["seqlen"], x["method"])])
        x["ratio"], x["ratio_lo"], x["ratio_hi"] = _nan(s.value), _nan(s.lo), _nan(s.hi)
        x["bytes_ratio"] = x["bytes_per_rank"] / b["bytes_per_rank"] if b["bytes_per_rank"] else math.nan
        x["pred_serial_ratio"] = x["serial_s"] / b["serial_s"]
        x["pred_overlap_ratio"] = x["overlap_s"] / b["overlap_s"]
    lines = [f"{experiment}: {out_rows[0]['cluster']}",
             f"t_comp from {'loopback run ' + compute_from if compute_from else 'FLOPs / calibrated FLOP/s'}; "
             f"t_comm = bytes / inter-node rate; ratios vs {ref}; interval = [min, max] of the samples; "
             "ratio interval = 95% bootstrap of the ratio of medians, paired by round (harness.speedup)",
             f"{'N':>6} {'method':<10} {'median s':>9} {'interval':>17} {'MB/rank':>8} {'t_comp':>7} {'t_comm':>7}"
             f" {'ratio':>6} {'ratio interval':>15} {'bytes':>6} {'pred serial':>11} {'pred overlap':>12}"]
    for x in out_rows:
        lines.append(
            f"{x['seqlen']:>6} {x['method']:<10} {x['median_s']:9.3f} [{x['lo_s']:7.3f},{x['hi_s']:7.3f}] "
            f"{x['bytes_per_rank'] / 1e6:8.2f} {x['t_comp_s']:7.2f} {x['t_comm_s']:7.2f} "
            f"{x.get('ratio', math.nan):6.2f} [{x.get('ratio_lo', math.nan):5.2f},{x.get('ratio_hi', math.nan):5.2f}]"
            f" {x.get('bytes_ratio', math.nan):6.2f} {x.get('pred_serial_ratio', math.nan):11.2f} "
            f"{x.get('pred_overlap_ratio', math.nan):12.2f}")
    return {"experiment": experiment, "rows": out_rows, "text": "\n".join(lines)}


def with_model(rep: dict, results_root: str | Path | None = None, **kw) -> dict:
    """``rep`` plus the performance model's prediction of every case (``experiments.perfmodel.emulated.validate``:
    this machine as emulated, predicted / measured per case) appended to its text as ``rep["model"]``."""
    root = results_root_of(results_root)
    model = validate_experiment(root, rep["experiment"], **kw)
    return {**rep, "model": model, "text": rep["text"] + "\n\n" + model["text"]}


REPORT_FILE = "emulation_report.txt"
FIGURE_FILE = "emulated_vs_modelled.png"


def write_report(rep: dict, results_root: str | Path | None, plots_root: str | Path | None = None) -> list[Path]:
    """``rep``'s text as ``<results>/<experiment>/emulation_report.txt`` and, with ``plots_root``, its figure
    as ``<plots>/<experiment>/emulated_vs_modelled.png`` (what ``experiments.run`` writes after a run;
    ``python -m experiments.cluster report --write`` re-derives them from the records with today's model)."""
    path = R.experiment_dir(results_root_of(results_root), rep["experiment"]) / REPORT_FILE
    git = git_info()      # the measurements carry their own commit; this is the code that derived the text
    path.write_text(rep["text"] + f"\nwritten by commit {git['commit']}{' (dirty)' if git['dirty'] else ''}\n")
    if plots_root is None:
        return [path]
    return [path, figure(rep, Path(plots_root) / rep["experiment"] / FIGURE_FILE)]


def loopback_twin(preset, spec) -> str | None:
    """A spec of ``preset`` with exactly ``spec``'s cases on plain loopback (cluster cpu), if there is one."""
    ids = {c.case_id for c in spec.cases()}
    for other in preset.specs:
        if other is not spec and other.profile.scheduler == "local" and {c.case_id for c in other.cases()} == ids:
            return other.name
    return None


def figure(rep: dict, out: Path) -> Path:
    """Measured median step time per method (bars, [min, max] whiskers) next to the two modelled bounds."""
    rows = rep["rows"]
    ns = sorted({r["seqlen"] for r in rows})
    fig, axes = plt.subplots(1, len(ns), figsize=(max(8.0, 4.5 * len(ns) + 2), 4.6), squeeze=False)
    for ax, n in zip(axes[0], ns):
        sel = [r for r in rows if r["seqlen"] == n]
        xs = range(len(sel))
        med = [r["median_s"] for r in sel]
        err = [[r["median_s"] - r["lo_s"] for r in sel], [r["hi_s"] - r["median_s"] for r in sel]]
        ax.bar(xs, med, yerr=err, capsize=4, color="tab:blue", alpha=0.8, label="measured median [min, max]")
        ax.scatter(xs, [r["serial_s"] for r in sel], marker="v", color="tab:red", zorder=3,
                   label="modelled: t_comp + t_comm")
        ax.scatter(xs, [r["overlap_s"] for r in sel], marker="^", color="tab:green", zorder=3,
                   label="modelled: max(t_comp, t_comm)")
        pm = {(m["seqlen"], m["method"]): m["predicted_s"] for m in (rep.get("model") or {}).get("rows", [])}
        if pm:
            ax.scatter(xs, [pm.get((n, r["method"]), math.nan) for r in sel], marker="D", color="black", zorder=4,
                       label="modelled: performance model (schedule)")
        ax.set_xticks(list(xs), [r["method"] for r in sel])
        ax.set_title(f"N={n}", fontsize=9)
        ax.set_ylabel("seconds per step (fwd+bwd)")
        ax.grid(True, axis="y", alpha=0.3)

    legend_outside(axes[0][-1], fontsize=7)        # one legend, right of the last panel, off the bars
    r0 = rep["rows"][0]
    fig.suptitle(f"{rep['experiment']}: measured on the emulated cluster vs modelled", fontsize=10)
    fig.tight_layout()
    # the provenance as one footer line (the cluster's link rates are in emulation_report.txt)
    profile = str(r0["cluster"]).split(":")[0].split(",")[0]
    fig.text(0.5, 0.0, f"measured on {r0['machine']} ({profile}) · {r0['date']} · {rep['experiment']}", ha="center",
             va="top", fontsize=7, color="dimgray", gid=FOOTER_GID)
    return save_figure(fig, out)


# ---------------------------------------------------------------- speedups and overlap, with intervals


def _ok_by_case(records) -> dict[tuple[int, str], dict]:
    return {(int(r["seqlen"]), r["method"]): r for r in records if r.get("status") == "ok"}


def _median(xs) -> float:
    return statistics.median(xs) if xs else math.nan


def _wait(r: dict) -> float:
    """Median over ranks of the seconds waited on transfers in the counted step (nan if not recorded)."""
    return _median([w for w in r.get("comm_wait_s_per_rank") or [] if w is not None])


def _calibrated_compute(r: dict) -> float:
    """Seconds of compute per rank the emulator's calibration implies for this case (FLOPs / G / the
    calibrated per-rank FLOP/s): the compute the link rates were scaled to. Measured compute far from it
    means the machine's load changed between bring-up and the run, and so did the compute : communication
    ratio the scaling rule set."""
    cal = ((r.get("cluster") or {}).get("calibration") or {}).get("per_rank_flops_s")
    if not cal or "heads" not in r:
        return math.nan
    return _flops(r) / r["world_size"] / cal


def _overlap(n: int, method: str, on: dict, off: dict, gain: Speedup) -> dict:
    """The overlap gain t(off) / t(on) (the speedup of overlap on over off) and the fraction of the no-overlap
    run's communication it hides, the gain's interval mapped through median(on) x (gain - 1) / c_off."""
    c_off = _wait(off)
    t_on, t_off = _median(list(on["time_samples_s"])), _median(list(off["time_samples_s"]))
    hid = (lambda g: t_on * (g - 1) / c_off) if c_off > 0 else (lambda g: math.nan)
    g, lo, hi = _nan(gain.value), _nan(gain.lo), _nan(gain.hi)
    return {"seqlen": n, "method": method, "on_s": t_on, "off_s": t_off, "gain": g, "gain_lo": lo, "gain_hi": hi,
            "comm_off_s": c_off, "compute_off_s": t_off - c_off, "compute_cal_s": _calibrated_compute(off),
            "hidden": hid(g), "hidden_lo": hid(lo), "hidden_hi": hid(hi)}


def ratios(records, *, ref: str = "burst", level: float = 0.95) -> dict:
    """Speedups over ``ref`` and overlap gains, with bootstrap intervals, from result records (dicts with
    status, seqlen, method, time_samples_s and, for the hidden fraction, comm_wait_s_per_rank)."""
    cases = _ok_by_case(records)
    if not cases:
        raise ValueError("ratios: no ok records")
    speed, overlap = [], []
    for (n, method), r in sorted(cases.items()):
        base = cases.get((n, ref))
        if base is not None:     # the reference itself too: its interval is the noise of one set of samples
            sp = speedup(r, base, level=level)
            speed.append({"seqlen": n, "method": method, "ref": ref, "speedup": _nan(sp.value), "lo": _nan(sp.lo),
                          "hi": _nan(sp.hi), "how": sp.how, "resolved": sp.resolved,
                          "median_s": _median(list(r["time_samples_s"])), "wait_s": _wait(r),
                          "ref_wait_s": _wait(base)})
        off = cases.get((n, method + NO_OVERLAP))
        if off is not None:
            overlap.append(_overlap(n, method, r, off, speedup(r, off, level=level)))
    largest = max(n for n, _ in cases)
    lines = [f"speedup over {ref} = median({ref}) / median(method); [{level:.0%} bootstrap interval, paired by "
             "round where timed in the same rounds (harness.speedup)]; "
             "* = the interval excludes 1; wait = seconds a rank waited on transfers (median over ranks, "
             "counted step; all-to-alls not included), the exposed ring communication",
             f"{'N':>6} {'method':<30} {'median s':>9} {'wait s':>7} {'speedup':>8} {'interval':>16}"]
    lines += [f"{x['seqlen']:>6} {x['method']:<30} {x['median_s']:9.3f} {x['wait_s']:7.3f} {x['speedup']:8.2f} "
              f"[{x['lo']:6.2f},{x['hi']:6.2f}]{' *' if x['resolved'] else ''}" for x in speed]
    if overlap:
        lines += ["", "overlap: gain = median(off) / median(on); hidden = (off - on) / c_off, c_off = the "
                      "no-overlap run's transfer waits (median over ranks); compute = off - c_off (measured) next "
                      "to FLOPs / calibrated rate (what the links were scaled to)",
                  f"{'N':>6} {'method':<22} {'on s':>7} {'off s':>7} {'gain':>6} {'interval':>15} {'c_off s':>8}"
                  f" {'hidden':>7} {'interval':>15} {'compute s':>9} {'calib. s':>8}"]
        lines += [f"{x['seqlen']:>6} {x['method']:<22} {x['on_s']:7.3f} {x['off_s']:7.3f} {x['gain']:6.2f} "
                  f"[{x['gain_lo']:5.2f},{x['gain_hi']:5.2f}] {x['comm_off_s']:8.3f} {x['hidden']:7.0%} "
                  f"[{x['hidden_lo']:5.0%},{x['hidden_hi']:5.0%}] {x['compute_off_s']:9.3f} {x['compute_cal_s']:8.3f}"
                  for x in overlap]
    return {"ref": ref, "level": level, "largest_seqlen": largest, "speedup": speed, "overlap": overlap,
            "text": "\n".join(lines)}


def ratios_of(experiment: str, *, results_root: str | Path | None = None, ref: str = "burst",
              level: float = 0.95) -> dict:
    """``ratios`` of the newest record per case of ``results/<experiment>``, with where it ran."""
    root = results_root_of(results_root)
    df = R.load_results(root, experiment)
    recs = df.to_dict("records") if len(df) else []
    out = ratios(recs, ref=ref, level=level)
    ok = [r for r in recs if r.get("status") == "ok"]
    where = ((ok[0].get("cluster") or {}).get("summary", ""), (ok[0].get("hardware") or {}).get("summary", ""),
             str(ok[0].get("timestamp", ""))[:16])
    out["text"] = f"{experiment}: {where[0]}\n{where[1]} · measured {where[2]}\n" + out["text"]
    return out
