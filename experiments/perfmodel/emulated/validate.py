"""The model against our own measurements: predicted / measured time per case of an emulated-cluster run.

The profile is THIS machine as the run emulated it (``costs.EmulatedCosts``):

* compute: the kernel times ``measured.py`` takes here, at exactly the block
  shapes, GEMMs and memory traffic the schedules ask for, with as many
  concurrent processes and threads as the run had ranks on this machine,
  each capped at the run's CPU share per rank (``cluster.cpu_quota``);
* load: the table carried to the load each group of cases ran at: the group's reference, the
  calibration's work timed in the group's own rounds (``harness/reference.py``), over the table's
  time for it (``case_load``); where a record has none, or one too short, the run's calibration at
  bring-up over the table's (``load_scale``). The machine's rate moves within a run; over every
  committed run with references, pricing at them did better overall than at the bring-up load,
  though not in every run (docs/findings.md, "Each group at its own reference"). ``at_reference=False`` prices at the
  bring-up load, as reports before 2026-12-07 did;
* memory: memory traffic and a decode step's attention at the compute load above (``memory_rule="compute"``, the
  rule since 2026-12-07): over the seven decode runs that carry both, the groups' compute references followed the
  decode steps and the stream did not (docs/findings.md, "Memory-bound work at the group's compute load").
  ``memory_rule="bring-up"`` prices it at the run's memory load (``memory_load``: the stream the calibration timed at
  bring-up over the table's, the rule of 2026-12-06), ``"group"`` at the group's own stream (``case_memory_load``,
  since 2026-12-06 14:41); both loads are reported beside each row;
* links: the per-rank rates, latency and NICs the emulator shaped, read from
  the records' ``cluster`` block (``hardware.emulated_hardware``);
* overlap: what a transfer takes from its sender's compute while it runs
  under it, fitted per link class to the overlap probe's CPU excess
  (``excess.py``, from ``<results root>/overlap_probe.json``). Without that
  file hidden transfers are free, as on a GPU;
* small messages: what a blocking message of up to tens of KiB holds its
  rank for, fitted to the message probe (``message.py``, from ``<results
  root>/message_probe.json``), in place of the overlap excess in its range.
  Without that file the excess line covers every size;
* host: the CPU a call costs each rank beside its kernels and transfers, per
  op (``host_cost.py``, from ``<results root>/call_cpu.json``, written by
  ``python -m benchmarks.cpu_per_call --out``). Without that file it is free.

Everything else is the model as it predicts the papers' clusters (same
schedules, simulator, byte placement). ``error = predicted / measured - 1``;
the issue's target is |error| <= 20% for every method at the two largest N.
Each record is predicted as its kind of step (``cases.py``): an attention op
or layer, or a whole model's training step (``level: model``,
``model_level.predict_model`` with the record's loss, checkpoint and weights).

    rows = compare(records, times)          # records: dicts of results.jsonl (ok, emulated)
    print(error_table(rows)["text"])
"""
from __future__ import annotations

import math
import os
import statistics
import dataclasses
from dataclasses import dataclass
from pathlib import Path

from baselines import AttnShape

from burst_impl.flops import attention_flops
from ...harness import reference
from ...harness import results as R
from ..model import predict_case
from .cases import SHAPE_KEYS, case_of
from .costs import EmulatedCosts
from .excess import OVERLAP_FILE, excess_text, load_excess
from .hardware import emulated_hardware
from .host_cost import (CALL_CPU_FILE, CALL_LAYOUTS, CALL_METHOD, STEP_MASK, SmallCase, host_per_op,
                        load_call_cpu, per_call_host, small_case)
from .measured import HBM, KernelTimes, default_clock, measure, needed
from .message import MESSAGE_FILE, MessageCost, for_host, load_messages
from .send_buffer import SEND_FILE, SendBuffers, load_send_buffers
from .cfs import CfsShare
from .lockstep import factor, load_lockstep, lockstep_text

TARGET = 0.20                     # the acceptance bound on |predicted / measured - 1|
__all__ = ["SHAPE_KEYS", "compare", "error_table", "needed_keys", "validate_experiment"]


def _cases(records) -> list:
    """The cases (``cases.py``) of the ok records from an emulated cluster."""
    return [c for c in (case_of(r) for r in records) if c is not None]


def _block_key(work: dict) -> tuple:
    """The kernel-table key of fwd+bwd of one full ``tokens x tokens`` block (``harness.reference.block_step``)."""
    return ("attention", 1, int(work["heads"]), int(work["head_dim"]), int(work["tokens"]), int(work["tokens"]),
            False, "fwd_bwd", work["dtype"])


def calibration_key(cluster: dict) -> tuple | None:
    """The work the emulator timed at bring-up (fwd+bwd of one full block, ``emulation._bench``)."""
    c = cluster.get("calibration") or {}
    if not c.get("per_rank_flops_s"):
        return None
    return _block_key(c)


def reference_key(rec: dict) -> tuple | None:
    """The work a record's group timed in its rounds (``time_reference``, ``harness/reference.py``), or None."""
    ref = rec.get("time_reference") or {}
    return _block_key(ref["work"]) if ref.get("work") and ref.get("median_s") else None


def load_scale(cluster: dict, times: KernelTimes) -> float:
    """Run-time / table-time of the calibration work: how much slower (> 1) or faster this machine
    computed during the run than while the table was measured (its load differs). 1 when the
    run has no calibration or the table lacks its key."""
    key = calibration_key(cluster)
    if key is None or key not in times.seconds:
        return 1.0
    flops = attention_flops(AttnShape(key[1], key[4], key[2], key[2], key[3], 1, causal=False), mode="fwd_bwd")
    return flops / float(cluster["calibration"]["per_rank_flops_s"]) / times.seconds[key]


def memory_load(cluster: dict, times: KernelTimes) -> float | None:
    """Run-time / table-time of a byte of memory traffic (``harness.reference.stream_step``, the table's
    ``("hbm",)`` work), timed at bring-up beside the calibration's block: memory-bound work goes at it
    (``EmulatedCosts.mem_scale``), since this machine's memory rate moves apart from its compute rate
    (docs/findings.md, "The memory rate apart from the compute rate"). None for a run whose calibration did
    not time it (before 2026-12-06) or a table without the key: that work then goes at ``load_scale``."""
    per_byte = (cluster.get("calibration") or {}).get("per_rank_memory_s_per_byte")
    if not per_byte or HBM not in times.seconds:
        return None
    return float(per_byte) / times.seconds[HBM]


def case_load(rec: dict, times: KernelTimes) -> float | None:
    """The load a record's group ran at: its reference's median (the calibration's work timed in the group's own
    rounds, the slowest rank's) over the table's time for that work; None for a record without one (before
    2026-12-06), a table without its key, or a reference shorter than two CFS periods (``reference.long_enough``:
    it measured the quota's burst). The machine's rate moves within a run (docs/findings.md, "A reference in
    every group's rounds")."""
    key = reference_key(rec)
    if key is None or key not in times.seconds or not reference.long_enough(rec["time_reference"], rec["cluster"]):
        return None
    return float(rec["time_reference"]["median_s"]) / times.seconds[key]


def memory_key(rec: dict) -> tuple | None:
    """The table's memory key where a record's run timed the memory rate (``memory_load``, ``case_memory_load``)."""
    return HBM if (rec["cluster"].get("calibration") or {}).get("per_rank_memory_s_per_byte") else None


def case_memory_load(rec: dict, times: KernelTimes) -> float | None:
    """The memory load a record's group ran at: its memory reference's median (``stream_step`` timed in the group's
    own rounds, the slowest rank's seconds a call, ``harness.reference.memory_step_for``) over the table's time for
    those bytes; None for a record without one (before 2026-12-06 14:41), a table without the key, or a sample shorter
    than two CFS periods."""
    ref = rec.get("time_memory_reference") or {}
    if not ref.get("median_s") or HBM not in times.seconds or not reference.long_enough(ref, rec["cluster"]):
        return None
    return float(ref["median_s"]) / (int(ref["bytes"]) * times.seconds[HBM])


MEMORY_RULES = ("compute", "bring-up", "group")     # the load memory-bound work goes at (``loads_of``)


@dataclass(frozen=True)
class Loads:
    """The loads one record is priced at: ``run`` (``load_scale``; 1 without ``rescale``), ``reference``
    (``case_load``, reported), ``memory_run`` (``memory_load``, the bring-up's), ``memory_reference``
    (``case_memory_load``, the group's own rounds'), ``priced``, the kernels' load (the reference's where the
    record has one, unless ``at_reference`` is False; else the run's) and ``memory``, the load memory-bound work is
    priced at: None (at ``priced``) under the memory rule ``"compute"``; the bring-up's under ``"bring-up"``; the
    group's memory reference under ``"group"`` where the record has one, else the bring-up's. The host terms are
    derived at ``run`` and ``memory_run`` (their probes were taken near bring-up) and carried by ``priced / run``."""

    run: float
    reference: float | None
    memory_run: float | None
    memory_reference: float | None
    priced: float
    memory: float | None

    def at(self, lockstep: float = 1.0) -> tuple[float, float | None, float]:
        """(the kernels' scale, memory-bound work's (None: the kernels'), the host terms' factor ``priced / run``),
        each x ``lockstep``: ranks that meet their peers run all their CPU work at the lockstep share
        (``lockstep.factor``; 1: free-running)."""
        return (self.priced * lockstep, None if self.memory is None else self.memory * lockstep,
                self.priced / self.run * lockstep)


def check_memory_rule(memory_rule: str) -> None:
    if memory_rule not in MEMORY_RULES:
        raise ValueError(f"memory_rule={memory_rule!r} must be one of {', '.join(MEMORY_RULES)} (the load "
                         "memory-bound work is priced at)")


def loads_of(rec: dict, times: KernelTimes, *, at_reference: bool = True, rescale: bool = True,
             memory_rule: str = "compute") -> Loads:
    check_memory_rule(memory_rule)
    run = load_scale(rec["cluster"], times) if rescale else 1.0
    ref = case_load(rec, times)
    mem_run = memory_load(rec["cluster"], times) if rescale else None
    mem_ref = case_memory_load(rec, times) if rescale else None
    memory = {"compute": None, "bring-up": mem_run,
              "group": mem_ref if mem_ref is not None else mem_run}[memory_rule]
    return Loads(run=run, reference=ref, memory_run=mem_run, memory_reference=mem_ref,
                 priced=ref if at_reference and rescale and ref is not None else run, memory=memory)


def _small(call: dict | None, c, method: str | None = None, layout: str | None = None,
           mask: str | None = None) -> SmallCase | None:
    """The measured small call of ``method`` (the record's own by default) at the record's world and node size."""
    return small_case(call, method or c.method, world_size=c.shape.world_size, dtype=c.shape.dtype,
                      node_size=int(c.rec["cluster"]["ranks_per_node"]), layout=layout, mask=mask)


def small_call_costs(times: KernelTimes, scale: float, excess: dict | None, messages: MessageCost | None,
                     cpus: float | None, call_host_s: float = 0.0, mem_scale: float | None = None,
                     sends: SendBuffers | None = None):
    """The cost model of a small call measured as CPU (``host_cost``): no host per op (that is what it
    measures), its messages at their CPU (``message.for_host``)."""
    return lambda h, dt: EmulatedCosts(h, dt, times=times, scale=scale, mem_scale=mem_scale, excess=excess or {},
                                       messages=for_host(messages, cpus), call_host_s=call_host_s, sends=sends)


def needed_keys(records, call: dict | None = None) -> set:
    """The kernel-time keys the schedules of ``records`` need (measure them with ``measured.measure``),
    with each run's calibration work (``load_scale``) and the calls of ``call`` (``host_cost``) that
    match them."""
    keys: set = set()
    for c in _cases(records):
        hw = emulated_hardware(c.rec["cluster"], c.shape.dtype)
        keys |= needed([c], hw)
        own = _small(call, c)
        smalls = [own, own and _small(call, c, layout=own.shape.layout, mask=STEP_MASK)] + [
            _small(call, c, CALL_METHOD, x) for x in CALL_LAYOUTS]
        for small in (s for s in smalls if s is not None):
            keys |= needed([small], hw, predict=predict_case)
        keys |= {x for x in (calibration_key(c.rec["cluster"]), reference_key(c.rec), memory_key(c.rec))
                 if x is not None}
    return keys


def compare(records, times: KernelTimes, *, rescale: bool = True, excess: dict | None = None,
            call: dict | None = None, messages: MessageCost | None = None, at_reference: bool = True,
            memory_rule: str = "compute", sends: SendBuffers | None = None, cfs: bool = False,
            lockstep: dict | None = None) -> list[dict]:
    """One row per ok emulated record: measured median, predicted time, their ratio and error.
    ``rescale``: carry the kernel times to the run's load (``load_scale``); ``excess``: the links'
    overlap excess (``fit_excess``; None: hidden transfers are free); ``call``: the per-call CPU
    (``host_cost.load_call_cpu``; None: the host's work is free); ``messages``: small blocking
    messages (``message.fit_messages``; None: the excess line for every size); ``at_reference``: price each
    record at its group's reference's load (``case_load``) where it has one (False: at the run's bring-up load);
    ``memory_rule``: the load memory-bound work goes at (``loads_of``: the compute load, the bring-up's memory load
    or the group's own); ``sends``: what a ring's send holds its sender for (``send_buffer.fit_send_buffers``;
    None: until it lands); ``cfs``: the ranks' compute under CFS as a fluid (``cfs.CfsShare``, opt-in; False: at the
    cap's rate); ``lockstep`` (``lockstep.load_lockstep``, opt-in): the work priced from the free-running table and
    the host terms x the world size's lockstep factor, as a decode step's (``validate_decode``): a ring's ranks meet
    their peers at every step."""
    rows, hosts, per_call = [], {}, {}
    excess = excess or {}
    for c in _cases(records):
        hw = emulated_hardware(c.rec["cluster"], c.shape.dtype)
        ld = loads_of(c.rec, times, at_reference=at_reference, rescale=rescale, memory_rule=memory_rule)
        cpus = run_cpus(c.rec["cluster"])
        run = (c.shape.world_size, c.shape.dtype, repr(hw), ld.run, ld.memory_run, cpus)
        if run not in per_call:       # the host per kernel call: once per run, from burst's two layouts
            per_call[run] = per_call_host(call, world_size=c.shape.world_size, dtype=c.shape.dtype, cpus=cpus,
                                          node_size=hw.devices_per_node, hardware=hw,
                                          costs=small_call_costs(times, ld.run, excess, messages, cpus,
                                                                 mem_scale=ld.memory_run, sends=sends))
        ch = per_call[run]["call_host_s"] if per_call[run] else 0.0
        key = (c.method, *run)
        if key not in hosts:          # one small-call prediction per method and run, whatever its cases
            hosts[key] = host_per_op(call, c.method, world_size=c.shape.world_size, dtype=c.shape.dtype,
                                     node_size=hw.devices_per_node, hardware=hw, cpus=cpus, steps=True,
                                     costs=small_call_costs(times, ld.run, excess, messages, cpus, ch,
                                                            ld.memory_run, sends))
        host = hosts[key]
        hs = host["host_s_per_op"] if host else 0.0
        hstep = host.get("host_s_per_step", 0.0) if host else 0.0
        lf = factor(lockstep, c.shape.world_size)
        scale, mem, f = ld.at(lf)
        share = CfsShare.of(c.rec["cluster"], c.shape.world_size) if cfs else None
        p = c.predict(hw, lambda h, dt, sc=scale, mem=mem, hs=hs * f, ch=ch * f, st=hstep * f, share=share:
                      EmulatedCosts(h, dt, times=times, scale=sc, mem_scale=mem, host_s=hs, call_host_s=ch,
                                    step_host_s=st, excess=excess, messages=messages, sends=sends, cfs=share))
        measured = float(c.rec["time_median_s"])
        cpu = c.rec.get("time_cpu_s_per_rank")
        main = c.rec.get("time_cpu_main_s_per_rank")
        rows.append({"seqlen": c.shape.seqlen, "method": c.label, "world_size": c.shape.world_size,
                     "case": " ".join(x for x in (c.shape.layout, "causal" if c.shape.causal else "full",
                                                  c.shape.mask) if x), "kind": c.kind,
                     "measured_s": measured, "predicted_s": p.time_s,
                     "ratio": p.time_s / measured if measured > 0 else math.nan,
                     "error": p.time_s / measured - 1 if measured > 0 else math.nan,
                     "load_scale": ld.priced, "lockstep_factor": lf, "run_load": ld.run, "reference_load": ld.reference,
                     "memory_load": ld.memory, "memory_run_load": ld.memory_run,
                     "memory_reference_load": ld.memory_reference,
                     "critical_comm_s": p.critical_comm_s,
                     "critical_compute_s": p.critical_compute_s, "parts_s": p.parts, "host": host,
                     "call_host": per_call[run],
                     # the busiest rank's measured CPU per step at its cap: a step this long spends the whole quota
                     "cpu_at_cap_s": max(cpu) / cpus if cpu and cpus else None,
                     # per rank, the timing thread's CPU at the cap (kernels, host) against the model's work on
                     # the compute stream, and the rest of the CPU (gloo's threads) against its transfers' excess
                     "main_at_cap_s_per_rank": [m / cpus for m in main] if main and cpus else None,
                     "rest_at_cap_s_per_rank": ([(x - m) / cpus for x, m in zip(cpu, main)]
                                                if main and cpu and cpus else None),
                     "work_s_per_rank": list(p.work_s_per_rank), "held_s_per_rank": list(p.held_s_per_rank),
                     "samples": list(c.rec.get("time_samples_s") or [])})
    return sorted(rows, key=lambda r: (r["seqlen"], r["method"]))


def _width(rows: list[dict]) -> int:
    return max([12] + [len(r["method"]) for r in rows])


def error_table(rows: list[dict], target: float = TARGET) -> dict:
    """Text table and verdict: is |error| <= target for every method at the two largest N?"""
    w = _width(rows)
    ns = sorted({r["seqlen"] for r in rows})
    top = ns[-2:]
    judged = [r for r in rows if r["seqlen"] in top]
    worst = max((abs(r["error"]) for r in judged), default=math.nan)
    ok = bool(judged) and all(abs(r["error"]) <= target for r in judged)
    lines = ["performance model (experiments.perfmodel) vs measured, this machine as emulated: compute from "
             "kernel times measured here at the schedules' block shapes (x load = the time of the calibration's "
             "work in the group's own rounds, else at the run's bring-up, / the table's for it), links at the shaped "
             "per-rank rates",
             f"{'N':>6} {'method':<{w}} {'measured s':>10} {'predicted s':>11} {'pred/meas':>9} {'error':>7} "
             f"{'crit. comm s':>12} {'load':>5}"]
    # a spec sweeping layouts or masks (cpu_sparse_masks, cpu_varlen_magiattention_2x4: causal and full too) has
    # several rows per (N, method): say which
    cases = len({r.get("case", "") for r in rows}) > 1
    # records with each rank's CPU per step (measured since 2026-12-04): the busiest rank's CPU at its cap, and the
    # model's compute on its critical path, so a miss reads as CPU work the model lacks or waiting it lacks
    cpu = any(r.get("cpu_at_cap_s") is not None for r in rows)
    if cpu:
        lines[-1] += f" {'CPU/cap s':>9} {'crit. comp s':>12}"
    # records with the timing thread's CPU too (since 2026-12-05): that thread's CPU at the cap against the model's
    # work on the compute stream, and the rest (gloo's threads) against the transfers' excess; busiest rank of each
    threads = any(r.get("main_at_cap_s_per_rank") for r in rows)
    if threads:
        lines[-1] += f" {'main/cap':>8} {'work':>6} {'rest/cap':>8} {'held':>6}"
    if cases:
        lines[-1] += "  case"
    for r in rows:
        flag = "" if r["seqlen"] not in top else ("  ok" if abs(r["error"]) <= target else "  OUT")
        flag += f"  {r.get('case', '')}" if cases else ""
        busy = "" if not cpu else (f" {r['cpu_at_cap_s']:9.3f}" if r.get("cpu_at_cap_s") is not None
                                   else f" {'-':>9}") + f" {r['critical_compute_s']:12.3f}"
        busy += "" if not threads else _threads_cells(r)
        lines.append(f"{r['seqlen']:>6} {r['method']:<{w}} {r['measured_s']:10.3f} {r['predicted_s']:11.3f} "
                     f"{r['ratio']:9.2f} {r['error']:+7.1%} {r['critical_comm_s']:12.3f} {r['load_scale']:5.2f}"
                     f"{busy}{flag}")
    lines += parts_lines(rows)
    n_txt = ", ".join(str(n) for n in top) or "-"
    lines.append(f"target |error| <= {target:.0%} for every method at the two largest N ({n_txt}): "
                 f"{'met' if ok else 'NOT met'} (worst {worst:.1%})"
                 + ("" if len(ns) >= 2 else "; only one N was measured"))
    lines.append(spread_line(judged))
    lines += [x for x in (compute_load_line(rows), memory_line(rows)) if x]
    return {"rows": rows, "largest_n": top, "worst_abs_error": worst, "met": ok, "text": "\n".join(lines)}


def _threads_cells(r: dict) -> str:
    """The busiest rank's timing-thread CPU at the cap, the model's most work on a rank, the busiest rank's other
    threads' CPU at the cap, the model's most excess on a rank; '-' where the record or the model has none."""
    vals = (r.get("main_at_cap_s_per_rank"), r.get("work_s_per_rank"), r.get("rest_at_cap_s_per_rank"),
            r.get("held_s_per_rank"))
    return "".join(f" {max(v):{w}.3f}" if v else f" {'-':>{w}}" for v, w in zip(vals, (8, 6, 8, 6)))


def compute_load_line(rows: list[dict]) -> str | None:
    """The compute load(s) the rows' kernels were priced at: each group's own reference's or the bring-up's (None:
    rows without loads)."""
    bring = sorted({round(r["run_load"], 2) for r in rows if r.get("run_load") is not None})
    if not bring:
        return None
    own = [r["load_scale"] for r in rows if r.get("reference_load") is not None
           and r["load_scale"] == r["reference_load"]]
    runs = ", ".join(f"{x:.2f}" for x in bring)
    if not own:
        return (f"compute at the run's bring-up load {runs} (no group reference priced: none recorded, one too short, "
                "or the bring-up load asked for)")
    rest = len(rows) - len(own)
    return (f"compute at each group's own reference load for {len(own)} of {len(rows)} rows ({min(own):.2f}-"
            f"{max(own):.2f}; the run's bring-up load {runs}" + (f", priced for the other {rest})" if rest else
                                                                  ", not priced)"))


def memory_line(rows: list[dict]) -> str:
    """The load the rows' memory-bound work went at: the compute load (``memory_load`` None: the memory rule
    "compute", or a run with no memory rate) or a stream's (``memory_load``), with the streams not priced beside."""
    loads = sorted({round(r["memory_load"], 3) for r in rows if r.get("memory_load") is not None})
    bring = sorted({round(r["memory_run_load"], 2) for r in rows if r.get("memory_run_load") is not None})
    refs = sorted(r["memory_reference_load"] for r in rows if r.get("memory_reference_load") is not None)
    bring_text = ", ".join(f"{x:.2f}" for x in bring)
    if not loads:
        if not bring and not refs:
            return ("memory traffic at the compute load: the run has no memory rate (a calibration before 2026-12-06, "
                    "or given link rates)")
        beside = ([f"bring-up {bring_text}"] if bring else []) + (
            [f"the groups' memory references {refs[0]:.2f}-{refs[-1]:.2f}"] if refs else [])
        return ("memory traffic and a decode step's attention at the compute load (memory rule \"compute\", since "
                f"2026-12-07); the stream's loads, not priced: {'; '.join(beside)}")
    compute = sorted({round(r["run_load"], 2) for r in rows})
    span = f"{loads[0]:.2f}" if len(loads) == 1 else f"{loads[0]:.2f}-{loads[-1]:.2f}"
    grouped = [r for r in rows if r.get("memory_reference_load") is not None
               and r.get("memory_load") == r.get("memory_reference_load")]
    source = (f"the groups' own memory references for {len(grouped)} of {len(rows)} rows, the bring-up's "
              f"({bring_text}) for the rest" if grouped else "the run's bring-up memory rate over the table's")
    beside = ("" if grouped or not refs else
              f"; the groups' memory references, not priced: {refs[0]:.2f}-{refs[-1]:.2f}")
    return (f"memory traffic and a decode step's attention at the memory load {span} ({source}; bring-up compute "
            f"load {', '.join(f'{x:.2f}' for x in compute)}{beside})")


SPREAD_BOUNDS = (0.10, 0.15, 0.20)   # the bounds issues set on this model (15%: the mask benchmark, issue 37)


def spread_line(rows: list[dict]) -> str:
    """How the judged rows' errors spread: how many lie within each of ``SPREAD_BOUNDS``, and the median |error|."""
    errs = sorted(abs(r["error"]) for r in rows)
    if not errs:
        return "no rows judged"
    within = ", ".join(f"{sum(e <= b for e in errs)} within {b:.0%}" for b in SPREAD_BOUNDS)
    return f"of the {len(errs)} judged rows: {within}; median |error| {statistics.median(errs):.1%}"


def parts_lines(rows: list[dict]) -> list[str]:
    """Where a whole model's predicted step goes (``model_level.predict_model``'s parts), one line per row."""
    model = [r for r in rows if r.get("parts_s")]
    if not model:
        return []
    out = ["whole-model steps (model_level.predict_model; FSDP2's collectives blocking, zero3_exposed; not in "
           "it: FSDP2's hooks' host work, the optimizer step, the embedding, the loss's elementwise work), "
           "predicted seconds by part:"]
    for r in model:
        out.append(f"{r['seqlen']:>6} {r['method']:<{_width(rows)}} " + ", ".join(
            f"{k} {v:.3f}" for k, v in r["parts_s"].items() if v))
    return out


KERNEL_TIMES_FILE = "kernel_times.json"


def run_cpus(cluster: dict) -> float | None:
    """The CPU cap each rank of the run had (``cluster.cpu_quota``), None when uncapped: the kernel
    table is timed under the same cap."""
    q = cluster.get("cpu_quota") or {}
    return float(q["cpus_per_rank"]) if q.get("applied") and q.get("cpus_per_rank") else None


def kernel_times(out: Path, cases, keys: set, *, measure_missing: bool = True, seconds: float = 0.6,
                 rounds: int = 3) -> KernelTimes:
    """The experiment's kernel table (``out/kernel_times.json``) with the ``keys`` it lacks measured here: as many
    processes as the run had ranks, as many threads each as the worker used, each under the run's CPU cap (a
    table timed under another cap is not this run's and is timed afresh), on the table's own clock (a table
    timed afresh: ``measured.default_clock``)."""
    path = out / KERNEL_TIMES_FILE
    procs = max(c.shape.world_size for c in cases)
    threads = max(1, (os.cpu_count() or 1) // int(cases[0].rec["cluster"]["ranks_per_node"]))
    cpus = run_cpus(cases[0].rec["cluster"])
    times = KernelTimes.load(path) if path.exists() else None
    if times is None or times.cpus != cpus:
        times = KernelTimes(procs=procs, threads=threads, seconds={}, cpus=cpus, clock=default_clock(cpus))
    missing = times.missing(keys)
    if missing:
        if not measure_missing:
            raise ValueError(f"{path}: no measured time for {len(missing)} key(s), e.g. {missing[0]}")
        new = measure(missing, procs=procs, threads=threads, seconds=seconds, rounds=rounds, cpus=cpus,
                      clock=times.clock)
        if new.clock != times.clock:       # no cgroup here now: the table's clock cannot be kept
            raise RuntimeError(f"{path}: its keys are timed on the {times.clock} clock and the missing ones could "
                               f"only be timed on the {new.clock} clock here (no cpu cgroup)")
        times = dataclasses.replace(times, seconds={**times.seconds, **new.seconds},
                                    samples={**times.samples, **new.samples}, host=new.host, cpus=new.cpus,
                                    wall={**times.wall, **new.wall})
        times.save(path)
    return times


def load_probes(results_root, experiment: str, profile: str | None) -> tuple[dict | None, dict | None,
                                                                            MessageCost | None, SendBuffers | None]:
    """(call CPU, overlap excess, message cost, send buffers) a validation prices ``experiment``'s run with: each the
    experiment's own file where it has one, else the results root's (``excess.probe_path``)."""
    return (load_call_cpu(results_root, experiment), load_excess(results_root, profile, experiment),
            load_messages(results_root, profile, experiment), load_send_buffers(results_root, profile, experiment))


def validate_experiment(results_root, experiment: str, *, measure_missing: bool = True, seconds: float = 0.6,
                        rounds: int = 3, require_calibration: bool = False, at_reference: bool = True,
                        memory_rule: str = "compute", cfs: bool = False, lockstep: bool = False) -> dict:
    """``error_table`` of an emulated experiment's latest records (``at_reference``, ``memory_rule``, ``cfs``:
    ``compare``'s; ``lockstep``: price with the experiment's (or the root's) lockstep probe, ``compare``'s). The
    kernel times are read from ``results/<experiment>/kernel_times.json``; keys it lacks are measured here (as many
    processes as the run had ranks, as many threads each as the worker used) and added to it.
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
    profile = cases[0].rec["cluster"].get("profile")
    call, ex, msgs, sends = load_probes(results_root, experiment, profile)
    times = kernel_times(out, cases, needed_keys(records, call), measure_missing=measure_missing, seconds=seconds,
                         rounds=rounds)
    lock = load_lockstep(results_root, profile, experiment) if lockstep else None
    rep = error_table(compare(records, times, excess=ex["fit"] if ex else None, call=call, messages=msgs,
                              at_reference=at_reference, memory_rule=memory_rule, sends=sends, cfs=cfs,
                              lockstep=lock))
    rep["kernel_times"] = str(path)
    rep["overlap_excess"] = ex
    rep["messages"] = msgs and msgs.path
    rep["call_cpu"] = call and call["path"]
    rep["sends"] = sends and sends.path
    rep["text"] += "\n" + (
        "overlap excess per transfer (the CPU a hop adds to its rank, fitted to " + ex["path"] + "): "
        + excess_text(ex["fit"])
        if ex else f"no {OVERLAP_FILE} in the results root: hidden transfers cost the sender nothing")
    rep["text"] += "\n" + messages_text(msgs)
    rep["text"] += "\n" + sends_text(sends)
    rep["text"] += "\n" + host_text(rep["rows"], call)
    if lockstep:
        rep["text"] += "\n" + lockstep_text(lock)
    rep["text"] += "\n" + (f"kernel times timed with each process capped at {times.cpus:g} CPU, as the run's ranks"
                           + (" (process CPU / the cap)" if times.clock == "cpu" else " (wall)")
                           if times.cpus else "kernel times timed uncapped (the run's ranks were not capped, "
                           "or no cpu cgroup could be made here)")
    return rep


def sends_text(sends: SendBuffers | None) -> str:
    """One line: what a ring's send holds its sender for (``send_buffer.py``), or why it is held until it lands."""
    return sends.text if sends else f"no {SEND_FILE} in the results root: a ring's sender waits until its send lands"


def messages_text(msgs: MessageCost | None) -> str:
    """One line: the small-message term and its file (``message.py``), or why there is none."""
    return msgs.text if msgs else (f"no {MESSAGE_FILE} in the results root: small messages cost the overlap "
                                   "excess line's, as large ones")


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
    tile = next((r["call_host"] for r in rows if r.get("call_host")), None)
    lead = "" if tile is None else (
        f"host work per kernel call ({CALL_METHOD}'s calls at N={tile['seqlen']} on {' and '.join(CALL_LAYOUTS)}: "
        f"{tile['cpu_s'][0] * 1e3:.1f} and {tile['cpu_s'][1] * 1e3:.1f} ms CPU, {tile['calls'][0]} and "
        f"{tile['calls'][1]} kernel calls a rank, model {tile['model_s'][0] * 1e3:.0f} and "
        f"{tile['model_s'][1] * 1e3:.0f} ms): {tile['call_host_s'] * 1e3:.2f} ms; ")
    return lead + (f"host work per op (CPU per call at a few tokens per rank, {call['path']}, / the rank's cap, less "
            "the model's own compute there): " + ", ".join(_host_cell(m, h) for m, h in sorted(per.items())))


def _host_cell(method: str, h: dict) -> str:
    """``host_text``'s cell of one method: per op, and per ring step where its masked call split it."""
    cell = (f"{method} {h['host_s_per_op'] * 1e3:.2f} ms x {h['ops']} ops (N={h['seqlen']}: {h['cpu_s'] * 1e3:.1f} "
            f"ms CPU / {h['cpus']:g} = {h['measured_s'] * 1e3:.0f} ms, model {h['model_s'] * 1e3:.0f} ms)")
    if "host_s_per_step" not in h:
        return cell
    return cell + (f" + {h['host_s_per_step'] * 1e3:.2f} ms x {h['steps']} ring steps (with {h['mask']}: "
                   f"{h['masked_cpu_s'] * 1e3:.1f} ms CPU, {h['masked_ops']} ops, model "
                   f"{h['masked_model_s'] * 1e3:.0f} ms)")
