"""A fixed CPU share per emulated rank: each rank computes like a device of its own.

Emulated ranks share this machine's cores (2 nodes x 2 ranks on 2 cores: half a core each when all
compute at once, the rate the calibration measures, ``experiments/cluster/emulator/emulation.py``).
Without a cap, a rank that waits on the network gives its core to its neighbours, which then compute
up to twice as fast. A method that waits more (a flat ring whose every step waits on the slow
inter-node hop) then gets its compute faster, one that hides its communication (the double ring,
overlap on) does not, and the comparison between them shrinks; a GPU does not compute faster because
its neighbour is idle. So each rank runs in a cpu cgroup of its own capped at ``cpus`` CPUs (CFS
bandwidth control, quota = period x cpus per period): the calibrated share, whatever its neighbours
do. Other load on the machine can still leave a rank less than its cap; records say what was
applied.

Both cgroup versions: v2 (``cpu.max`` in the unified hierarchy) and v1 (the ``cpu`` controller's
``cpu.cfs_quota_us``). Where neither is writable the ranks run uncapped and ``create`` says why.
Groups are named ``<run id>-n<node>r<rank>`` like the rank namespaces and removed with them
(``netns.teardown``). The performance model's kernel timing (``experiments/perfmodel/emulated/measured.py``)
caps its processes the same way, so its table holds the times a capped rank sees.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

ENV = "BURST_EMU_RANK_CGROUP"     # cgroup directory template, {node} and {local_rank} left to fill
PERIOD_US = 100_000              # CFS's default period; BURST_EMU_CFS_PERIOD_US sets another
PERIOD_ENV = "BURST_EMU_CFS_PERIOD_US"
CGROUP = Path("/sys/fs/cgroup")


def period_us(environ=os.environ) -> int:
    """The CFS period the groups get: a rank may spend ``cpus x period`` CPU in each period, so a step
    shorter than a period runs in bursts at full speed and then waits; a shorter period makes the cap a
    steadier rate (ValueError outside the kernel's 1 ms - 1 s)."""
    raw = environ.get(PERIOD_ENV, "")
    if not raw:
        return PERIOD_US
    try:
        v = int(raw)
    except ValueError:
        v = -1
    if not 1000 <= v <= 1_000_000:
        raise ValueError(f"{PERIOD_ENV}={raw!r} must be an integer number of microseconds in [1000, 1000000]")
    return v


def period_s(cluster: dict) -> float:
    """The CFS period a record's ranks ran under, in seconds (its ``cpu_quota.period_us``; ``PERIOD_US`` where
    the record does not say)."""
    return float((cluster.get("cpu_quota") or {}).get("period_us") or PERIOD_US) / 1e6


def _root() -> tuple[Path, int] | str:
    """(directory under which to create groups, cgroup version), or why there is none."""
    v2 = CGROUP / "cgroup.controllers"
    if v2.exists():
        if "cpu" not in v2.read_text().split():
            return "cgroup v2 without the cpu controller"
        sub = (CGROUP / "cgroup.subtree_control").read_text().split()
        if "cpu" not in sub:
            try:
                (CGROUP / "cgroup.subtree_control").write_text("+cpu")
            except OSError as e:
                return f"cannot enable the cpu controller for sub-groups ({e})"
        return CGROUP, 2
    v1 = CGROUP / "cpu"
    if (v1 / "cpu.cfs_quota_us").exists():
        return v1, 1
    return "no cpu cgroup controller mounted under /sys/fs/cgroup"


def check_cpus(cpus: float) -> float:
    if not (isinstance(cpus, (int, float)) and 0.01 <= cpus <= 1024):
        raise ValueError(f"cpus={cpus!r} per rank must be a number in [0.01, 1024]")
    return float(cpus)


def create(run_id: str, names: list[str], cpus: float) -> tuple[str | None, str]:
    """One group per rank name (``<run id>-n<i>r<k>``) capped at ``cpus`` CPUs.

    Returns (directory template with ``{node}``/``{local_rank}``, "") or (None, why not applied)."""
    cpus = check_cpus(cpus)
    root = _root()
    if isinstance(root, str):
        return None, root
    base, version = root
    period = period_us()
    made = []
    try:
        for name in names:
            d = base / name
            d.mkdir(exist_ok=True)
            made.append(d)
            quota = max(1000, int(round(period * cpus)))
            if version == 2:
                (d / "cpu.max").write_text(f"{quota} {period}")
            else:
                (d / "cpu.cfs_period_us").write_text(str(period))
                (d / "cpu.cfs_quota_us").write_text(str(quota))
    except OSError as e:
        for d in made:
            _rmdir(d)
        return None, f"cannot create cpu cgroups under {base} ({e})"
    return str(base / f"{run_id}-n{{node}}r{{local_rank}}"), ""


def join(directory: str | Path, pid: int | None = None) -> None:
    """Move ``pid`` (default: this process) into the group; its children and threads follow."""
    (Path(directory) / "cgroup.procs").write_text(str(pid or os.getpid()))


def rank_dir(template: str, environ=os.environ) -> str:
    return template.format(node=environ.get("GROUP_RANK", "0"), local_rank=environ.get("LOCAL_RANK", "0"))


def _rmdir(d: Path, tries: int = 20) -> bool:
    for _ in range(tries):        # a group is removable once its last process has exited
        try:
            d.rmdir()
            return True
        except FileNotFoundError:
            return True
        except OSError:
            time.sleep(0.1)
    return False


def remove(run_id: str) -> list[str]:
    """Delete ``run_id``'s groups (after its processes have ended); returns those left behind."""
    root = _root()
    if isinstance(root, str):
        return []
    base, _ = root
    return [str(d) for d in sorted(base.glob(f"{run_id}-n*r*")) if d.is_dir() and not _rmdir(d)]
