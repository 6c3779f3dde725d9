"""A pool of long-lived gloo process groups for multi-process tests.

Spawning G processes and importing torch costs seconds per test on a 2-core
machine, so each world size gets one set of workers for the whole session
and tests submit module-level functions to it. The workers are forked from
one server process (multiprocessing's forkserver) that has imported torch and
the packages the test functions use (``PRELOAD``), once per session: a pool of
G workers starts in well under a second instead of G fresh interpreters each
importing torch (about 3 s of CPU each), and a worker exits without the
interpreter's slow shutdown. The server has done nothing but import: no
process group, no thread pool in use; each worker sets its threads and joins
its own gloo group after the fork, as a spawned one did.

Bounded failure: the process group has a short timeout (a rank stuck in a
collective errors out instead of hanging), and ``run`` waits at most
``timeout`` seconds; on a timeout or any rank's exception the pool is torn
down (the next ``run`` builds a fresh one) and the test fails with the
failing rank's traceback.
"""
from __future__ import annotations

import datetime
import os
import queue
import socket
import time
import traceback

import torch.multiprocessing as mp

PG_TIMEOUT_S = 30
RUN_TIMEOUT_S = 120
CLOSE_GRACE_S = 2.0   # a closed pool's workers get this long, all together, to exit before they are killed
# What the server imports before it forks a worker: what (nearly) every submitted function needs.
PRELOAD = ["torch", "torch.distributed", "burst_impl", "baselines", "tests.refs", "tests._helpers"]


def _context():
    """The forkserver context, its server started (with this process's environment and sys.path now)."""
    from multiprocessing import forkserver

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    forkserver.ensure_running()
    return ctx


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, tasks, results) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # G workers share 2 cores
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=PG_TIMEOUT_S))
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args, kwargs = task
        try:
            results.put((rank, True, fn(*args, **kwargs)))
        except BaseException:  # noqa: BLE001 - report everything, including assertion errors
            results.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()


class DistPool:
    def __init__(self, world_size: int):
        ctx = _context()
        self.world_size = world_size
        self.tasks = [ctx.Queue() for _ in range(world_size)]
        self.results = ctx.Queue()
        port = _free_port()
        self.procs = [ctx.Process(target=_worker, args=(r, world_size, port, self.tasks[r], self.results),
                                  daemon=True) for r in range(world_size)]
        for p in self.procs:
            p.start()

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def run(self, fn, *args, timeout: float = RUN_TIMEOUT_S, **kwargs) -> list:
        """Run ``fn(*args, **kwargs)`` on every rank; the per-rank results in rank order."""
        for t in self.tasks:
            t.put((fn, args, kwargs))
        out: dict[int, object] = {}
        errors: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        while len(out) + len(errors) < self.world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not self.alive():
                self.close()
                missing = sorted(set(range(self.world_size)) - set(out) - set(errors))
                detail = "".join(f"\n--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
                why = "timed out" if remaining <= 0 else "a worker process died"
                raise RuntimeError(f"{fn.__name__} at world_size={self.world_size}: {why} "
                                   f"after {timeout}s; ranks {missing} did not finish{detail}")
            try:
                rank, ok, val = self.results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                continue
            (out if ok else errors)[rank] = val
        if errors:
            self.close()  # a failed collective can leave the group unusable
            detail = "".join(f"\n--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
            raise AssertionError(f"{fn.__name__} failed on ranks {sorted(errors)} "
                                 f"(world_size={self.world_size}):{detail}")
        return [out[r] for r in range(self.world_size)]

    def stop(self) -> None:
        """Ask every worker to leave its loop (it destroys its process group and exits)."""
        for t in self.tasks:
            try:
                t.put(None)
            except Exception:  # noqa: BLE001 - best effort: the worker may be gone
                pass

    def join(self, deadline: float) -> None:
        """Wait for the workers until ``deadline`` (time.monotonic()), together; kill those still running."""
        for p in self.procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=2)

    def close(self) -> None:
        self.stop()
        self.join(time.monotonic() + CLOSE_GRACE_S)


class Pools:
    """One DistPool per world size, rebuilt after a failure."""

    def __init__(self):
        self._pools: dict[int, DistPool] = {}

    def run(self, world_size: int, fn, *args, timeout: float = RUN_TIMEOUT_S, **kwargs) -> list:
        pool = self._pools.get(world_size)
        if pool is None or not pool.alive():
            pool = self._pools[world_size] = DistPool(world_size)
        try:
            return pool.run(fn, *args, timeout=timeout, **kwargs)
        except BaseException:
            self._pools.pop(world_size, None)
            raise

    def close(self) -> None:
        """Every pool at once: all are asked to stop, then all are waited for together."""
        for p in self._pools.values():
            p.stop()
        deadline = time.monotonic() + CLOSE_GRACE_S
        for p in self._pools.values():
            p.join(deadline)
        self._pools.clear()
