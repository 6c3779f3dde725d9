"""Measure a group of cases on every rank: the methods of one case shape, timed together.

``measure_group`` builds every case's step, times them in interleaved rounds
(``timing.time_interleaved``: A B A B ..., adaptive repeats), then measures each
case's memory and bytes on its own (untimed), and returns one full record per
case on rank 0 (None elsewhere). A group of one is a plain, non-interleaved case.

``Current`` says which case of the group runs now, so a failure or a watchdog
timeout is charged to that case alone; the others of the group are run again
by the next launch.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from baselines.registry import METHODS
from burst_impl import comm
from burst_impl.balance import balance_report

from . import reference
from . import results as R
from burst_impl.flops import case_flops, tflops_per_s, tokens_per_s
from .memory import measure_peak, saved_for_backward
from .model_cases import PERPLEXITY
from .model_perplexity import perplexity_record
from .spec import Case
from .steps import Step, build_step, kernel_used
from .timing import RepeatPolicy, barrier, summarize, time_interleaved
from .model_record import model_fields
from .inference_cases import UNTIMED
from .inference_steps import inference_fields, kv_capacity_record

# Share of a group's wall-clock budget (sum of its cases' timeouts.case_s) that timing rounds may use:
# the rest covers building the steps, the memory and byte steps (CPU memory profiling is slow) and noise.
TIMING_SHARE = 0.5


def _measured_over(case: Case) -> str:
    return {"forward": "forward (no grad)", "prefill": "prefill (no grad: forward + first token)",
            "train": "train step (forward + backward + gradient sync + optimizer)",
            "decode": "one decode step of the layer (no grad)",
            "ttft": "the prompt's prefill of the layer (no grad)"}.get(case.mode, "forward + backward")


@dataclass
class Current:
    """The case this rank runs now; with ``root``, also written to ``.work/current.rank<r>`` (on change)
    so that a rank killed outright still says which case it was in."""

    root: str | None = None
    rank: int = 0
    _case: Case | None = None

    @property
    def case(self) -> Case | None:
        return self._case

    @case.setter
    def case(self, c: Case) -> None:
        if self.root is not None and c is not None and (self._case is None or c.case_id != self._case.case_id):
            R.write_current(self.root, c, self.rank)
        self._case = c


def _gather(obj, world: int):
    if world == 1 or not dist.is_initialized():
        return [obj]
    out = [None] * world
    dist.all_gather_object(out, obj)
    return out


def policy_for(cases: list[Case], spent_s: float) -> RepeatPolicy:
    """The repeat policy of a group: its cases come from one spec, so they share repeats and target."""
    c = cases[0]
    budget = TIMING_SHARE * sum(x.case_timeout_s for x in cases) - spent_s
    return RepeatPolicy(min_repeats=c.repeats, max_repeats=c.repeat_cap, target=c.ci_target, budget_s=budget)


def measure_group(cases: list[Case], *, rank: int, world: int, device: torch.device, current: Current,
                  shape_checked, inject) -> list[dict] | None:
    t_start = time.perf_counter()
    if cases[0].mode == PERPLEXITY:      # a correctness result: trained and evaluated, never timed (one case)
        (case,) = cases
        current.case = case
        inject(case, rank)
        rec = perplexity_record(case, rank=rank, world=world, device=device)
        if rec is not None:
            rec["duration_s"] = time.perf_counter() - t_start
        return None if rank != 0 else [rec]
    group = dist.group.WORLD if dist.is_initialized() else None
    if cases[0].mode in UNTIMED:         # inference's KV capacity: the filled cache's bytes, nothing timed
        recs = []
        for case in cases:
            current.case = case
            inject(case, rank)
            recs.append(kv_capacity_record(case, rank=rank, world=world, device=device, group=group, gather=_gather,
                                           base_record=R.base_record))
        return None if rank != 0 else recs
    steps: list[Step] = []
    for case in cases:
        current.case = case
        inject(case, rank)
        torch.manual_seed(case.seed)
        steps.append(shape_checked(build_step(case, rank=rank, group=group, device=device)))
    policy = policy_for(cases, time.perf_counter() - t_start)
    # on an emulated cluster, the calibration's work and the memory stream timed last in every round: the machine's
    # compute and memory rates in these rounds
    refs = reference.references_for(R.cluster_info(world))
    # the references cost their time in every round, but the repeat policy judges the cases' intervals only
    timed = time_interleaved([(s.step, s.setup) for s in steps] + [(r.step, None) for r in refs],
                             warmup=max(c.warmup for c in cases), policy=policy, device=device, group=group,
                             judged=len(steps),
                             on_step=lambda i: setattr(current, "case", cases[min(i, len(cases) - 1)]),
                             ).per_call([s.calls for s in steps] + [r.work["calls"] for r in refs])
    t_timed = time.perf_counter() - t_start
    out = []
    for i, (case, step) in enumerate(zip(cases, steps)):
        current.case = case
        out.append(_measure_rest(case, step, timed.samples[i], rank=rank, world=world, device=device,
                                 group=group))
    if rank != 0:
        return None
    ids = [c.case_id for c in cases]
    for i, rec in enumerate(out):
        rec["repeat_stop"] = timed.stop
        # the mean rank's time beside the slowest's (time_median_s): what codes that average over ranks report
        rec["time_mean_rank_s"] = statistics.median(timed.mean_samples[i]) if timed.mean_samples else None
        # each rank's process CPU per step (median over rounds): beside the time, whether a rank's step is
        # its own CPU work at its cap (an emulated rank) or waits (experiments/perfmodel/emulated/validate.py)
        rec["time_cpu_s_per_rank"] = ([statistics.median(r) for r in timed.cpu_samples[i]]
                                      if timed.cpu_samples else None)
        # of it, the timing thread's (kernels and host work); the rest is the process group's transfer threads
        rec["time_cpu_main_s_per_rank"] = ([statistics.median(r) for r in timed.cpu_main_samples[i]]
                                           if timed.cpu_main_samples else None)
        rec["rounds"] = timed.rounds          # samples taken (``repeats`` is the configured minimum)
        rec["calls_per_sample"] = steps[i].calls   # each sample: this many calls back to back, divided by it
        rec["repeat_policy"] = {"min": policy.min_repeats, "max": policy.max_repeats, "target": policy.target,
                                "level": policy.level, "timing_budget_s": round(policy.budget_s, 3)}
        # the cases timed in the same rounds: sample j of each was taken in round j (paired ratios)
        rec["interleaved_with"] = [x for x in ids if x != ids[i]]
        for j, ref in enumerate(refs, start=len(steps)):
            cpu = timed.cpu_samples[j] if timed.cpu_samples else None
            rec[ref.name] = ref.to_field(ref.work, timed.samples[j], cpu)
        rec["duration_s"] = t_timed / len(cases) + rec["duration_s"]   # + its untimed steps
    return out


def _measure_rest(case: Case, step: Step, samples: list[float], *, rank: int, world: int,
                  device: torch.device, group) -> dict | None:
    """Memory and bytes of one case (untimed steps), then its record on rank 0."""
    t0 = time.perf_counter()
    mem = None
    counts = None
    saved = None
    if case.measure_memory or case.measure_comm:
        barrier(group, device)
        with comm.count_bytes() as counts:
            if case.measure_memory:
                mem = measure_peak(step.full, device, start_bytes=step.live_bytes())
            else:
                step.full()
    if case.measure_memory and step.forward is not None:
        barrier(group, device)
        saved = saved_for_backward(step.forward, exclude=step.weights)
    live = step.live_bytes()
    local = {
        # one definition for every method (experiments.harness.memory): the step's own inputs and
        # weights plus the peak increase during the step
        "mem_peak": mem.peak_bytes + live if mem else None,
        "mem_inputs": live,
        "mem_saved": saved,
        "mem_method": mem.method if mem else None,
        "mem_allocated": mem.allocated_bytes if mem else None,
        "mem_reserved": mem.reserved_bytes if mem else None,
        "comm": counts.as_dict() if counts is not None else None,
        "comm_fwd": counts.phase_total("forward") if counts is not None else None,
        "comm_bwd": counts.phase_total("backward") if counts is not None else None,
        "notes": {k: str(v) for k, v in counts.notes.items()} if counts is not None else {},
        "links": counts.by_link() if counts is not None else None,
        # host seconds this rank waited on transfers in the counted step (overlap on: the exposed part;
        # overlap off: every transfer, so the serialised communication time)
        "wait_s": float(sum(counts.wait_s.values())) if counts is not None else None,
        # model level: weights + gradients + optimizer state this rank keeps between steps
        "state_bytes": step.context.state_bytes() if hasattr(step.context, "state_bytes") else None,
        # inference: the K/V bytes this rank's cache holds after the step
        "kv_bytes": step.context.kv_bytes() if hasattr(step.context, "kv_bytes") else None,
    }
    per_rank = _gather(local, world)
    if rank != 0:
        return None
    rec = _record(case, step, samples, per_rank, device)
    rec["duration_s"] = time.perf_counter() - t0        # the untimed steps; the caller adds the timed share
    return rec


def _memory_fields(case: Case, per_rank: list[dict]) -> dict:
    """The record's memory: the one definition per rank, what backward keeps, and CUDA's whole counters."""
    peaks = [r["mem_peak"] for r in per_rank]
    saved = [r["mem_saved"] for r in per_rank]
    return {
        "mem_peak_bytes": max(peaks),
        "mem_peak_bytes_per_rank": peaks,
        "mem_inputs_bytes_per_rank": [r["mem_inputs"] for r in per_rank],
        "mem_saved_bytes": max(saved) if None not in saved else None,
        "mem_method": per_rank[0]["mem_method"],
        # GPU: the allocator's whole counts over the step (inputs, weights, state and cache included)
        **{f"mem_{k}_peak_bytes": (None if None in (r[f"mem_{k}"] for r in per_rank)
                                   else max(r[f"mem_{k}"] for r in per_rank)) for k in ("allocated", "reserved")},
        "mem_definition": "step inputs and weights + peak increase during the step (max over ranks)",
        "mem_measured_over": _measured_over(case),
    }


def _record(case: Case, step: Step, samples: list[float], per_rank: list[dict], device: torch.device) -> R.Record:
    method = METHODS[case.method]
    shape = case.shape
    rec = R.base_record(case, "ok", extra_config={"device": str(device.type),
                                                   "backend": "nccl" if device.type == "cuda" else "gloo"})
    rec["kernel"] = kernel_used(case, device)
    stats = summarize(samples)
    med = stats["time_median_s"]
    rec.update(stats)
    rec["time_samples_s"] = samples
    if case.level == "model":
        rec.update(model_fields(case, step.context, med, per_rank, device))
    elif case.level == "inference":
        rec.update(inference_fields(case, med, per_rank))
    else:
        flops, scope = case_flops(case.level, shape, case.mode)
        rec.update({
            "flops": flops,
            "flops_scope": scope,
            "tflops_total": tflops_per_s(flops, med),
            "tflops_per_rank": tflops_per_s(flops, med) / case.world_size,
            "tokens_per_s": tokens_per_s(case.batch, case.seqlen, med),
        })
    if case.measure_memory:
        rec.update(_memory_fields(case, per_rank))
    if case.level in ("model", "inference"):
        return rec
    # Work balance of the layout under the mask (burst_impl.balance): live score entries of each
    # rank's rows and columns, and max/mean; what a ring method's slowest rank has to compute.
    rec.update(balance_report(shape.attn_mask, shape.resolved_layout, shape.seqlen, shape.world_size))
    skipped = [{p: _int_note(r["notes"], f"burst.skipped_blocks.{p}") for p in ("forward", "backward")}
               for r in per_rank]
    if any(v is not None for s in skipped for v in s.values()):
        # pairs of (q shard, kv shard) fully masked: not computed, but their blocks travelled
        rec["skipped_blocks_per_rank"] = skipped
        rec["live_entries_per_rank"] = [{p: _int_note(r["notes"], f"burst.live_entries.{p}")
                                         for p in ("forward", "backward")} for r in per_rank]
    try:
        rec["mem_model_bytes"] = memory_model_bytes(case)
        rec["mem_model_of"] = "bytes kept for backward (compare mem_saved_bytes)"
    except Exception as e:  # noqa: BLE001 - a model that cannot evaluate is noted, not fatal
        rec["mem_model_bytes"] = None
        rec["mem_model_error"] = str(e)
    if case.measure_comm:
        # per rank: with uneven shards (issue 22) each rank sends its own blocks' bytes; the record's
        # formula totals are the largest rank's, as the counted totals are
        formulas = [method.bytes(shape, rank=r) for r in range(shape.world_size)]
        formula = formulas[0]
        f_fwd = max(sum(v for (p, _), v in f.items() if p == "forward") for f in formulas)
        f_bwd = max(sum(v for (p, _), v in f.items() if p == "backward") for f in formulas)
        has_bwd = case.mode != "forward"
        rec.update({
            "comm_fwd_bytes": max(r["comm_fwd"] for r in per_rank),
            "comm_bwd_bytes": max(r["comm_bwd"] for r in per_rank) if has_bwd else None,
            "comm_fwd_bytes_per_rank": [r["comm_fwd"] for r in per_rank],
            "comm_bwd_bytes_per_rank": [r["comm_bwd"] for r in per_rank] if has_bwd else None,
            "comm_fwd_formula_bytes": int(f_fwd),
            "comm_bwd_formula_bytes": int(f_bwd) if has_bwd else None,
            # adapters whose sends happen inside another package record the formula at the send
            # points: those bytes are not counted, and figures draw them hatched
            "bytes_source": "formula" if method.bytes_by_formula else "counted",
            "comm_bytes_by_kind": per_rank[0]["comm"],
            "comm_formula_by_kind": {f"{p}/{k}": int(v) for (p, k), v in sorted(formula.items())},
            "comm_notes": per_rank[0]["notes"],
            "comm_bytes_by_link_per_rank": [r["links"] for r in per_rank],
            "comm_wait_s_per_rank": [r["wait_s"] for r in per_rank],
            "comm_measured_over": "forward" if not has_bwd else "forward + backward",
        })
    return rec


def memory_model_bytes(case: Case) -> int:
    """The method's closed-form bytes kept for backward at the case's level (op: the operator's own;
    layer: ``baselines.layer``, projections included); compare ``mem_saved_bytes``."""
    method = METHODS[case.method]
    return int(method.memory(case.shape) if case.level == "op" else method.layer_memory(case.shape))


def _int_note(notes: dict, key: str) -> int | None:
    return int(notes[key]) if key in notes else None
