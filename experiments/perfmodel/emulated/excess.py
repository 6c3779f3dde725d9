"""The overlap excess of the emulated cluster's transfers, fitted to its overlap probe.

What a transfer takes from its sender's compute while it runs under it (``EmulatedCosts.excess``),
per link class: the least-squares line through the CPU excess the overlap probe measured on this
cluster (``python -m experiments.cluster overlap <profile> --out <results root>/overlap_probe.json``:
the CPU seconds a hop adds to its rank's step, at the rank's CPU rate; ``ring`` cases for intra,
``pair`` cases for inter), no term below 0. Without that file hidden transfers are free, as on a
GPU. Why the CPU excess and not the probe's wall excess: docs/perfmodel.md#overlap-excess.
"""
from __future__ import annotations

import json
from pathlib import Path

OVERLAP_FILE = "overlap_probe.json"
# the probe's case per hop pattern: an intra-node ring; an inter-node hop whose sender also receives across
# (a pair exchange: the double ring's inter ring), or one whose sender receives inside its node (a flat ring's
# edge rank: the ``oneway`` case)
EXCESS_PATTERN = {"intra": "ring", "inter": "pair", "inter_oneway": "oneway"}


def fit_excess(rows: list[dict]) -> dict[str, tuple[float, float]]:
    """``{class: (excess_s, excess_s_per_byte)}``: per link class the least-squares line of the probe's
    CPU excess (``cpu_excess_s``) against bytes over its cases (one case: all of it per byte), neither
    term below 0."""
    out = {}
    for klass, pattern in EXCESS_PATTERN.items():
        pts = [(float(r["bytes"]), float(r["cpu_excess_s"])) for r in rows if r["pattern"] == pattern]
        if not pts:
            continue
        xs = {x for x, _ in pts}
        if len(xs) < 2:
            out[klass] = (0.0, max(0.0, sum(y for _, y in pts) / sum(x for x, _ in pts)))
            continue
        mx, my = sum(x for x, _ in pts) / len(pts), sum(y for _, y in pts) / len(pts)
        k = sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)
        k = max(0.0, k)
        a = my - k * mx
        if a < 0:                     # through the origin instead
            a, k = 0.0, max(0.0, sum(x * y for x, y in pts) / sum(x * x for x, _ in pts))
        out[klass] = (a, k)
    return out


def probe_path(results_root, name: str, experiment: str | None = None) -> Path:
    """The probe file ``name`` of ``experiment`` where it has its own (``<root>/<experiment>/<name>``: measured
    in its run's window, docs/emulator.md), else the results root's. On this VM the machine's speed moves by
    40% between windows minutes apart (docs/findings.md), so a probe from another hour misprices a run."""
    if experiment:
        own = Path(results_root) / experiment / name
        if own.exists():
            return own
    return Path(results_root) / name


def read_probe(results_root, name: str, profile: str | None, experiment: str | None = None) -> tuple[Path, dict] | None:
    """(path, record) of the probe file ``name`` (``probe_path``), when it was measured on ``profile``."""
    path = probe_path(results_root, name, experiment)
    if not path.exists():
        return None
    rec = json.loads(path.read_text())
    if profile is not None and rec.get("profile") != profile:
        return None
    return path, rec


def load_excess(results_root, profile: str | None, experiment: str | None = None) -> dict | None:
    """The fitted excess of the overlap probe (``probe_path``), when it was measured on ``profile``."""
    found = read_probe(results_root, OVERLAP_FILE, profile, experiment)
    if found is None:
        return None
    path, rec = found
    if any("cpu_excess_s" not in r for r in rec["rows"]):
        raise ValueError(f"{path}: a probe record without cpu_excess_s (written before it was measured); "
                         f"re-run python -m experiments.cluster overlap {rec.get('profile')} --out {path}")
    return {"fit": fit_excess(rec["rows"]), "path": str(path), "commit": (rec.get("git") or {}).get("commit")}
