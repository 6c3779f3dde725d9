"""The model against our own measurements: predicted / measured time per case of an emulated-cluster run.

The profile is THIS machine as the run emulated it:

* compute: the kernel times ``measured.py`` takes here, at exactly the block
  shapes, GEMMs and memory traffic the schedules ask for, with as many
  concurrent processes and threads as the run had ranks on this machine,
  each capped at the run's CPU share per rank (``cluster.cpu_quota``);
* links: the per-rank rates (and applied latency) the emulator shaped, read
  from the records' ``cluster`` block (``experiments/cluster/emulator/emulation.py``:
  the hardware profile's rates x this machine's compute / the target's), with
  the run's NICs: ``ranks_per_nic`` ranks share one emulated NIC of
  ``ranks_per_nic`` x the per-rank inter rate (1, every rank its own, for runs
  recorded before NICs were shaped), as ``emulator/shaping.py`` builds them.

* overlap: what a transfer takes from its sender's compute while it runs
  under it (``Link.excess_s``), fitted per link class to the CPU excess the
  overlap probe measured on this cluster (``python -m experiments.cluster
  overlap <profile> --out <results root>/overlap_probe.json``: the CPU seconds
  a hop adds to its rank's step, at the rank's CPU rate; ``ring`` cases for
  intra, ``pair`` cases for inter; a line through its cases in bytes, no term
  below 0). Without that file hidden transfers are free, as on a GPU. Why the
  CPU excess and not the probe's wall excess: docs/perfmodel.md#overlap-excess.
* host: the CPU a call costs each rank beside its kernels and transfers, per
  op (``host_cost.py``, from ``<results root>/call_cpu.json``, written by
  ``python -m benchmarks.cpu_per_call --out``). Without that file it is free.

Everything else is the model as it predicts the papers' clusters (same
schedules, simulator, byte placement). ``error = predicted / measured - 1``;
the issue's target is |error| <= 20% for every method at the two largest N.

    rows = compare(records, times)          # records: dicts of results.jsonl (ok, emulated)
    print(error_table(rows)["text"])
"""
from __future__ import annotations

import json
import math
import os
import dataclasses
from pathlib import Path

from baselines import AttnShape

from ..profiles.hardware import Accelerator, Hardware, Link
from burst_impl.flops import attention_flops
from .host_cost import CALL_CPU_FILE, SmallCase, host_per_op, load_call_cpu, small_case
from .measured import KernelTimes, MeasuredCosts, needed
from .model import predict_case
from ..harness import results as R
from .measured import measure

TARGET = 0.20                     # the acceptance bound on |predicted / measured - 1|
SHAPE_KEYS = ("batch", "seqlen", "heads", "kv_heads", "head_dim", "world_size", "dtype", "causal", "layout", "mask")


OVERLAP_FILE = "overlap_probe.json"
EXCESS_PATTERN = {"intra": "ring", "inter": "pair"}     # the probe's symmetric cases per link class


def fit_excess(rows: list[dict]) -> dict[str, tuple[float, float]]:
    """``{class: (excess_s, excess_s_per_byte)}``: per link class the least-squares line of the probe's
    CPU excess (``cpu_excess_s``) against bytes over its cases (one case: all of it per byte), neither
    term below 0."""
    out = {}
    for klass, pattern in EXCESS_PATTERN.items():
        pts = [(float(r["bytes"]), float(r["cpu_excess_s"])) for r in rows if r["pattern"] == pattern]
        if not pts:
            continue
        xs = {x for x, _ in pts}
        if len(xs) < 2:
            out[klass] = (0.0, max(0.0, sum(y for _, y in pts) / sum(x for x, _ in pts)))
            continue
        mx, my = sum(x for x, _ in pts) / len(pts), sum(y for _, y in pts) / len(pts)
        k = sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)
        k = max(0.0, k)
        a = my - k * mx
        if a < 0:                     # through the origin instead
            a, k = 0.0, max(0.0, sum(x * y for x, y in pts) / sum(x * x for x, _ in pts))
        out[klass] = (a, k)
    return out


def load_excess(results_root, profile: str | None) -> dict | None:
    """The fitted excess of ``results_root``'s overlap probe, when it was measured on ``profile``."""
    path = Path(results_root) / OVERLAP_FILE
    if not path.exists():
        return None
    rec = json.loads(path.read_text())
    if profile is not None and rec.get("profile") != profile:
        return None
    if any("cpu_excess_s" not in r for r in rec["rows"]):
        raise ValueError(f"{path}: a probe record without cpu_excess_s (written before it was measured); "
                         f"re-run python -m experiments.cluster overlap {rec.get('profile')} --out {path}")
    return {"fit": fit_excess(rec["rows"]), "path": str(path), "commit": (rec.get("git") or {}).get("commit")}


def emulated_hardware(cluster: dict, dtype: str, excess: dict | None = None) -> Hardware:
    """This machine as the emulated cluster of ``cluster`` (a record's ``cluster`` block).

    The accelerator's numbers are placeholders (peak = the run's calibrated FLOP/s, efficiency 1):
    ``MeasuredCosts`` answers every compute question from measured times instead. ``excess``:
    ``{class: (excess_s, excess_s_per_byte)}`` (``fit_excess``) for the links."""
    if not cluster.get("emulated") or not cluster.get("links"):
        raise ValueError(f"cluster={cluster.get('summary', cluster)!r}: not an emulated run with shaped links "
                         "(a loopback fallback has no link rates to model)")
    nodes, per_node = int(cluster["nodes"]), int(cluster["ranks_per_node"])
    cal = (cluster.get("calibration") or {}).get("per_rank_flops_s") or 1e9
    links = {}
    per_nic = int((cluster["links"].get("inter") or {}).get("ranks_per_nic") or 1)
    for klass, d in cluster["links"].items():
        # inter: one NIC of per_nic x the per-rank rate, shared by per_nic ranks (Link.bytes_per_s = per rank)
        share = per_nic if klass == "inter" else 1
        # the target's intra kind: on PCIe nodes a lone inter flow is capped at the (emulated) PCIe rate,
        # as the emulator shapes it (Hardware.inter_flow_bytes_per_s)
        kind = "pcie" if klass == "intra" and d.get("kind") == "pcie" else "veth"
        a, k = (excess or {}).get(klass, (0.0, 0.0))
        links[klass] = Link(kind=kind, gbits_s=float(d["bytes_per_s"]) * share * 8 / 1e9,
                            latency_us=float(d.get("latency_us") or 0.0), shared_by=share,
                            excess_s=a, excess_s_per_byte=k,
                            source=f"emulated {d.get('kind', '?')} link, shaped per "
                                   f"{'NIC' if share > 1 else 'rank'} ({klass})")
    if "intra" not in links:                          # one rank per node: no intra hop is ever used
        links["intra"] = Link(kind="veth", gbits_s=8e3, latency_us=0.0, source="unused")
    acc = Accelerator(name="CPU rank (emulated)", peak_tflops={dtype: cal / 1e12},
                      hbm_gib=(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) / 2**30 / (nodes * per_node),
                      hbm_gbytes_s=1.0, attn_efficiency=((1, 1.0),), gemm_efficiency=1.0,
                      source="placeholders: compute times are measured per key (experiments.perfmodel.measured)")
    return Hardware(name=f"emulated_{cluster.get('profile', 'cluster')}",
                    description=f"this machine as emulated: {cluster.get('summary', '')}", accelerator=acc,
                    nodes=nodes, devices_per_node=per_node, intra=links["intra"],
                    inter=links.get("inter") if nodes > 1 else None,
                    nics_per_node=per_node // per_nic if nodes > 1 else per_node)


class _Case:
    """What the model needs of a measured record: method, shape, mode, level."""

    def __init__(self, rec: dict):
        self.rec = rec
        self.method, self.mode, self.level = rec["method"], rec["mode"], rec["level"]
        self.shape = AttnShape(**{k: rec[k] for k in SHAPE_KEYS})


def _cases(records) -> list[_Case]:
    return [_Case(r) for r in records if r.get("status") == "ok" and (r.get("cluster") or {}).get("emulated")]


def calibration_key(cluster: dict) -> tuple | None:
    """The work the emulator timed at bring-up (fwd+bwd of one full block, ``emulation._bench``)."""
    c = cluster.get("calibration") or {}
    if not c.get("per_rank_flops_s"):
        return None
    return ("attention", 1, int(c["heads"]), int(c["head_dim"]), int(c["tokens"]), int(c["tokens"]), False,
            "fwd_bwd", c["dtype"])


def load_scale(cluster: dict, times: KernelTimes) -> float:
    """Run-time / table-time of the calibration work: how much slower (> 1) or faster this machine
    computed during the run than while the table was measured (its load differs). 1 when the
    run has no calibration or the table lacks its key."""
    key = calibration_key(cluster)
    if key is None or key not in times.seconds:
        return 1.0
    flops = attention_flops(AttnShape(key[1], key[4], key[2], key[2], key[3], 1, causal=False), mode="fwd_bwd")
    return flops / float(cluster["calibration"]["per_rank_flops_s"]) / times.seconds[key]


def _small(call: dict | None, c: _Case) -> SmallCase | None:
    return small_case(call, c.method, world_size=c.shape.world_size, dtype=c.shape.dtype,
                      node_size=int(c.rec["cluster"]["ranks_per_node"]))


def needed_keys(records, call: dict | None = None) -> set:
    """The kernel-time keys the schedules of ``records`` need (measure them with ``measured.measure``),
    with each run's calibration work (``load_scale``) and the calls of ``call`` (``host_cost``) that
    match them."""
    keys: set = set()
    for c in _cases(records):
        hw = emulated_hardware(c.rec["cluster"], c.shape.dtype)
        keys |= needed([x for x in (c, _small(call, c)) if x is not None], hw, predict=predict_case)
        cal = calibration_key(c.rec["cluster"])
        if cal is not None:
            keys.add(cal)
    return keys


def compare(records, times: KernelTimes, *, rescale: bool = True, excess: dict | None = None,
            call: dict | None = None) -> list[dict]:
    """One row per ok emulated record: measured median, predicted time, their ratio and error.
    ``rescale``: carry the kernel times to the run's load (``load_scale``); ``excess``: the links'
    overlap excess (``fit_excess``; None: hidden transfers are free); ``call``: the per-call CPU
    (``host_cost.load_call_cpu``; None: the host's work is free)."""
    rows, hosts = [], {}
    for c in _cases(records):
        hw = emulated_hardware(c.rec["cluster"], c.shape.dtype, excess)
        k = load_scale(c.rec["cluster"], times) if rescale else 1.0
        key = (c.method, c.shape.world_size, c.shape.dtype, repr(hw), k, run_cpus(c.rec["cluster"]))
        if key not in hosts:          # one small-call prediction per method and run, whatever its cases
            hosts[key] = host_per_op(call, c.method, world_size=c.shape.world_size, dtype=c.shape.dtype,
                                     node_size=hw.devices_per_node, hardware=hw, cpus=key[-1],
                                     costs=lambda h, dt, k=k: MeasuredCosts(h, dt, times=times, scale=k))
        host = hosts[key]
        hs = host["host_s_per_op"] if host else 0.0
        p = predict_case(c.method, c.shape, mode=c.mode, level=c.level, hardware=hw,
                         costs=lambda h, dt, k=k, hs=hs: MeasuredCosts(h, dt, times=times, scale=k, host_s=hs))
        measured = float(c.rec["time_median_s"])
        b = p.breakdown
        rows.append({"seqlen": c.shape.seqlen, "method": c.method, "world_size": c.shape.world_size,
                     "case": " ".join(x for x in (c.shape.layout, c.shape.mask) if x),
                     "measured_s": measured, "predicted_s": p.time_s,
                     "ratio": p.time_s / measured if measured > 0 else math.nan,
                     "error": p.time_s / measured - 1 if measured > 0 else math.nan,
                     "load_scale": k, "critical_comm_s": b["critical_comm_s"],
                     "critical_compute_s": b["critical_compute_s"], "host": host,
                     "samples": list(c.rec.get("time_samples_s") or [])})
    return sorted(rows, key=lambda r: (r["seqlen"], r["method"]))


def error_table(rows: list[dict], target: float = TARGET) -> dict:
    """Text table and verdict: is |error| <= target for every method at the two largest N?"""
    ns = sorted({r["seqlen"] for r in rows})
    top = ns[-2:]
    judged = [r for r in rows if r["seqlen"] in top]
    worst = max((abs(r["error"]) for r in judged), default=math.nan)
    ok = bool(judged) and all(abs(r["error"]) <= target for r in judged)
    lines = ["performance model (experiments.perfmodel) vs measured, this machine as emulated: compute from "
             "kernel times measured here at the schedules' block shapes (x load = the run's calibration time / "
             "the table's for the same work), links at the shaped per-rank rates",
             f"{'N':>6} {'method':<12} {'measured s':>10} {'predicted s':>11} {'pred/meas':>9} {'error':>7} "
             f"{'crit. comm s':>12} {'load':>5}"]
    # a spec sweeping layouts or masks (cpu_sparse_masks) has several rows per (N, method): say which
    cases = len({r.get("case", "") for r in rows}) > 1
    if cases:
        lines[-1] += "  case"
    for r in rows:
        flag = "" if r["seqlen"] not in top else ("  ok" if abs(r["error"]) <= target else "  OUT")
        flag += f"  {r.get('case', '')}" if cases else ""
        lines.append(f"{r['seqlen']:>6} {r['method']:<12} {r['measured_s']:10.3f} {r['predicted_s']:11.3f} "
                     f"{r['ratio']:9.2f} {r['error']:+7.1%} {r['critical_comm_s']:12.3f} {r['load_scale']:5.2f}{flag}")
    n_txt = ", ".join(str(n) for n in top) or "-"
    lines.append(f"target |error| <= {target:.0%} for every method at the two largest N ({n_txt}): "
                 f"{'met' if ok else 'NOT met'} (worst {worst:.1%})"
                 + ("" if len(ns) >= 2 else "; only one N was measured"))
    return {"rows": rows, "largest_n": top, "worst_abs_error": worst, "met": ok, "text": "\n".join(lines)}


KERNEL_TIMES_FILE = "kernel_times.json"


def run_cpus(cluster: dict) -> float | None:
    """The CPU cap each rank of the run had (``cluster.cpu_quota``), None when uncapped: the kernel
    table is timed under the same cap."""
    q = cluster.get("cpu_quota") or {}
    return float(q["cpus_per_rank"]) if q.get("applied") and q.get("cpus_per_rank") else None


def validate_experiment(results_root, experiment: str, *, measure_missing: bool = True, seconds: float = 0.6,
                        rounds: int = 3, require_calibration: bool = False) -> dict:
    """``error_table`` of an emulated experiment's latest records. The kernel times are read from
    ``results/<experiment>/kernel_times.json``; keys it lacks are measured here (as many processes as
    the run had ranks, as many threads each as the worker used) and added to it.
    ``require_calibration``: refuse a run with given link rates and no compute calibration (nothing
    then carries the table to the run's load; ``experiments.run`` skips those, e.g. the emulator's tests)."""
    out = R.experiment_dir(Path(results_root), experiment)
    records = list(R.latest_by_case(R.read_records(out / R.RESULTS_FILE)).values())
    cases = _cases(records)
    if not cases:
        raise ValueError(f"experiment={experiment!r}: no ok records from an emulated cluster under {out}")
    if require_calibration and not all(calibration_key(c.rec["cluster"]) for c in cases):
        raise ValueError(f"experiment={experiment!r}: the run had given link rates and no compute calibration; "
                         f"compare by hand: python -m experiments.cluster report {experiment} --model")
    path = out / KERNEL_TIMES_FILE
    procs = max(c.shape.world_size for c in cases)
    threads = max(1, (os.cpu_count() or 1) // int(cases[0].rec["cluster"]["ranks_per_node"]))
    cpus = run_cpus(cases[0].rec["cluster"])
    times = KernelTimes.load(path) if path.exists() else None
    if times is None or times.cpus != cpus:       # a table timed under another cap is not this run's
        times = KernelTimes(procs=procs, threads=threads, seconds={}, cpus=cpus)
    call = load_call_cpu(results_root)
    missing = times.missing(needed_keys(records, call))
    if missing:
        if not measure_missing:
            raise ValueError(f"{path}: no measured time for {len(missing)} key(s), e.g. {missing[0]}")
        new = measure(missing, procs=procs, threads=threads, seconds=seconds, rounds=rounds, cpus=cpus)
        times = dataclasses.replace(times, seconds={**times.seconds, **new.seconds},
                                    samples={**times.samples, **new.samples}, host=new.host, cpus=new.cpus)
        times.save(path)
    ex = load_excess(results_root, cases[0].rec["cluster"].get("profile"))
    rep = error_table(compare(records, times, excess=ex["fit"] if ex else None, call=call))
    rep["kernel_times"] = str(path)
    rep["overlap_excess"] = ex
    rep["call_cpu"] = call and call["path"]
    rep["text"] += "\n" + (
        "overlap excess per transfer (the CPU a hop adds to its rank, fitted to " + ex["path"] + "): " + ", ".join(
            f"{k} {a * 1e3:.2f} ms + {b * 1e9:.2f} ns/B" for k, (a, b) in ex["fit"].items())
        if ex else f"no {OVERLAP_FILE} in the results root: hidden transfers cost the sender nothing")
    rep["text"] += "\n" + host_text(rep["rows"], call)
    rep["text"] += "\n" + (f"kernel times timed with each process capped at {times.cpus:g} CPU, as the run's ranks"
                           if times.cpus else "kernel times timed uncapped (the run's ranks were not capped, "
                           "or no cpu cgroup could be made here)")
    return rep


def host_text(rows: list[dict], call: dict | None) -> str:
    """One line: the host's work per op and per call of each method (``host_cost``), or why none."""
    if call is None:
        return f"no {CALL_CPU_FILE} in the results root: the host's work around each op costs nothing"
    per = {}
    for r in rows:
        if r.get("host"):
            per.setdefault(r["method"], r["host"])
    if not per:
        return f"{call['path']}: no call of the runs' methods at their world and node size (or the run was " \
               "not capped): the host's work around each op costs nothing"
    return (f"host work per op (CPU per call at a few tokens per rank, {call['path']}, / the rank's cap, less "
            "the model's own compute there): " + ", ".join(
                f"{m} {h['host_s_per_op'] * 1e3:.2f} ms x {h['ops']} ops (N={h['seqlen']}: {h['cpu_s'] * 1e3:.1f} ms "
                f"CPU / {h['cpus']:g} = {h['measured_s'] * 1e3:.0f} ms, model {h['model_s'] * 1e3:.0f} ms)"
                for m, h in sorted(per.items())))
