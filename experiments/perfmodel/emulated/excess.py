"""The overlap excess of the emulated cluster's transfers, fitted to its overlap probe.

What a transfer takes from its sender's compute while it runs under it (``EmulatedCosts.excess``),
per link class: the least-squares fit of the CPU excess the overlap probe measured on this cluster (a line
in bytes, or a plane in bytes and in the compute the hop runs beside: ``fit_excess``; ``python -m
experiments.cluster overlap <profile> --out <results root>/overlap_probe.json``: the CPU seconds a hop adds
to its rank's step, at the rank's CPU rate; ``ring`` cases for intra, ``pair`` cases for inter), no term
below 0. Without that file hidden transfers are free, as on a
GPU. Why the CPU excess and not the probe's wall excess: docs/perfmodel.md#overlap-excess.
"""
from __future__ import annotations

import json
from pathlib import Path

from .fits import line, plane

OVERLAP_FILE = "overlap_probe.json"
# the probe's case per hop pattern: an intra-node ring; an inter-node hop whose sender also receives across
# (a pair exchange: the double ring's inter ring), or one whose sender receives inside its node (a flat ring's
# edge rank: the ``oneway`` case)
EXCESS_PATTERN = {"intra": "ring", "inter": "pair", "inter_oneway": "oneway"}


def fit_excess(rows: list[dict], cpus: float | None = None) -> dict[str, tuple]:
    """``{class: (excess_s, excess_s_per_byte[, excess_s_per_beside_s])}``: per link class the least-squares fit
    of the probe's CPU excess (``cpu_excess_s``) over its cases, no term below 0.

    Where the class's cases hold one hop size beside two sizes of compute (a ``<pattern>:16:<bytes>`` case beside
    a block's) and the probe names the ranks' cap ``cpus``, the fit is a plane in bytes and in the compute beside
    the hop (the case's compute CPU at the cap, ``compute_cpu_s / cpus``): a hop beside no compute costs about its
    own CPU, one beside a 512-token block several times that (docs/findings.md, "What a hop costs beside the
    compute it overlaps"). Otherwise a line in bytes (one case: all of it per byte), as probes before
    2026-12-07 were fitted."""
    out: dict[str, tuple] = {}
    for klass, pattern in EXCESS_PATTERN.items():
        mine = [r for r in rows if r["pattern"] == pattern]
        if not mine:
            continue
        blocks: dict[int, set] = {}         # hop size -> the block sizes (tokens) measured beside it
        for r in mine:
            blocks.setdefault(int(r["bytes"]), set()).add(r.get("tokens"))
        if cpus and any(len(v) > 1 for v in blocks.values()):
            out[klass] = plane([(float(r["bytes"]), float(r["compute_cpu_s"]) / cpus, float(r["cpu_excess_s"]))
                                 for r in mine])
        else:
            out[klass] = line([(float(r["bytes"]), float(r["cpu_excess_s"])) for r in mine], one_size="slope")
    return out


def excess_text(fit: dict) -> str:
    """``intra 2.86 ms + 4.34 ns/B[ + 0.088 x the compute beside it], ...``."""
    return ", ".join(f"{k.replace('_', ' ')} {c[0] * 1e3:.2f} ms + {c[1] * 1e9:.2f} ns/B"
                     + (f" + {c[2]:.3f} x the compute beside it" if len(c) > 2 else "") for k, c in fit.items())


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
    cpus = ((rec.get("cluster") or {}).get("cpu_quota") or {}).get("cpus_per_rank")
    return {"fit": fit_excess(rec["rows"], cpus), "path": str(path), "commit": (rec.get("git") or {}).get("commit")}
