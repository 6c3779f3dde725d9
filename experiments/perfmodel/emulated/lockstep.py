"""A rank that meets its peers on the emulated cluster runs its work at another share of a core than free-running.

The kernel table times its work free-running at the ranks' cap (``measured.py``), so the model prices a step at
the free share. A decode step waits for its peers at each of its collectives. Where the ranks' quotas fill the
cores (G 8 at 0.25 on 2), ranks that meet after each piece of work fall out of phase with the scheduler's
periods and run at less than the table's share (docs/findings.md, "A reference in every group's rounds"). The
lockstep probe (``cluster/emulator/lockstep_probe.py``, ``burst-bench cluster lockstep``) measures the ratio, free
share over lockstep share, in rounds that time both in the same minute, at pieces of 2-50 ms of CPU, at each world
size it was run at.

The factor of a world size is the median of its rows' factors: the probe's pieces span a decode step's CPU
between meetings on the 2 x 4 mirrors, and over them it shows no trend beyond its own spread (docs/findings.md,
"The lockstep probe"). An inference validation multiplies every piece of the model's CPU work
priced from the free-running table (kernels, memory traffic, the host term per op) by it; the messages' and
transfers' costs come from probes that ran their ranks in lockstep and keep their own. A world size the file
lacks, or a run without the file, is priced at 1 (as before the probe).

    factors = load_lockstep(results_root, profile, experiment)     # {world size: factor} or None
"""
from __future__ import annotations

import json
import statistics

from .excess import probe_path

LOCKSTEP_FILE = "lockstep_probe.json"


def factors_of(rows: list[dict]) -> dict[int, float]:
    """``{world size: the median of its compute rows' factors}`` (rows before the probe had memory pieces are
    compute rows; a memory piece's row is the probe's diagnostic, which the model does not read)."""
    by_world: dict[int, list[float]] = {}
    for r in rows:
        if r.get("piece", "compute") != "compute":
            continue
        by_world.setdefault(int(r["world_size"]), []).append(float(r["factor"]))
    return {g: statistics.median(f) for g, f in sorted(by_world.items())}


def load_lockstep(results_root, profile: str | None, experiment: str | None = None) -> dict | None:
    """``{"factors": {world size: factor}, "path": ...}`` of ``LOCKSTEP_FILE`` (``excess.probe_path``: the
    experiment's own where it has one), from its rows measured on ``profile``; None without such rows."""
    path = probe_path(results_root, LOCKSTEP_FILE, experiment)
    if not path.exists():
        return None
    rows = [r for r in json.loads(path.read_text())["rows"] if profile is None or r.get("profile") == profile]
    return {"factors": factors_of(rows), "path": str(path)} if rows else None


def factor(lockstep: dict | None, world_size: int) -> float:
    """The factor at ``world_size`` (1 where the probe did not measure it)."""
    return float(((lockstep or {}).get("factors") or {}).get(world_size, 1.0))


def lockstep_text(lockstep: dict | None) -> str:
    if not lockstep:
        return (f"no {LOCKSTEP_FILE}: the ranks' work priced at the free-running share of the kernel table "
                "(lockstep factor 1)")
    per = ", ".join(f"G {g} x{f:.3f}" for g, f in lockstep["factors"].items())
    return (f"lockstep factor (free share / the share of ranks meeting after each piece, "
            f"{lockstep['path']}): {per}; on the kernels, memory traffic and host term")
