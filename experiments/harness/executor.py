"""The executor: the one loop that runs a batch of cases to a record each, locally and on SLURM alike.

A batch is the pending cases of one (spec, world size); the driver (``experiments.run``) decides which
cases are pending, once, from the records (``results.done_case_ids``). The executor then launches the
worker on them (``launch.py``: one ``torchrun`` per node) and, after each launch,

* records the case that was in flight when the launch broke, as failed with its ranks' reason
  (``results.finalize_unfinished``: the case a rank killed outright was running, charged to it alone);
* relaunches the cases not yet recorded, as long as each launch records something;
* retries a launch that ran no case (a rank killed at start-up, a rendezvous that failed), at most
  ``MAX_EMPTY_LAUNCHES`` times in a row; then the batch's cases are recorded failed with the launch's log;
* stops at its deadline (a SLURM job's time limit less its reserve) and records what is left as failed.

Locally ``experiments.run`` calls ``run_batch``; a SLURM job script runs ``python -m
experiments.harness.executor --slurm ...`` (``cluster/slurm.py``), whose launches are ``srun ... torchrun``.

Fault injection, for the executor's own tests (``tests/test_executor.py``; ``faults.py``): ``BURST_BENCH_FAULT`` names a
rank and a moment, and the worker kills that rank with SIGKILL then:

    BURST_BENCH_FAULT=rank:1@start      # rank 1, once its process group is up, before any case ran
    BURST_BENCH_FAULT=rank:0@case:3     # rank 0, inside the 3rd case of the batch (1-based, run order)

It reaches the first launch of each batch only, so the relaunch runs clean.

    python -m experiments.harness.executor --cases FILE --results DIR --slurm --procs-per-node P \\
        --device cuda --entry "-m experiments.harness.worker" --master-port PORT --deadline-s S
    python -m experiments.harness.executor --cases FILE --results DIR --fail-rest "why"
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from . import record, results as R
from .env import REPO
from .faults import FAULT_ENV, fault_from_env
from .launch import Launcher, run_launch, tail
from .spec import Case

# A launch that records nothing failed before its first case: a transient cause (a rank killed or a node
# lost at start-up, a rendezvous port still held) clears on a relaunch, a lasting one (an import error, a
# wrong address) fails every time. Three tries tell the two apart at the cost of three start-ups.
MAX_EMPTY_LAUNCHES = 3
STARTUP_S = 120.0     # per launch, on top of its cases' budgets: interpreter, torch import, rendezvous
MIN_LAUNCH_S = 60.0   # a launch with less time than this before the deadline is not started

def _first_launch_only(specs: list, n: int) -> list:
    """The fault fires once per batch: later launches run without it."""
    if n == 1:
        return specs
    return [(cmd, {k: v for k, v in env.items() if k != FAULT_ENV}) for cmd, env in specs]


class RecordWatcher:
    """Follows an experiment's results.jsonl; yields the records appended since it started."""

    def __init__(self, results_root: Path, experiment: str):
        self.path = R.experiment_dir(results_root, experiment) / R.RESULTS_FILE
        self.offset = self.path.stat().st_size if self.path.exists() else 0

    def poll(self) -> list[dict]:
        if not self.path.exists():
            return []
        with open(self.path, encoding="utf-8") as f:
            f.seek(self.offset)
            chunk = f.read()
        end = chunk.rfind("\n")       # a line still being written waits for the next poll
        if end < 0:
            return []
        self.offset += len(chunk[:end + 1].encode("utf-8"))
        return [r.row() for r in record.parse_lines(chunk[:end + 1].splitlines(), str(self.path))]


@dataclass
class _Batch:
    """What one batch's launches share: its cases, where records go, and who hears of them."""

    cases: list[Case]
    results_root: Path
    on_record: Callable[[dict], None]
    on_start: Callable[[Case], None]
    watcher: RecordWatcher

    def __post_init__(self):
        self.by_id = {c.case_id: c for c in self.cases}
        self.recorded: set[str] = set()
        self.started: set[str] = set()

    def collect(self) -> None:
        for rec in self.watcher.poll():
            if rec.get("case_id") in self.by_id:
                self.recorded.add(rec["case_id"])
                self.on_record(rec)

    def notice_starts(self, pending: list[Case]) -> None:
        for c in pending:
            if c.case_id not in self.started and c.case_id not in self.recorded \
                    and R.marker_path(self.results_root, c).exists():
                self.started.add(c.case_id)
                self.on_start(c)

    def fail(self, cases: list[Case], reason: str) -> None:
        for c in cases:
            R.append_record(self.results_root, R.base_record(c, "failed", reason))
        self.collect()


def run_batch(cases: list[Case], *, results_root: Path, launcher: Launcher, repo: Path = REPO,
              on_record: Callable[[dict], None] = lambda rec: None,
              on_start: Callable[[Case], None] = lambda case: None,
              startup_s: float = STARTUP_S, deadline_s: float | None = None) -> None:
    """Run ``cases`` (one experiment, one world size) to a record each (see the module's docstring).
    ``deadline_s``: seconds from now after which no launch runs (None: no limit but each launch's own)."""
    fault_from_env()                        # a malformed fault is the user's error, before anything runs
    if not cases:
        return
    exp, ws = cases[0].experiment, cases[0].world_size
    if any(c.experiment != exp or c.world_size != ws for c in cases):
        raise ValueError(f"cases: a batch is one experiment and one world size, got "
                         f"{sorted({(c.experiment, c.world_size) for c in cases})}")
    end = time.monotonic() + deadline_s if deadline_s is not None else float("inf")
    batch = _Batch(cases, Path(results_root), on_record, on_start, RecordWatcher(Path(results_root), exp))
    work = R.work_dir(results_root, exp)
    pending, empty, n = list(cases), 0, 0
    while pending:
        left = end - time.monotonic()
        if left < MIN_LAUNCH_S:
            batch.fail(pending, f"not run: {left:.0f} s were left before the deadline, too few for a launch")
            return
        n += 1
        cases_file = work / f"batch-G{ws}.json"
        cases_file.write_text(json.dumps([c.to_dict() for c in pending]))
        for p in work.glob("current.rank*"):          # a case a rank ran in an earlier launch is no clue now
            p.unlink(missing_ok=True)
        log = work / f"launch-G{ws}-{time.strftime('%Y%m%dT%H%M%S')}-{n}.log"
        budget = startup_s + sum(c.case_timeout_s for c in pending)
        rc, logs = run_launch(_first_launch_only(launcher(cases_file, n), n), repo, log, min(budget, left),
                              on_poll=lambda: (batch.collect(), batch.notice_starts(pending)))
        ended = (f"the launch exceeded its deadline ({min(budget, left):.0f} s) and was killed" if rc is None
                 else f"the launch ended with exit code {rc}")
        R.end_torn_line(batch.watcher.path)           # rank 0 may have died writing a record
        R.finalize_unfinished(results_root, pending, f"{ended} before the case finished (log: {log})")
        batch.collect()
        before, pending = len(pending), [c for c in pending if c.case_id not in batch.recorded]
        empty = empty + 1 if len(pending) == before else 0
        if pending and empty >= MAX_EMPTY_LAUNCHES:
            batch.fail(pending, f"launch failed {empty} times in a row, no case ran ({ended}): {tail(logs)}")
            return


def record_rest(cases: list[Case], results_root: Path, reason: str) -> list[str]:
    """A failed record for every case of ``cases`` that has none in ``results_root`` (a SLURM job that
    could not launch at all, e.g. its per-node setup failed)."""
    have: dict[str, set[str]] = {}
    out = []
    for c in cases:
        if c.experiment not in have:
            path = R.experiment_dir(results_root, c.experiment) / R.RESULTS_FILE
            R.end_torn_line(path)
            have[c.experiment] = set(R.latest_by_case(R.read_records(path)))
        if c.case_id not in have[c.experiment]:
            R.append_record(results_root, R.base_record(c, "failed", reason))
            out.append(c.case_id)
    return out


def slurm_launcher(*, results_root: Path, procs_per_node: int, device: str, entry: list[str],
                   master_port: int) -> Launcher:
    """One ``srun`` per launch, one torchrun per node inside it; launch n rendezvous on ``master_port + n - 1``
    (a relaunch must not meet the previous launch's sockets)."""
    def launcher(cases_file: Path, n: int):
        node = " ".join([
            shlex.quote(sys.executable), "-m", "torch.distributed.run", "--nnodes", '"$SLURM_NNODES"',
            "--nproc-per-node", str(procs_per_node), "--node-rank", '"$SLURM_NODEID"',
            "--master-addr", '"$MASTER_ADDR"', "--master-port", str(master_port + n - 1),
            "--monitor-interval", "0.5", *map(shlex.quote, entry), "--cases", shlex.quote(str(cases_file)),
            "--results", shlex.quote(str(results_root)), "--device", device])
        # $SLURM_NODEID must expand on each node, inside its own srun task: hence bash -c
        return [(["srun", "--kill-on-bad-exit=1", "--ntasks-per-node=1", "bash", "-c", node], dict(os.environ))]
    return launcher


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m experiments.harness.executor", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", required=True, help="JSON list of cases (one experiment, one world size)")
    ap.add_argument("--results", required=True, help="results root")
    ap.add_argument("--fail-rest", metavar="REASON", help="launch nothing: record every case without a record "
                    "as failed with this reason")
    ap.add_argument("--slurm", action="store_true", help="launch with srun + torchrun (inside a SLURM job)")
    ap.add_argument("--procs-per-node", type=int, default=1)
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--entry", default="-m experiments.harness.worker", help="what torchrun starts per rank")
    ap.add_argument("--master-port", type=int, default=29500)
    ap.add_argument("--startup-s", type=float, default=STARTUP_S)
    ap.add_argument("--deadline-s", type=float, default=None)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    cases = [Case.from_dict(d) for d in json.loads(Path(args.cases).read_text())]
    root = Path(args.results)
    if args.fail_rest is not None:
        left = record_rest(cases, root, args.fail_rest)
        if left:
            print(f"{len(left)} case(s) recorded as failed: {args.fail_rest}", file=sys.stderr)
        return 0
    if not args.slurm:
        raise ValueError("--slurm or --fail-rest: local runs go through python -m experiments.run")
    launcher = slurm_launcher(results_root=root, procs_per_node=args.procs_per_node, device=args.device,
                              entry=shlex.split(args.entry), master_port=args.master_port)
    run_batch(cases, results_root=root, launcher=launcher, startup_s=args.startup_s, deadline_s=args.deadline_s,
              on_record=lambda rec: print(f"{rec['status']:>7} {rec['case_id']}", flush=True))
    return 0


if __name__ == "__main__":
    from ..cli import run_cli

    sys.exit(run_cli(main))
