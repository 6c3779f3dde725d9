"""A tiny deterministic discrete-event engine: tasks on named resources, with dependencies.

A *task* has a duration, a resource it occupies (``"compute/3"``: rank 3's
compute stream; ``"send.inter/7"``: rank 7's channel to the next node; None:
a zero-duration marker such as "this rank posted its receive") and the tasks
it waits for. Each resource runs its tasks one at a time in the order they
were added (a CUDA stream or an NCCL communicator is a FIFO queue), so

    start = max(end of the resource's previous task, end of every dependency)
    end   = start + duration

is computed when the task is added: tasks must be added after their
dependencies (schedule builders add them step by step, in program order).
A schedule given a ``cpu`` (``emulated/cfs.py``, opt-in) asks it for the end of
each compute-stream task instead: a CPU rank's compute under its cgroup's quota.
Nothing is fitted and nothing is random: the same schedule gives the same
times.

``critical_path()`` follows, from the task that ends last, the predecessor
that set each start time (the resource's previous task or the latest
dependency): the chain whose durations add up to the makespan. Splitting it
by task kind says how much of the time is exposed communication.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

KINDS = ("compute", "comm", "marker")


@dataclass(slots=True)
class Task:
    id: int
    name: str
    kind: str                          # "compute", "comm" or "marker"
    resource: str | None
    duration: float
    deps: tuple[int, ...]
    rank: int | None = None
    phase: str = ""                    # "forward" / "backward"
    nbytes: dict = field(default_factory=dict)   # {(phase, kind): bytes} a comm task sends
    flops: float = 0.0                 # work done by a compute task (for reports)
    start: float = 0.0
    end: float = 0.0
    bound_by: int | None = None        # the task whose end set this start (None: time 0)


class Schedule:
    """Tasks added in dependency order; times are known as soon as a task is added."""

    def __init__(self, cpu=None) -> None:
        self.tasks: list[Task] = []
        self._free: dict[str, tuple[float, int | None]] = {}   # resource -> (free at, last task)
        # a rank's compute under its CPU cgroup (emulated/cfs.py, opt-in): ``finish(rank, start, seconds)`` gives
        # a compute-stream task's end; None: start + duration
        self.cpu = cpu

    def add(self, name: str, *, kind: str, resource: str | None = None, duration: float = 0.0,
            deps=(), rank: int | None = None, phase: str = "", nbytes: dict | None = None,
            flops: float = 0.0) -> int:
        if kind not in KINDS:
            raise ValueError(f"kind={kind!r} must be one of {KINDS}")
        if not duration >= 0:   # also rejects nan
            raise ValueError(f"task {name!r}: duration={duration!r} must be >= 0")
        if kind == "marker" and (resource is not None or duration):
            raise ValueError(f"task {name!r}: a marker takes no resource and no time")
        deps = tuple(d for d in deps if d is not None)
        tasks = self.tasks
        if deps and not (0 <= min(deps) and max(deps) < len(tasks)):
            bad = next(d for d in deps if not 0 <= d < len(tasks))
            raise ValueError(f"task {name!r}: dependency {bad} has not been added yet")
        start, bound = self._free.get(resource, (0.0, None)) if resource is not None else (0.0, None)
        for d in deps:
            end = tasks[d].end
            if end > start or (bound is None and end >= start):
                start, bound = end, d
        duration = float(duration)
        if self.cpu is not None and kind == "compute" and resource is not None and resource.startswith("compute/"):
            duration = self.cpu.finish(int(resource.split("/")[1]), start, duration) - start
        t = Task(len(tasks), name, kind, resource, duration, deps, rank, phase,
                 dict(nbytes) if nbytes else {}, flops, start, start + duration, bound)
        self.tasks.append(t)
        if resource is not None:
            self._free[resource] = (t.end, t.id)
        return t.id

    def marker(self, name: str, deps=(), *, rank: int | None = None, phase: str = "") -> int:
        """A zero-duration point that waits for ``deps`` (e.g. 'rank r starts step s')."""
        return self.add(name, kind="marker", deps=deps, rank=rank, phase=phase)

    def end(self, ids=None) -> float:
        tasks = self.tasks if ids is None else [self.tasks[i] for i in ids if i is not None]
        return max((t.end for t in tasks), default=0.0)

    @property
    def makespan(self) -> float:
        return self.end()

    def critical_path(self) -> list[Task]:
        """The chain of tasks, first to last, that determines the makespan."""
        if not self.tasks:
            return []
        t = max(self.tasks, key=lambda x: (x.end, -x.id))
        path = [t]
        while t.bound_by is not None:
            t = self.tasks[t.bound_by]
            path.append(t)
        return path[::-1]

    def breakdown(self) -> dict:
        """Critical-path seconds by task kind, busy seconds per resource class (max over ranks)."""
        path = self.critical_path()
        crit = {k: 0.0 for k in ("compute", "comm")}
        for t in path:
            if t.kind in crit:
                crit[t.kind] += t.duration
        busy: dict[str, float] = defaultdict(float)
        for t in self.tasks:
            if t.resource is not None:
                busy[t.resource] += t.duration
        by_class: dict[str, float] = defaultdict(float)
        for res, b in busy.items():
            cls = res.split("/")[0]
            by_class[cls] = max(by_class[cls], b)
        ends = self.rank_ends()
        return {"makespan_s": self.makespan, "critical_compute_s": crit["compute"],
                "critical_comm_s": crit["comm"], "critical_tasks": len(path),
                "busy_max_s": dict(sorted(by_class.items())), "tasks": len(self.tasks),
                "mean_rank_end_s": sum(ends.values()) / len(ends) if ends else self.makespan}

    def rank_ends(self) -> dict[int, float]:
        """``{rank: end of its last task}`` (its compute and its sends): when that rank's step returns, the
        model's counterpart of a rank's own timer. The makespan is their maximum (the slowest rank's time);
        their mean is the mean rank's time (``time_mean_rank_s``)."""
        out: dict[int, float] = {}
        for t in self.tasks:
            if t.rank is not None and t.end > out.get(t.rank, -1.0):
                out[t.rank] = t.end
        return out

    def bytes_sent(self) -> dict[int, dict[tuple[str, str], int]]:
        """``{rank: {(phase, kind): bytes}}`` summed over the rank's communication tasks."""
        out: dict[int, dict] = defaultdict(lambda: defaultdict(int))
        for t in self.tasks:
            if t.kind == "comm":
                for key, b in t.nbytes.items():
                    out[t.rank][key] += b
        return {r: dict(v) for r, v in out.items()}
