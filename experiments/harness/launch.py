"""The processes of one launch: the worker's command and environment, one process per node, their end.

World size 1 runs as plain python, more ranks under ``torchrun --standalone`` (or, on an emulated
cluster, one torchrun per node namespace: a ``Launcher``). Which cases a launch runs, and whether to
launch again, is the executor's (``executor.py``).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable


GRACE_S = 30.0        # a failed node's peers' collectives fail within this once it is gone
POLL_S = 0.25


def worker_cmd(cases_file: Path, results_root: Path, world_size: int, device: str,
               python: str = sys.executable) -> list[str]:
    """World size 1 runs as plain python; more ranks under torchrun --standalone."""
    tail = ["-m", "experiments.harness.worker", "--cases", str(cases_file), "--results", str(results_root),
            "--device", device]
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


def tail(text: str, n: int = 1500) -> str:
    """The last ``n`` characters of a launch's log, without blank lines and USDT probe noise."""
    lines = [ln for ln in text.splitlines() if "USDT" not in ln and ln.strip()]
    return "\n".join(lines)[-n:]


# A launcher turns (cases file, launch number) into the commands of one launch: one per node, each with
# its environment. The default is one ``torchrun --standalone`` on this machine; the emulated cluster
# (experiments.cluster.emulator.emulated) gives one torchrun per node namespace.
Launcher = Callable[[Path, int], list[tuple[list[str], dict[str, str]]]]


def local_launcher(results_root: Path, ws: int, device: str, repo: Path) -> Launcher:
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


def run_launch(specs, repo: Path, log: Path, timeout_s: float,
               on_poll: Callable[[], None] = lambda: None) -> tuple[int | None, str]:
    """Run one launch's commands (``(cmd, env)``, one per node) to their end (a failing node's peers get
    ``GRACE_S``, then are killed), calling ``on_poll`` while they run: ``(exit status, their logs)``; the
    status is None when ``timeout_s`` passed first and the processes were killed."""
    procs = _Procs(specs, repo, log)
    deadline = time.monotonic() + timeout_s
    try:
        while (rc := procs.poll()) is None and time.monotonic() < deadline:
            on_poll()
            time.sleep(POLL_S)
    finally:
        procs.kill()
        procs.close()
    return rc, "\n".join(lg.read_text(errors="replace") for lg in procs.logs)
