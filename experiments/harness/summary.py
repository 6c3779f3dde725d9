"""What a run's numbers resolve: ratios with intervals, and pairs that should agree but do not.

* ``ratios``: for every case shape, each method's speedup over the spec's
  baseline, t(baseline) / t(method), with its 95% interval (``speedup.speedup``:
  the bootstrap, paired by round when the two were timed in the same
  interleaved rounds). A speedup whose interval contains 1 is no speedup, nor
  is one without an interval (lo = hi = None).
* ``rank_times``: how far the slowest rank's time (the suite's) lies above the
  mean rank's (``time_mean_rank_s``, what codes averaging over ranks report):
  slowest / mean per case, median and widest; records measured before the
  field existed are counted, not filled in (``rank_times.spread``).
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

from . import rank_times
from . import results as R
from .speedup import PAIRED, speedup

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
            s = speedup(rec, base)
            if s.value is not None:
                out.append({"shape": key, "method": m, "baseline": baseline, "speedup": s.value, "lo": s.lo,
                            "hi": s.hi, "paired": s.how == PAIRED, "resolved": s.resolved})
    return out


def code_path_flags(records: list[dict]) -> list[dict]:
    """Pairs sharing a code path whose time ratio's interval excludes 1."""
    out = []
    for key, by_method in sorted(_groups(records).items()):
        for a, b, why in code_path_pairs(by_method):
            # t(a) / t(b) is the speedup of b over a. Only a measured interval flags: a modelled pair that
            # differs is the model's schedule, not a loud machine
            s = speedup(by_method[b], by_method[a])
            if s.has_interval and s.resolved:
                out.append({"shape": key, "a": a, "b": b, "ratio": s.value, "lo": s.lo, "hi": s.hi,
                            "paired": s.how == PAIRED, "why_related": why})
    return out


def rank_spread(records: list[dict]) -> dict:
    """Slowest over mean rank's time across the ok cases: median, widest (and its case), and how many records
    have no mean rank's time (measured before ``time_mean_rank_s`` existed)."""
    ok = [r for r in R.latest_by_case(records).values() if r.get("status") == "ok"]
    got = sorted((rank_times.spread(r), r["case_id"]) for r in ok if rank_times.spread(r) is not None)
    out = {"with_mean_rank": len(got), "without_mean_rank": len(ok) - len(got)}
    if got:
        out.update(median=got[len(got) // 2][0], max=got[-1][0], max_case=got[-1][1])
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
            "no_interval": len(ok) - len(widths), "repeat_stop": stops, "ratios": rat, "code_path_flags": flags,
            "rank_times": rank_spread(recs)}
    (R.experiment_dir(results_root, experiment) / "summary.json").write_text(json.dumps(data, indent=1))
    lines = [f"{experiment}: {len(ok)} ok case(s); median interval +-"
             + (f"{data['ci_halfwidth_rel']['median'] * 100:.1f}% "
                f"(widest +-{data['ci_halfwidth_rel']['max'] * 100:.1f}%)"
                if widths else "n/a") + f"; repeats stopped by {stops}"]
    rt = data["rank_times"]
    if rt["with_mean_rank"]:
        old = rt["without_mean_rank"]
        lines.append(f"  slowest / mean rank's time: median {rt['median']:.3f}, widest {rt['max']:.3f} "
                     f"({rt['max_case']})" + (f"; {old} record(s) measured before the mean rank's time was kept"
                                              if old else ""))
    if rat:
        unresolved = sum(not r["resolved"] for r in rat)
        lines.append(f"  {len(rat)} speedup(s) over {baseline}; {unresolved} within their interval (no difference)")
    for f in flags:
        lines.append(f"  FLAG {f['shape']}: {f['a']} / {f['b']} time ratio {f['ratio']:.3f} "
                     f"[{f['lo']:.3f}, {f['hi']:.3f}] excludes 1, yet {f['why_related']}")
    return "\n".join(lines)
