"""Per-rank entry point: runs a list of cases in one process group.

    torchrun --standalone --nproc-per-node G -m experiments.harness.worker --cases cases.json --results results
    python -m experiments.harness.worker --cases cases.json            # world size 1, no torchrun

Rank 0 writes one record per case. The worker runs every case of its cases file: which cases are
pending, and whether to launch again, is the executor's (``executor.py``). The cases of one case shape (methods
sharing shape, mode and kernel; ``Case.group_key``) are measured together
(``experiments.harness.measure``: timed in interleaved rounds); their watchdog
budget is the sum of theirs, and a failure is charged to the case that was
running, the others of the group being run again by the next launch. A case that raises is recorded by the
rank that saw it (``.work/<case>.rank<r>.err``) and the process exits: after a
failed collective the group cannot be trusted, so the executor relaunches the
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
import sys
import threading
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from burst_impl import comm

from . import results as R
from . import faults
from .measure import Current, measure_group
from .memory import is_oom, measure_peak
from .case import Case
from .plan import launch_problem
from .steps import Step
from .timing import barrier

EXIT_CASE_FAILED = 3
EXIT_TIMEOUT = 124
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
    """Ends the process if a group of cases runs past its budget (the sum of theirs); records why first,
    charged to the case running then (``current``); the group's other cases run again in the next launch
    (``results.finalize_unfinished``)."""

    def __init__(self, results_root, rank: int):
        self.results_root, self.rank = results_root, rank
        self._timer: threading.Timer | None = None

    def arm(self, cases: list[Case], current: Current) -> None:
        budget = sum(c.case_timeout_s for c in cases)

        def fire():
            R.write_rank_error(self.results_root, current.case or cases[0], self.rank, "failed",
                               f"timeout: case exceeded its wall-clock budget of {budget:.0f} s"
                               + (f" (shared by the {len(cases)} cases timed with it)" if len(cases) > 1 else ""))
            os._exit(EXIT_TIMEOUT)
        self._timer = threading.Timer(budget, fire)
        self._timer.daemon = True
        self._timer.start()

    def disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


def groups(cases: list[Case]) -> list[list[Case]]:
    """Cases grouped by ``Case.group_key`` (the methods of one case shape), in first-appearance order."""
    out: dict[tuple, list[Case]] = {}
    for c in cases:
        out.setdefault(c.group_key, []).append(c)
    return list(out.values())


def _shape_checked_once(step: Step) -> Step:
    """``step`` whose first call runs with ``comm.check_shapes`` on: shards of different shapes on
    different ranks then raise a ValueError on every rank instead of hanging the first transfer.
    The check is on by default since issue 22 (about 0.3 ms per call on gloo,
    docs/sequence_lengths.md); this keeps the first call checked even where a caller turned it off."""
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


def run_case(case: Case, *, rank: int, world: int, device: torch.device) -> dict | None:
    """Measure one case on every rank (a group of one); its record on rank 0, None elsewhere."""
    recs = run_group([case], rank=rank, world=world, device=device)
    return recs[0] if recs else None


def run_group(cases: list[Case], *, rank: int, world: int, device: torch.device,
              current: Current | None = None, inject=faults.inject) -> list[dict] | None:
    """Measure ``cases`` (one case shape) on every rank; their records on rank 0, None elsewhere."""
    return measure_group(cases, rank=rank, world=world, device=device, current=current or Current(),
                         shape_checked=_shape_checked_once, inject=inject)


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", required=True, help="JSON list of cases (experiments.harness.spec.Case dicts)")
    ap.add_argument("--results", default="results", help="results root directory")
    ap.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    return ap.parse_args(argv)


def _set_up(kind: str, cases: list[Case], world: int, local_rank: int) -> torch.device:
    """This rank's device, its CPU threads (the cores shared by the local ranks), and the process group."""
    device = _device(kind, local_rank)
    if device.type == "cpu":
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, local_world)))
    if world > 1:
        pg_timeout = max(c.pg_timeout_s for c in cases) if cases else 120
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                timeout=datetime.timedelta(seconds=pg_timeout),
                                device_id=device if device.type == "cuda" else None)
    return device


def _runnable(part: list[Case], root, rank: int, world: int) -> list[Case]:
    """The cases of ``part`` that can run in this launch (``plan.launch_problem``, re-derived on this node from
    the cases file); the others recorded as skipped with its reason (rank 0)."""
    runnable = []
    for case in part:
        problem = launch_problem(case, world)
        if problem is None:
            runnable.append(case)
        elif rank == 0:
            R.append_record(root, R.base_record(case, "skipped", problem))
    return runnable


def _start_group(runnable: list[Case], root, rank: int, world: int, device: torch.device) -> None:
    """Every rank together, then the markers of the started cases (rank 0): a rank lost before the group
    began fails the barrier, and no case of the group is charged with it."""
    if world > 1:
        barrier(dist.group.WORLD, device)
    if rank == 0:
        for case in runnable:
            R.clear_work(root, case)
            R.write_marker(root, case, [c.case_id for c in runnable])


def _fail_group(e: BaseException, runnable: list[Case], current: Current, root, rank: int) -> None:
    """Called in the ``except`` of a group that raised: records the failure, then ends the process."""
    case = current.case or runnable[0]
    status = "oom" if is_oom(e) else "failed"
    tb = traceback.format_exc(limit=4)
    reason = f"{type(e).__name__}: {str(e)[:800]}"
    R.write_rank_error(root, case, rank, status, reason)
    print(f"rank {rank}: {case.case_id} {status}: {reason}\n{tb}", file=sys.stderr, flush=True)
    # Rank 0 records the failure itself when its error is a cause; a lost peer means another rank died
    # or failed, and the executor finalises the case from every rank's .err and current files.
    if rank == 0 and not R.peer_lost(reason):
        time.sleep(1.0)  # let other ranks' .err files land (an OOM elsewhere explains our error)
        st, why = R.failure_from_errors(root, case, reason)
        R.append_record(root, R.base_record(case, st, why))
        R.clear_work(root, case)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(EXIT_CASE_FAILED)


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    cases = [Case.from_dict(d) for d in json.loads(Path(args.cases).read_text())]
    rank, world, local_rank = _rank_world()
    root = args.results
    fault = faults.fault_from_env()

    device = _set_up(args.device, cases, world, local_rank)
    _warm_up_imports()
    faults.kill_at(fault, rank, None)
    if world > 1:
        barrier(dist.group.WORLD, device)     # every rank is up before the first case starts
    order = [c for part in groups(cases) for c in part]
    position = {c.case_id: i + 1 for i, c in enumerate(order)}

    def inject(case: Case, r: int) -> None:
        faults.kill_at(fault, r, position[case.case_id])
        faults.inject(case, r)

    dog = Watchdog(root, rank)
    done_n = 0
    for part in groups(cases):
        runnable = _runnable(part, root, rank, world)
        done_n += len(part) - len(runnable)
        if not runnable:
            continue
        _start_group(runnable, root, rank, world, device)
        log(f"[{done_n + 1}-{done_n + len(runnable)}/{len(cases)}] {runnable[0].experiment}: "
            + ", ".join(c.case_id for c in runnable))
        current = Current(root=root, rank=rank)
        dog.arm(runnable, current)
        try:
            recs = run_group(runnable, rank=rank, world=world, device=device, current=current, inject=inject)
        except BaseException as e:  # noqa: BLE001 - every failure becomes a record
            _fail_group(e, runnable, current, root, rank)
        finally:
            dog.disarm()
        done_n += len(runnable)
        if rank == 0:
            for rec, case in zip(recs, runnable):
                R.append_record(root, rec)
                R.clear_work(root, case)
    if world > 1:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
