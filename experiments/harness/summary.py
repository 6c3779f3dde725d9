"""What a run's numbers resolve: ratios with intervals, and pairs that should agree but do not.

* ``ratios``: for every case shape, each method's speedup over the spec's
  baseline, t(baseline) / t(method), with a 95% bootstrap interval
  (``timing.ratio_interval``; paired by round when the two were timed in the
  same interleaved rounds). A speedup whose interval contains 1 is no speedup.
* ``code_path_flags``: pairs of methods that share a code path (a method and
  its ``variant_of``; ``SAME_CODE``) yet differ beyond their interval: two
  names for the same computation differing means the machine was not quiet
  enough for the figures to rank methods. Variants that change the schedule
  on purpose (``*_no_overlap``: every transfer waited for) are not such pairs:
  their difference is the measurement (the emulated report's overlap table).

``write_summary`` puts both in ``<root>/<experiment>/summary.json`` and
returns the text the run prints.
"""
from __future__ import annotations

import json
from pathlib import Path

from baselines.registry import METHODS

from . import results as R
from .timing import ratio_interval

# Same forward code (burst_qring forces the query-circulating backward, which burst's "auto" picks
# whenever it sends fewer bytes, e.g. for MHA): same numbers expected where auto picks the same side.
SAME_CODE = (("burst", "burst_qring", "same forward; backward identical where burst's auto picks the Q ring"),)


def series(rec: dict) -> str:
    """The row a record belongs to: its model-level variant (model_cases.ModelVariant), else its method."""
    return rec.get("variant") or rec["method"]


def shape_key(rec: dict) -> str:
    """The case id without the row's name: records with equal keys measured the same problem."""
    return rec["case_id"][len(series(rec)) + 1:]


def code_path_pairs(methods) -> list[tuple[str, str, str]]:
    ms = set(methods)
    out = [(m.variant_of, m.name, f"{m.name} is a timing variant of {m.variant_of} ({m.description})")
           for m in METHODS.values() if m.variant_of and m.name in ms and m.variant_of in ms
           and m.options.get("overlap") is not False]
    out += [(a, b, why) for a, b, why in SAME_CODE if a in ms and b in ms]
    return out


def speedup_of(num: dict, den: dict) -> dict | None:
    """t(num)/t(den) with its bootstrap interval (``timing.ratio_interval``), paired by round where the two
    records were timed in the same interleaved rounds; None without samples (two modelled records: the
    ratio of their predicted times, lo = hi = ratio)."""
    a, b = num.get("time_samples_s") or [], den.get("time_samples_s") or []
    if not a and not b and num.get("source") == den.get("source") == "modelled":
        # the performance model predicts one time per case: its ratio is exact, with no interval to draw
        t_num, t_den = num.get("time_median_s"), den.get("time_median_s")
        if not t_num or not t_den:
            return None
        return {"ratio": t_num / t_den, "lo": t_num / t_den, "hi": t_num / t_den}
    if not a or not b:
        return None
    paired = den["case_id"] in (num.get("interleaved_with") or []) and len(a) == len(b)
    return ratio_interval(a, b, paired=paired)


def _groups(records: list[dict]) -> dict[str, dict[str, dict]]:
    out: dict[str, dict[str, dict]] = {}
    for r in R.latest_by_case(records).values():
        if r.get("status") == "ok":
            out.setdefault(shape_key(r), {})[series(r)] = r
    return out


def ratios(records: list[dict], baseline: str) -> list[dict]:
    """Speedup of each method over ``baseline`` per case shape: t(baseline)/t(method) with its interval."""
    out = []
    for key, by_method in sorted(_groups(records).items()):
        base = by_method.get(baseline)
        if base is None:
            continue
        for m, rec in sorted(by_method.items()):
            if m == baseline:
                continue
            r = speedup_of(base, rec)
            if r is not None:
                out.append({"shape": key, "method": m, "baseline": baseline, "speedup": r["ratio"],
                            "lo": r["lo"], "hi": r["hi"], "paired": r["paired"],
                            "resolved": not (r["lo"] <= 1.0 <= r["hi"])})
    return out


def code_path_flags(records: list[dict]) -> list[dict]:
    """Pairs sharing a code path whose time ratio's interval excludes 1."""
    out = []
    for key, by_method in sorted(_groups(records).items()):
        for a, b, why in code_path_pairs(by_method):
            r = speedup_of(by_method[a], by_method[b])
            if r is not None and not (r["lo"] <= 1.0 <= r["hi"]):
                out.append({"shape": key, "a": a, "b": b, "ratio": r["ratio"], "lo": r["lo"], "hi": r["hi"],
                            "paired": r["paired"], "why_related": why})
    return out


def write_summary(results_root: Path | str, experiment: str, baseline: str | None) -> str:
    recs = R.read_records(R.experiment_dir(results_root, experiment) / R.RESULTS_FILE)
    ok = [r for r in R.latest_by_case(recs).values() if r.get("status") == "ok"]
    widths = [r["time_ci_halfwidth_rel"] for r in ok if r.get("time_ci_halfwidth_rel") is not None]
    stops: dict[str, int] = {}
    for r in ok:
        stops[r.get("repeat_stop", "fixed")] = stops.get(r.get("repeat_stop", "fixed"), 0) + 1
    rat = ratios(recs, baseline) if baseline else []
    flags = code_path_flags(recs)
    data = {"experiment": experiment, "baseline": baseline, "n_ok": len(ok),
            "ci_halfwidth_rel": {"max": max(widths), "median": sorted(widths)[len(widths) // 2]} if widths else None,
            "no_interval": len(ok) - len(widths), "repeat_stop": stops, "ratios": rat, "code_path_flags": flags}
    (R.experiment_dir(results_root, experiment) / "summary.json").write_text(json.dumps(data, indent=1))
    lines = [f"{experiment}: {len(ok)} ok case(s); median interval +-"
             + (f"{data['ci_halfwidth_rel']['median'] * 100:.1f}% "
                f"(widest +-{data['ci_halfwidth_rel']['max'] * 100:.1f}%)"
                if widths else "n/a") + f"; repeats stopped by {stops}"]
    if rat:
        unresolved = sum(not r["resolved"] for r in rat)
        lines.append(f"  {len(rat)} speedup(s) over {baseline}; {unresolved} within their interval (no difference)")
    for f in flags:
        lines.append(f"  FLAG {f['shape']}: {f['a']} / {f['b']} time ratio {f['ratio']:.3f} "
                     f"[{f['lo']:.3f}, {f['hi']:.3f}] excludes 1, yet {f['why_related']}")
    return "\n".join(lines)
