"""Per-rank entry point: runs a list of cases in one process group.

    torchrun --standalone --nproc-per-node G -m experiments.harness.worker --cases cases.json --results results
    python -m experiments.harness.worker --cases cases.json            # world size 1, no torchrun

Rank 0 writes one record per case. A case that raises is recorded by the
rank that saw it (``.work/<case>.rank<r>.err``) and the process exits: after a
failed collective the group cannot be trusted, so the driver relaunches the
rest of the batch. A watchdog thread ends a case that outlives its wall-clock
budget; the process-group timeout ends a rank stuck in a collective. The
first call of each case runs with the cross-rank shape check on
(``burst_impl.comm.check_shapes``), so shards that differ between ranks are a
ValueError, not a hang.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from burst_impl import comm

from . import results as R
from .flops import attention_flops, tflops_per_s, tokens_per_s
from .memory import is_oom, measure_peak
from .spec import Case, case_problem
from .steps import Step, build_step, kernel_used
from .timing import barrier, summarize, time_steps

EXIT_CASE_FAILED = 3
EXIT_TIMEOUT = 124
# Fault injection for the harness's own tests: "<case_id substring>:<oom|error|hang|kill>[:<rank>]"
# (kill: the rank ends itself with SIGKILL, as the kernel's OOM killer or an operator would).
INJECT_ENV = "EXPERIMENTS_INJECT_FAULT"


def _inject(case: Case, rank: int) -> None:
    spec = os.environ.get(INJECT_ENV, "")
    for item in filter(None, spec.split(";")):
        parts = item.split(":")
        what, kind = parts[0], parts[1]
        only = int(parts[2]) if len(parts) > 2 else None
        if what in case.case_id and (only is None or only == rank):
            if kind == "oom":
                raise torch.OutOfMemoryError("injected: CUDA out of memory. Tried to allocate 1 GiB")
            if kind == "hang":
                time.sleep(3600)
            if kind == "kill":
                sys.stdout.flush()
                sys.stderr.flush()
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError("injected failure")


def _rank_world() -> tuple[int, int, int]:
    return (int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)),
            int(os.environ.get("LOCAL_RANK", 0)))


def _device(kind: str, local_rank: int) -> torch.device:
    if kind == "cuda" or (kind == "auto" and torch.cuda.is_available()):
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def log(msg: str) -> None:
    """Print on rank 0 only."""
    if _rank_world()[0] == 0:
        print(msg, flush=True)


class Watchdog:
    """Ends the process if a case runs past its budget (records why first)."""

    def __init__(self, results_root, rank: int):
        self.results_root, self.rank = results_root, rank
        self._timer: threading.Timer | None = None

    def arm(self, case: Case) -> None:
        def fire():
            R.write_rank_error(self.results_root, case, self.rank, "failed",
                               f"timeout: case exceeded its wall-clock budget of {case.case_timeout_s:.0f} s")
            os._exit(EXIT_TIMEOUT)
        self._timer = threading.Timer(case.case_timeout_s, fire)
        self._timer.daemon = True
        self._timer.start()

    def disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


def _gather(obj, world: int):
    if world == 1 or not dist.is_initialized():
        return [obj]
    out = [None] * world
    dist.all_gather_object(out, obj)
    return out


def _shape_checked_once(step: Step) -> Step:
    """``step`` whose first call runs with ``comm.check_shapes`` on: shards of different shapes on
    different ranks then raise a ValueError on every rank instead of hanging the first transfer.
    Only the first call: the check is one extra collective per call, and with ``warmup >= 1`` the
    first call is a warm-up step, so no timed sample contains it."""
    name = "setup" if step.setup is not None else "step"
    fn = getattr(step, name)
    done = False

    def first_checked():
        nonlocal done
        if done:
            return fn()
        done = True
        with comm.check_shapes(True):
            return fn()

    return dataclasses.replace(step, **{name: first_checked})


def _warm_up_imports() -> None:
    """Pay once, outside every case's wall-clock budget, for what torch imports lazily on first use:
    the first backward pulls in torch.fx's symbolic shapes, the first CPU memory profile torch._dynamo
    (tens of seconds on a busy 2-core machine)."""
    w = torch.ones(1, requires_grad=True)
    (w * 2).sum().backward()
    measure_peak(lambda: torch.ones(1) * 2, torch.device("cpu"))


def _measured_over(case: Case) -> str:
    return {"forward": "forward (no grad)", "prefill": "prefill (no grad: forward + first token)",
            "train": "train step (forward + backward + gradient sync + optimizer)"}.get(case.mode, "forward + backward")


def run_case(case: Case, *, rank: int, world: int, device: torch.device) -> dict | None:
    """Measure one case on every rank; the full record on rank 0, None elsewhere."""
    t_start = time.perf_counter()
    _inject(case, rank)
    group = dist.group.WORLD if dist.is_initialized() else None
    torch.manual_seed(case.seed)
    step = _shape_checked_once(build_step(case, rank=rank, group=group, device=device))
    samples = time_steps(step.step, setup=step.setup, warmup=case.warmup, repeats=case.repeats,
                         device=device, group=group)
    mem = None
    counts = None
    if case.measure_memory or case.measure_comm:
        barrier(group, device)
        with comm.count_bytes() as counts:
            if case.measure_memory:
                mem = measure_peak(step.full, device, start_bytes=step.live_bytes())
            else:
                step.full()
    local = {
        "mem_peak": mem.peak_bytes if mem else None,
        "mem_start": mem.start_bytes if mem else None,
        "mem_method": mem.method if mem else None,
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
    }
    per_rank = _gather(local, world)
    if rank != 0:
        return None

    from baselines.registry import METHODS

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
        from .model_record import model_fields

        rec.update(model_fields(case, step.context, med, per_rank, device))
    else:
        flops = attention_flops(case.batch, case.seqlen, case.heads, case.head_dim, causal=case.causal,
                                mode=case.mode)
        rec.update({
            "flops": flops,
            "tflops_total": tflops_per_s(flops, med),
            "tflops_per_rank": tflops_per_s(flops, med) / case.world_size,
            "tokens_per_s": tokens_per_s(case.batch, case.seqlen, med),
        })
    if case.measure_memory:
        peaks = [r["mem_peak"] for r in per_rank]
        rec.update({
            "mem_peak_bytes": max(peaks),
            "mem_peak_bytes_per_rank": peaks,
            "mem_start_bytes_per_rank": [r["mem_start"] for r in per_rank],
            "mem_method": per_rank[0]["mem_method"],
            "mem_measured_over": _measured_over(case),
        })
    if case.level == "model":
        rec["duration_s"] = time.perf_counter() - t_start
        return rec
    try:
        rec["mem_model_bytes"] = int(method.memory(shape))
    except Exception as e:  # noqa: BLE001 - a model that cannot evaluate is noted, not fatal
        rec["mem_model_bytes"] = None
        rec["mem_model_error"] = str(e)
    if case.measure_comm:
        formula = method.bytes(shape)
        f_fwd = sum(v for (p, _), v in formula.items() if p == "forward")
        f_bwd = sum(v for (p, _), v in formula.items() if p == "backward")
        has_bwd = case.mode != "forward"
        rec.update({
            "comm_fwd_bytes": max(r["comm_fwd"] for r in per_rank),
            "comm_bwd_bytes": max(r["comm_bwd"] for r in per_rank) if has_bwd else None,
            "comm_fwd_bytes_per_rank": [r["comm_fwd"] for r in per_rank],
            "comm_bwd_bytes_per_rank": [r["comm_bwd"] for r in per_rank] if has_bwd else None,
            "comm_fwd_formula_bytes": int(f_fwd),
            "comm_bwd_formula_bytes": int(f_bwd),
            "comm_bytes_by_kind": per_rank[0]["comm"],
            "comm_formula_by_kind": {f"{p}/{k}": int(v) for (p, k), v in sorted(formula.items())},
            "comm_notes": per_rank[0]["notes"],
            "comm_bytes_by_link_per_rank": [r["links"] for r in per_rank],
            "comm_wait_s_per_rank": [r["wait_s"] for r in per_rank],
            "comm_measured_over": "forward" if not has_bwd else "forward + backward",
        })
    rec["duration_s"] = time.perf_counter() - t_start
    return rec


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", required=True, help="JSON list of cases (experiments.harness.spec.Case dicts)")
    ap.add_argument("--results", default="results", help="results root directory")
    ap.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    ap.add_argument("--force", action="store_true", help="run cases that already have results")
    ap.add_argument("--retry-failed", action="store_true")
    ap.add_argument("--finalize-only", action="store_true",
                    help="record started-but-unfinished cases as failed and exit (end of a SLURM job)")
    args = ap.parse_args(argv)
    cases = [Case.from_dict(d) for d in json.loads(Path(args.cases).read_text())]
    rank, world, local_rank = _rank_world()
    root = args.results

    if args.finalize_only:
        R.finalize_unfinished(root, cases, "the job ended before the case finished (crash or time limit)")
        return 0

    device = _device(args.device, local_rank)
    if device.type == "cpu":
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, local_world)))
    if world > 1:
        pg_timeout = max(c.pg_timeout_s for c in cases) if cases else 120
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                timeout=datetime.timedelta(seconds=pg_timeout),
                                device_id=device if device.type == "cuda" else None)
    # Rank 0 settles what an earlier launch left unfinished, then decides what to run.
    if rank == 0:
        R.finalize_unfinished(root, cases, "the process ended before the case finished "
                                           "(killed, crashed, or over the launch's time limit)")
    pending = None
    if rank == 0:
        done = set() if args.force else set().union(*[
            R.done_case_ids(root, e, retry_failed=args.retry_failed) for e in {c.experiment for c in cases}] or [set()])
        pending = [c.to_dict() for c in cases if c.case_id not in done]
    if world > 1:
        box = [pending]
        dist.broadcast_object_list(box, src=0)
        pending = box[0]
    todo = [Case.from_dict(d) for d in pending]

    _warm_up_imports()
    dog = Watchdog(root, rank)
    for i, case in enumerate(todo):
        if case.world_size != world:
            if rank == 0:
                R.append_record(root, R.base_record(case, "skipped",
                                                    f"launched with world size {world}, case needs {case.world_size}"))
            continue
        problem = case_problem(case)
        if problem:
            if rank == 0:
                R.append_record(root, R.base_record(case, "skipped", problem))
            continue
        if rank == 0:
            R.clear_work(root, case)
            R.marker_path(root, case).write_text(R.now())
        if world > 1:
            barrier(dist.group.WORLD, device)
        log(f"[{i + 1}/{len(todo)}] {case.experiment}: {case.case_id}")
        dog.arm(case)
        try:
            rec = run_case(case, rank=rank, world=world, device=device)
        except BaseException as e:  # noqa: BLE001 - every failure becomes a record
            status = "oom" if is_oom(e) else "failed"
            tb = traceback.format_exc(limit=4)
            reason = f"{type(e).__name__}: {str(e)[:800]}"
            R.write_rank_error(root, case, rank, status, reason)
            print(f"rank {rank}: {case.case_id} {status}: {reason}\n{tb}", file=sys.stderr, flush=True)
            # Rank 0 records the failure itself when it can; the driver (or the next
            # launch) finalises it otherwise from the .err files.
            if rank == 0:
                time.sleep(1.0)  # let other ranks' .err files land (an OOM elsewhere explains our error)
                st, why = R.failure_from_errors(root, case, reason)
                R.append_record(root, R.base_record(case, st, why))
                R.clear_work(root, case)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(EXIT_CASE_FAILED)
        finally:
            dog.disarm()
        if rank == 0:
            R.append_record(root, rec)
            R.clear_work(root, case)
    if world > 1:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
