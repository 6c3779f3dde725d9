"""Local launches: one ``torchrun --standalone`` per batch of cases of one world size.

Start-up (interpreter, torch import, rendezvous) costs seconds per launch on a
small machine, so all pending cases of a (spec, world size) share one launch
and still get one record each. The driver watches the launch:

* progress: a record appearing in results.jsonl completes a case;
* a case whose ``.started`` marker is older than its wall-clock budget (plus
  grace) gets the whole launch killed (the worker's own watchdog should have
  fired first; this is the backstop), and the launch as a whole has a deadline;
* after the launch, a started case without a record is recorded as failed
  (OOM if a rank said so), and the launch is repeated for the cases not yet
  run. A launch that records nothing ends the batch: its cases are failed.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from . import results as R
from .spec import Case

GRACE_S = 30.0
STARTUP_S = 120.0
POLL_S = 0.25


def worker_cmd(cases_file: Path, results_root: Path, world_size: int, device: str,
               python: str = sys.executable) -> list[str]:
    """World size 1 runs as plain python; more ranks under torchrun --standalone."""
    tail = ["-m", "experiments.harness.worker", "--cases", str(cases_file), "--results", str(results_root),
            "--device", device, "--force"]
    if world_size == 1:
        return [python, *tail]
    return [python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world_size),
            "--monitor-interval", "0.5", *tail]


def worker_env(world_size: int, device: str, repo: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(x for x in (str(repo), env.get("PYTHONPATH", "")) if x)
    if device == "cpu":
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // world_size))
        env["CUDA_VISIBLE_DEVICES"] = ""
    env.setdefault("KINETO_LOG_LEVEL", "5")
    env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    return env


class RecordWatcher:
    """Follows results.jsonl files; yields records newer than ``since``."""

    def __init__(self, results_root: Path, experiments: set[str]):
        self.paths = {e: R.experiment_dir(results_root, e) / R.RESULTS_FILE for e in experiments}
        self.offsets = {e: (p.stat().st_size if p.exists() else 0) for e, p in self.paths.items()}

    def poll(self) -> list[dict]:
        out = []
        for e, p in self.paths.items():
            if not p.exists():
                continue
            with open(p, encoding="utf-8") as f:
                f.seek(self.offsets[e])
                chunk = f.read()
            end = chunk.rfind("\n")
            if end < 0:
                continue
            self.offsets[e] += len(chunk[:end + 1].encode("utf-8"))
            for line in chunk[:end + 1].splitlines():
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    pass
        return out


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=10)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def _tail(path: Path, n: int = 1500) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    lines = [ln for ln in text.splitlines() if "USDT" not in ln and ln.strip()]
    return "\n".join(lines)[-n:]


# A launcher turns (cases file, launch number) into the commands of one launch: one per node, each with
# its environment. The default is one ``torchrun --standalone`` on this machine; the emulated cluster
# (experiments.cluster.emulator.emulated) gives one torchrun per node namespace.
Launcher = Callable[[Path, int], list[tuple[list[str], dict[str, str]]]]


def _local_launcher(results_root: Path, ws: int, device: str, repo: Path) -> Launcher:
    return lambda cases_file, n: [(worker_cmd(cases_file, results_root, ws, device), worker_env(ws, device, repo))]


class _Procs:
    """The processes of one launch (one per node). One that fails gives the others ``GRACE_S`` to notice
    (their collectives fail once a peer is gone) before they are killed too."""

    def __init__(self, specs, repo: Path, log: Path):
        self.logs = [log if len(specs) == 1 else log.with_name(f"{log.stem}-node{i}{log.suffix}")
                     for i in range(len(specs))]
        self.files = [open(lg, "w") for lg in self.logs]
        self.procs = [subprocess.Popen(cmd, cwd=repo, env=env, stdout=f, stderr=subprocess.STDOUT,
                                       start_new_session=True) for (cmd, env), f in zip(specs, self.files)]
        self._failed_at: float | None = None

    def poll(self) -> int | None:
        rcs = [p.poll() for p in self.procs]
        bad = [rc for rc in rcs if rc not in (None, 0)]
        if bad and any(rc is None for rc in rcs):
            self._failed_at = self._failed_at or time.monotonic()
            if time.monotonic() - self._failed_at > GRACE_S:
                self.kill()
                rcs = [p.poll() for p in self.procs]
        if any(rc is None for rc in rcs):
            return None
        return next((rc for rc in rcs if rc != 0), 0)

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                _kill(p)

    def close(self) -> None:
        for f in self.files:
            f.close()

    def tail(self, n: int) -> str:
        return "\n".join(_tail(lg, n // len(self.logs)) for lg in self.logs)


def run_launch(specs, repo: Path, log: Path, timeout_s: float) -> tuple[int | None, str]:
    """Run one launch's commands (``(cmd, env)``, one per node) to their end, as ``run_batch`` does
    (a failing node's peers get ``GRACE_S``, then are killed): ``(exit status, their logs)``; the
    status is None when ``timeout_s`` passed first and the processes were killed."""
    procs = _Procs(specs, repo, log)
    deadline = time.monotonic() + timeout_s
    try:
        while (rc := procs.poll()) is None and time.monotonic() < deadline:
            time.sleep(POLL_S)
    finally:
        procs.kill()
        procs.close()
    return rc, "\n".join(lg.read_text(errors="replace") for lg in procs.logs)


def run_batch(cases: list[Case], *, results_root: Path, device: str, repo: Path,
              on_record: Callable[[dict], None], on_start: Callable[[Case], None],
              max_launches: int | None = None, launcher: Launcher | None = None) -> None:
    """Run ``cases`` (one experiment, one world size) to a record each."""
    if not cases:
        return
    exp, ws = cases[0].experiment, cases[0].world_size
    assert all(c.experiment == exp and c.world_size == ws for c in cases), "one experiment, one world size"
    launcher = launcher or _local_launcher(results_root, ws, device, repo)
    work = R.work_dir(results_root, exp)
    by_id = {c.case_id: c for c in cases}
    pending = list(cases)
    launches = 0
    max_launches = max_launches or len(cases) + 1
    watcher = RecordWatcher(results_root, {exp})
    while pending and launches < max_launches:
        launches += 1
        cases_file = work / f"batch-G{ws}.json"
        cases_file.write_text(json.dumps([c.to_dict() for c in pending]))
        log = work / f"launch-G{ws}-{time.strftime('%Y%m%dT%H%M%S')}-{launches}.log"
        deadline = time.monotonic() + STARTUP_S + sum(c.case_timeout_s for c in pending)
        recorded: set[str] = set()
        started_seen: set[str] = set()
        killed_for = ""

        def collect() -> None:
            """Hand every new record of this batch to ``on_record`` (the one record-reading loop)."""
            for rec in watcher.poll():
                if rec.get("case_id") in by_id:
                    recorded.add(rec["case_id"])
                    on_record(rec)

        procs = _Procs(launcher(cases_file, launches), repo, log)
        try:
            while True:
                rc = procs.poll()
                collect()
                for c in pending:
                    m = R.marker_path(results_root, c)
                    if c.case_id in recorded or not m.exists():
                        continue
                    if c.case_id not in started_seen:
                        started_seen.add(c.case_id)
                        on_start(c)
                    try:
                        age = time.time() - m.stat().st_mtime
                    except FileNotFoundError:
                        continue
                    budget = R.marker_budget(results_root, c)   # the group's, when timed with others
                    if budget is None:                           # finished since: its record is on its way
                        continue
                    if age > budget + GRACE_S and not killed_for:
                        killed_for = (f"timeout: no result after {age:.0f} s (budget {budget:.0f} s); "
                                      "launch killed by the driver")
                        procs.kill()
                if rc is not None:
                    break
                if time.monotonic() > deadline and not killed_for:
                    killed_for = "timeout: the launch exceeded its wall-clock deadline; killed by the driver"
                    procs.kill()
                time.sleep(POLL_S)
        finally:
            procs.kill()
            procs.close()
        collect()
        reason = killed_for or f"worker launch exited with code {rc} before the case finished: {procs.tail(600)}"
        R.finalize_unfinished(results_root, pending, reason)
        collect()
        before = len(pending)
        pending = [c for c in pending if c.case_id not in recorded]
        if pending and len(pending) == before:
            # Nothing recorded at all: the launch itself is broken (import error, rendezvous...).
            why = f"launch failed (exit code {rc}), no case ran: {procs.tail(1500)}"
            for c in pending:
                rec = R.base_record(c, "failed", why)
                R.append_record(results_root, rec)
            collect()
            pending = []
