"""The inference model against the emulated runs: predicted / measured time of every decode and TTFT record.

The same terms as ``validate.py`` (nothing fitted for inference): this machine's kernel table at exactly the
work the schedules ask for (``decode_costs.DecodeEmulatedCosts``: a decode step's attention as
``partial_attention`` runs it, GEMMs at their shape, HBM), scaled to the load each group ran at (its reference
timed in its own rounds, ``validate.case_load``; the run's calibration at bring-up, ``validate.load_scale``, where a
record has none; ``at_reference=False``: the bring-up's for all, as reports before 2026-12-07), a decode step's
attention included (``memory_rule="compute"``; the stream's load with ``"bring-up"`` or ``"group"``); the links the
emulator shaped (``hardware.emulated_hardware``); the overlap excess per transfer (``excess.py``), and for the
merges' small messages what a blocking message holds its rank for (``message.py``, the message probe); and the
host's work per op (``host_cost.py``): a decode step's own, measured at a few tokens of context for the run's row,
world, node size and batch (``call_cpu.json``'s ``decode:<row>`` rows: ``burst-bench cluster calls``, or
``benchmarks.cpu_per_call`` over loopback), else (and for TTFT) that of ``burst``, the method whose communicator
and kernels a step runs. Nothing is fitted to the runs.

    rep = validate_inference(results_root, "cpu_decode_emulated_2x4")
    print(rep["text"]); rep["rows"], rep["worst_abs_error"], rep["met"]

Writes ``<experiment>/inference_validation.json`` (rows, worst error, terms) next to the records, which the
report's inference section reads.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

from baselines import AttnShape

from ...harness import results as R
from ..inference import decode_schedule, predict_inference
from ..model import predict_case
from .cases import SHAPE_KEYS, Predicted
from .costs import EmulatedCosts
from .decode_costs import decode_twin
from .excess import OVERLAP_FILE
from .hardware import emulated_hardware
from .host_cost import DECODE_PREFIX, decode_small_case, host_per_op, per_op_from, small_case
from .lockstep import factor, load_lockstep, lockstep_text
from .measured import KernelTimes, needed
from .message import MessageCost
from .send_buffer import SendBuffers
from .validate import (TARGET, calibration_key, host_text, kernel_times, load_probes, loads_of, memory_key,
                       compute_load_line, memory_line, messages_text, reference_key, run_cpus, sends_text,
                       small_call_costs)

HOST_METHOD = "burst"          # whose host work per op a decode step is charged (module docstring)
VALIDATION_FILE = "inference_validation.json"


class DecodeCase:
    """A measured inference record (``level: inference``, mode decode or ttft): its row, shape and tokens."""

    kind = "inference"

    @staticmethod
    def accepts(rec) -> bool:
        return rec.get("level") == "inference" and rec.get("mode") in ("decode", "ttft")

    def __init__(self, rec):
        self.rec = rec
        self.method, self.mode, self.row = rec["method"], rec["mode"], rec["variant"]
        self.new_tokens = int(rec.get("new_tokens") or 1)
        self.shape = AttnShape(**{k: rec[k] for k in SHAPE_KEYS})

    def predict(self, hardware, costs) -> Predicted:
        cost = decode_twin(costs(hardware, self.shape.dtype))
        p = predict_inference(self.row, self.shape, mode=self.mode, hardware=hardware, new_tokens=self.new_tokens,
                              costs=lambda h, dt: cost)
        return Predicted(p.time_s, p.critical_comm_s, p.critical_compute_s, dict(p.parts))


class SmallDecode:
    """A measured decode step at a few tokens of context (``host_cost.decode_small_case``): its schedule, and
    through ``predict`` the kernel-table keys it asks for (``measured.needed``)."""

    def __init__(self, small):
        self.small, self.shape = small, small.shape
        self.row = small.method.removeprefix(DECODE_PREFIX)

    def schedule(self, hardware, costs):
        ctx, _ = decode_schedule(self.row, self.shape, hardware, decode_twin(costs(hardware, self.shape.dtype)), 1)
        return ctx.sch

    def predict(self, hardware, costs) -> None:
        self.schedule(hardware, costs)


def _small_decode(call, c: DecodeCase, hw) -> SmallDecode | None:
    if c.mode != "decode":
        return None
    small = decode_small_case(call, c.row, world_size=c.shape.world_size, node_size=hw.devices_per_node,
                              dtype=c.shape.dtype, batch=c.shape.batch)
    return SmallDecode(small) if small is not None else None


def cases_of(records) -> list[DecodeCase]:
    return [DecodeCase(r) for r in records if r.get("status") == "ok" and (r.get("cluster") or {}).get("emulated")
            and DecodeCase.accepts(r)]


def needed_keys(records, call: dict | None = None) -> set:
    """Kernel-table keys of every case's prediction, the host term's small call and each run's calibration."""
    keys: set = set()
    for c in cases_of(records):
        hw = emulated_hardware(c.rec["cluster"], c.shape.dtype)
        keys |= needed([c], hw)
        small = small_case(call, HOST_METHOD, world_size=c.shape.world_size, dtype=c.shape.dtype,
                           node_size=int(c.rec["cluster"]["ranks_per_node"]))
        if small is not None:
            keys |= needed([small], hw, predict=predict_case)
        step = _small_decode(call, c, hw)
        if step is not None:
            keys |= needed([step], hw)
        keys |= {x for x in (calibration_key(c.rec["cluster"]), reference_key(c.rec), memory_key(c.rec))
                 if x is not None}
    return keys


def compare(records, times: KernelTimes, *, excess: dict | None = None, call: dict | None = None,
            messages: MessageCost | None = None, at_reference: bool = True, memory_rule: str = "compute",
            lockstep: dict | None = None, sends: SendBuffers | None = None) -> list[dict]:
    """One row per ok emulated decode/TTFT record: measured median, predicted, their error (module docstring);
    ``at_reference``, ``memory_rule`` and ``sends`` as ``validate.compare``'s; ``lockstep``
    (``lockstep.load_lockstep``) multiplies the work priced from the free-running table by its world size's
    factor."""
    rows, hosts = [], {}
    for c in cases_of(records):
        hw = emulated_hardware(c.rec["cluster"], c.shape.dtype)
        ld = loads_of(c.rec, times, at_reference=at_reference, memory_rule=memory_rule)  # host at the run's
        cpus = run_cpus(c.rec["cluster"])
        step = _small_decode(call, c, hw)
        key = (c.shape.world_size, c.shape.dtype, repr(hw), ld.run, ld.memory_run, step and (c.row, c.shape.batch))
        if key not in hosts:
            small_costs = small_call_costs(times, ld.run, excess, messages, cpus, mem_scale=ld.memory_run,
                                           sends=sends)
            if step is not None and cpus:
                host, source = per_op_from(step.small, step.schedule(hw, small_costs), cpus), step.small.method
            else:
                host, source = host_per_op(call, HOST_METHOD, world_size=c.shape.world_size, dtype=c.shape.dtype,
                                           node_size=hw.devices_per_node, hardware=hw, cpus=cpus,
                                           costs=small_costs), HOST_METHOD
            hosts[key] = host and {**host, "source": source}
        host = hosts[key]
        # the host term per op is derived free-running (the small call's CPU over the cap, less the model's work
        # there); the step's work meets its peers, and goes x the lockstep factor with the kernels it runs
        lf = factor(lockstep, c.shape.world_size)
        scale, mem, f = ld.at(lf)
        hs = (host["host_s_per_op"] if host else 0.0) * f
        p = c.predict(hw, lambda h, dt, sc=scale, hs=hs, mem=mem: EmulatedCosts(
            h, dt, times=times, scale=sc, mem_scale=mem, host_s=hs, excess=excess or {},
            messages=messages, sends=sends))
        measured = float(c.rec["time_median_s"])
        mean = c.rec.get("time_mean_s")      # TPOT as serving benchmarks report it: a mean over output tokens
        rows.append({"mode": c.mode, "row": c.row, "method": c.row, "seqlen": c.shape.seqlen, "batch": c.shape.batch,
                     "world_size": c.shape.world_size, "measured_s": measured, "predicted_s": p.time_s,
                     "ratio": p.time_s / measured, "error": p.time_s / measured - 1, "load_scale": ld.priced,
                     "lockstep_factor": lf,
                     "run_load": ld.run, "reference_load": ld.reference, "memory_load": ld.memory,
                     "memory_run_load": ld.memory_run, "memory_reference_load": ld.memory_reference,
                     "measured_mean_s": mean, "error_mean": None if not mean else p.time_s / float(mean) - 1,
                     "critical_comm_s": p.critical_comm_s, "host": host,
                     # the busiest rank's process CPU per step (records since 2026-12-04): the step's wall over it
                     # is the CPU share the rank ran at, which the model takes as the cap
                     "cpu_s": max(c.rec["time_cpu_s_per_rank"]) if c.rec.get("time_cpu_s_per_rank") else None,
                     "ci_s": [c.rec.get("time_ci_lo_s"), c.rec.get("time_ci_hi_s")]})
    return sorted(rows, key=lambda r: (r["mode"], r["world_size"], r["batch"], r["seqlen"], r["row"]))


def error_table(rows: list[dict], target: float = TARGET) -> dict:
    """Text and verdict: |error| <= target for every row (every context, batch and G measured), against the
    median step; the error against the mean step beside it (``error_mean``: the CFS quota's pauses, which the
    median leaves out where fewer than half the steps meet one, are in the mean; docs/inference.md)."""
    worst = max((abs(r["error"]) for r in rows), default=math.nan)
    ok = bool(rows) and all(abs(r["error"]) <= target for r in rows)
    lines = ["inference model (experiments.perfmodel.inference) vs measured, this machine as emulated: the kernel "
             "table at the schedules' work (a decode step's attention as partial_attention runs it), x the load "
             "(the group's reference, else the bring-up's), links as shaped; nothing fitted for inference",
             f"{'mode':<6} {'G':>2} {'B':>3} {'N':>8} {'row':<14} {'measured ms':>11} {'predicted ms':>12} "
             f"{'error':>7} {'crit. comm ms':>13}       {'mean ms':>8} {'vs mean':>7}"]
    cpu = any(r.get("cpu_s") is not None for r in rows)
    if cpu:
        lines[-1] += f" {'CPU ms':>7} {'share':>5}"
    for r in rows:
        flag = "  ok " if abs(r["error"]) <= target else "  OUT"
        mean = "" if r.get("error_mean") is None else f"{r['measured_mean_s'] * 1e3:8.2f} {r['error_mean']:+7.1%}"
        if cpu:      # the busiest rank's CPU per step and the share of a core it ran at over the median step
            c = r.get("cpu_s")
            mean = (mean or " " * 16) + (f" {c * 1e3:7.2f} {c / r['measured_s']:5.2f}" if c is not None
                                         else f" {'-':>7} {'-':>5}")
        lines.append(f"{r['mode']:<6} {r['world_size']:>2} {r['batch']:>3} {r['seqlen']:>8} {r['row']:<14} "
                     f"{r['measured_s'] * 1e3:11.2f} {r['predicted_s'] * 1e3:12.2f} {r['error']:+7.1%} "
                     f"{r['critical_comm_s'] * 1e3:13.2f}{flag}  {mean}")
    lines.append(f"target |error| <= {target:.0%} for every row: {'met' if ok else 'NOT met'} (worst {worst:.1%})")
    lines += [x for x in (compute_load_line(rows), memory_line(rows)) if x]
    means = [abs(r["error_mean"]) for r in rows if r.get("error_mean") is not None]
    if means:
        lines.append(f"against the mean step: {sum(e <= target for e in means)} of {len(means)} rows within "
                     f"{target:.0%} (worst {max(means):.1%}); the verdict above is the median's")
    return {"rows": rows, "worst_abs_error": worst, "met": ok, "text": "\n".join(lines)}


def is_inference(results_root, experiment: str) -> bool:
    """Whether ``experiment``'s records under ``results_root`` are all decode / TTFT / KV-capacity records (level
    inference), which ``validate_inference`` compares rather than ``validate.validate_experiment``."""
    df = R.load_results(results_root, experiment)
    return not df.empty and "level" in df and bool((df["level"] == "inference").all())


def validate_inference(results_root, experiment: str, *, measure_missing: bool = True, seconds: float = 0.6,
                       rounds: int = 3, write: bool = True, at_reference: bool = True,
                       memory_rule: str = "compute") -> dict:
    """``error_table`` of an emulated inference experiment's latest records, written to ``VALIDATION_FILE``
    unless ``write`` is False; ``at_reference`` and ``memory_rule`` as ``compare``'s."""
    out = R.experiment_dir(Path(results_root), experiment)
    records = list(R.latest_by_case(R.read_records(out / R.RESULTS_FILE)).values())
    cases = cases_of(records)
    if not cases:
        raise ValueError(f"experiment={experiment!r}: no ok decode or ttft records of an emulated run under {out}")
    profile = cases[0].rec["cluster"].get("profile")
    call, ex, msgs, sends = load_probes(results_root, experiment, profile)
    lock = load_lockstep(results_root, profile, experiment)
    times = kernel_times(out, cases, needed_keys(records, call), measure_missing=measure_missing, seconds=seconds,
                         rounds=rounds)
    rep = error_table(compare(records, times, excess=ex["fit"] if ex else None, call=call, messages=msgs,
                              lockstep=lock, at_reference=at_reference, memory_rule=memory_rule, sends=sends))
    rep["text"] += "\n" + lockstep_text(lock)
    rep["text"] += "\n" + (f"overlap excess fitted to {ex['path']}" if ex else
                           f"no {OVERLAP_FILE} in the results root: hidden transfers cost the sender nothing")
    rep["text"] += "\n" + messages_text(msgs)
    rep["text"] += "\n" + sends_text(sends)
    labelled = [{**r, "method": f"{r['host'] and r['host']['source']} (G {r['world_size']}, B {r['batch']})"}
                for r in rep["rows"]]
    rep["text"] += "\n" + host_text(labelled, call)
    summary = {"experiment": experiment, "target": TARGET, "met": rep["met"], "worst_abs_error": rep["worst_abs_error"],
               "rows": [{**{k: v for k, v in r.items() if k != "host"},
                         "host_s_per_op": (r["host"] or {}).get("host_s_per_op", 0.0),
                         "host_source": (r["host"] or {}).get("source")}
                        for r in rep["rows"]],
               "host_s_per_op": next((r["host"]["host_s_per_op"] for r in rep["rows"] if r.get("host")), 0.0),
               "overlap_excess": ex and ex["path"], "messages": msgs and msgs.path, "call_cpu": call and call["path"],
               "lockstep": lock, "sends": sends and sends.path,
               "text": rep["text"]}
    if write:
        (out / VALIDATION_FILE).write_text(json.dumps(summary, indent=1, default=str))
    return rep


REPORT_FILE = "emulation_report.txt"       # as cluster/report.py names an emulated run's report


def write_report(results_root, experiment: str) -> str:
    """``validate_inference``'s text (or why there is none) as the run's ``emulation_report.txt``."""
    try:
        text = f"{experiment}\n" + validate_inference(results_root, experiment)["text"]
    except (ValueError, RuntimeError) as e:        # nothing emulated measured, or a kernel timing failed
        text = f"{experiment}: the inference model was not compared: {e}"
    out = R.experiment_dir(Path(results_root), experiment)
    if out.is_dir():
        (out / REPORT_FILE).write_text(text + "\n")
    return text
