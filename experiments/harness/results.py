"""Where result records live: one JSON line per case in ``<root>/<experiment>/results.jsonl``, in the
record type of ``record.py`` (its one writer and reader; here the paths, resume and unfinished cases).

Results belong to a machine: the root is ``results/<machine>/`` (``env.machine_slug``
for this machine, the cluster profile's name for a SLURM cluster), every record
names it (``machine``), and a run resumes only cases measured by the same machine
at the same commit (``done_case_ids``). Committed reference results live apart,
in ``results/reference/<machine>/``; the performance model's in ``results/modelled/``.

Written by rank 0 of the worker (ok/failed/oom), by the driver (skipped cases)
or by the executor (cases a broken launch left, ``executor.py``). ``load_results`` is the DataFrame of
the newest record of each case (``record.Record.row``).

Run-time bookkeeping lives in ``results/<experiment>/.work/``: a ``<case>.started``
marker while a case runs and ``<case>.rank<r>.err`` files written by ranks that
failed, so whoever finalises an unfinished case can say why it failed.
"""
from __future__ import annotations

import datetime
import json
import os
from pathlib import Path
from typing import Iterable

import pandas as pd

from . import env, record
from .axes import AXES
from .record import SCHEMA_VERSION, STATUSES, Record  # noqa: F401 - re-exported: the one record type
from .spec import Case
# Cases with one of these statuses are not run again unless --force
# (failed ones with --retry-failed); "skipped" is always re-evaluated, so a
# method registered later is picked up by the next run.
DONE_STATUSES = ("ok", "oom", "failed")
RESULTS_FILE = "results.jsonl"

# Keys every record's row has (tests check the schema against this list): what the writer requires of every
# record (``record.REQUIRED``), the row's envelope, the case's axes (from its config), ``kernel`` (the local
# attention kernel that ran, resolved by the worker on its device; in records written without running, the
# one asked for, or "auto") and the samples.
CASE_KEYS = ("method", "level", "mode", *AXES, "warmup", "repeats", "seed")
REQUIRED_KEYS = tuple(dict.fromkeys(("schema", "status", "reason", *record.REQUIRED, *CASE_KEYS, "kernel",
                                     "time_samples_s")))
# The machine records are written for (the results root's name); the driver sets it for every rank and job.
MACHINE_ENV = "EXPERIMENTS_MACHINE"
RESULTS_BASE = env.REPO / "results"


def current_machine() -> str:
    return os.environ.get(MACHINE_ENV) or env.machine_slug()


def machine_root(machine: str | None = None, base: Path | str = RESULTS_BASE) -> Path:
    """``results/<machine>/``: where this machine's (or cluster profile's) results go."""
    return Path(base) / (machine or current_machine())


def experiment_dir(results_root: Path | str, experiment: str) -> Path:
    return Path(results_root) / experiment


def work_dir(results_root: Path | str, experiment: str) -> Path:
    d = experiment_dir(results_root, experiment) / ".work"
    d.mkdir(parents=True, exist_ok=True)
    return d


# Where a record ran, beyond the machine: the cluster profile, the emulated link rates per class, ranks per
# core. The launcher sets it (JSON, experiments.cluster.emulator.emulated) for the driver and every rank.
CLUSTER_ENV = "EXPERIMENTS_CLUSTER"


def cluster_info(world_size: int) -> dict:
    try:
        info = json.loads(os.environ.get(CLUSTER_ENV) or "{}")
    except json.JSONDecodeError:
        info = {}
    info.setdefault("profile", None)
    info.setdefault("ranks_per_core", world_size / (os.cpu_count() or 1))
    return info


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def base_record(case: Case, status: str, reason: str = "", *, world_size: int | None = None,
                extra_config: dict | None = None) -> Record:
    """A new record of ``case``: its resolved config and provenance; producers fill in the rest."""
    cfg = case.to_dict()
    cfg.update(extra_config or {})
    rec = Record(status=status, reason=reason)
    rec.update({
        "experiment": case.experiment, "case_id": case.case_id, "method": case.method, "level": case.level,
        "mode": case.mode, "kernel": cfg.get("kernel") or "auto", "time_samples_s": [], "config": cfg,
        "timestamp": now(), "git": env.git_info(), "versions": env.versions(),
        "hardware": env.hardware(world_size or case.world_size), "machine": current_machine(),
        "cluster": cluster_info(world_size or case.world_size),
    })
    if cfg.get("variant"):       # a model-level row (model_cases.ModelVariant): summaries and figures key on it
        rec.update(variant=cfg["variant"], variant_label=cfg.get("variant_label") or cfg["variant"])
    return rec


def append_record(results_root: Path | str, rec: Record) -> None:
    """The one writer (``record.write``) at ``<root>/<experiment>/results.jsonl``."""
    if not isinstance(rec, Record):
        raise ValueError(f"rec={type(rec).__name__}: a result must be a record.Record (base_record builds one)")
    record.write(experiment_dir(results_root, rec.case.experiment) / RESULTS_FILE, rec)


def end_torn_line(path: Path | str) -> None:
    """A writer killed mid-line leaves no newline: end it, so the next record is not glued to it."""
    path = Path(path)
    if path.exists() and path.stat().st_size:
        with open(path, "rb+") as f:
            f.seek(-1, 2)
            if f.read(1) != b"\n":
                f.write(b"\n")


def read_records(path: Path | str) -> list[dict]:
    """The rows of every record of a results.jsonl (``record.read_rows``; a torn last line is ignored)."""
    return record.read_rows(path)


def latest_by_case(records: Iterable[dict]) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for r in records:
        out[r["case_id"]] = r  # file order is time order: the last one wins
    return out


def same_origin(rec: dict, machine: str, git: dict) -> bool:
    """Measured by ``machine`` at commit ``git['commit']`` with the same dirty flag (a dirty tree's
    diff is not recorded, so its records are only comparable with another dirty run of that commit)."""
    g = rec.get("git") or {}
    return (rec.get("machine") == machine and g.get("commit") == git.get("commit")
            and bool(g.get("dirty")) == bool(git.get("dirty")))


def done_case_ids(results_root: Path | str, experiment: str, *, retry_failed: bool = False,
                  machine: str | None = None, git: dict | None = None) -> set[str]:
    """Cases a run may skip: their newest record from this machine and commit (``same_origin``) is
    done. Records from another machine or commit never count: a fresh clone re-measures."""
    done = DONE_STATUSES if not retry_failed else ("ok", "oom")
    machine, git = machine or current_machine(), git or env.git_info()
    mine = [r for r in read_records(experiment_dir(results_root, experiment) / RESULTS_FILE)
            if same_origin(r, machine, git)]
    return {cid for cid, r in latest_by_case(mine).items() if r.get("status") in done}


def result_roots(base: Path | str = RESULTS_BASE) -> list[Path]:
    """Every results root under ``base`` (a folder holding <experiment>/results.jsonl folders):
    ``results/<machine>``, ``results/reference/<machine>``, ``results/modelled``, ``base`` itself."""
    base = Path(base)
    if not base.exists():
        return []
    roots = {p.parent.parent for p in base.glob(f"**/{RESULTS_FILE}")
             if not any(part.startswith(".") for part in p.relative_to(base).parts)}
    return sorted(roots)


def load_results(results_root: Path | str, experiment: str | None = None):
    """A pandas DataFrame of the newest record per case (all experiments, or one)."""
    root = Path(results_root)
    dirs = [root / experiment] if experiment else sorted(p for p in root.iterdir() if p.is_dir())
    rows = []
    for d in dirs:
        rows.extend(latest_by_case(read_records(d / RESULTS_FILE)).values())
    # a row names every record field; a column no record of these has a value for is left out, so that
    # "x" in df means "these records measured x" (what the figures test before drawing a quantity)
    return pd.DataFrame(rows).dropna(axis=1, how="all")


# ---------------------------------------------------------------- unfinished cases


def marker_path(results_root, case: Case) -> Path:
    return work_dir(results_root, case.experiment) / f"{case.case_id}.started"


def write_marker(results_root, case: Case, group: list[str] | None = None) -> None:
    """The case has started; ``group``: the ids of the cases timed with it (finalisation charges a failure
    to the case that caused it)."""
    marker_path(results_root, case).write_text(json.dumps({"started": now(), "group": group or [case.case_id]}))


def _marker(results_root, case: Case) -> dict:
    try:
        return json.loads(marker_path(results_root, case).read_text())
    except (OSError, ValueError):
        return {}


def current_path(results_root, experiment: str, rank: int) -> Path:
    return work_dir(results_root, experiment) / f"current.rank{rank}"


def write_current(results_root, case: Case, rank: int) -> None:
    """The case this rank runs now (a rank killed outright leaves no error file, only this)."""
    p = current_path(results_root, case.experiment, rank)
    tmp = p.with_name(p.name + ".tmp")     # per rank: ranks write at the same time
    tmp.write_text(case.case_id)
    os.replace(tmp, p)


def _currents(results_root, experiment: str) -> dict[int, str]:
    out = {}
    for p in work_dir(results_root, experiment).glob("current.rank*"):
        if p.name.endswith(".tmp"):
            continue
        try:
            out[int(p.name.rsplit(".rank", 1)[1])] = p.read_text().strip()
        except (OSError, ValueError):
            continue
    return out


def err_path(results_root, case: Case, rank: int) -> Path:
    return work_dir(results_root, case.experiment) / f"{case.case_id}.rank{rank}.err"


def write_rank_error(results_root, case: Case, rank: int, status: str, reason: str) -> None:
    err_path(results_root, case, rank).write_text(json.dumps({"status": status, "reason": reason}))


def rank_errors(results_root, case: Case) -> list[dict]:
    d = work_dir(results_root, case.experiment)
    out = []
    for p in sorted(d.glob(f"{case.case_id}.rank*.err")):
        try:
            e = json.loads(p.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        e["rank"] = int(p.name.rsplit(".rank", 1)[1].split(".")[0])
        out.append(e)
    return out


def clear_work(results_root, case: Case) -> None:
    for p in [marker_path(results_root, case), *work_dir(results_root, case.experiment).glob(
            f"{case.case_id}.rank*.err")]:
        p.unlink(missing_ok=True)


_PEER_LOST = ("connection closed by peer", "connection reset by peer", "read error", "broken pipe",
              "socket closed", "connection refused")


def peer_lost(reason: str) -> bool:
    r = reason.lower()
    return any(x in r for x in _PEER_LOST)


def _dead_ranks(results_root, case: Case) -> list[int]:
    """Ranks that were running ``case`` (``current.rank<r>``) and left no error of their own: killed outright."""
    with_err = {e["rank"] for e in rank_errors(results_root, case)}
    return sorted(r for r, cid in _currents(results_root, case.experiment).items()
                  if cid == case.case_id and r not in with_err)


def failure_from_errors(results_root, case: Case, default_reason: str) -> tuple[str, str]:
    """(status, reason) of a case that did not finish: OOM if any rank ran out of memory; else the rank
    that died in it (its peers' lost connections are consequences), else the first rank's error."""
    errs = rank_errors(results_root, case)
    ooms = [e for e in errs if e.get("status") == "oom"]
    if ooms:
        return "oom", f"rank {ooms[0]['rank']}: {ooms[0]['reason']}"
    timeouts = [e for e in errs if "timeout" in e.get("reason", "").lower()]
    causes = [e for e in errs if not peer_lost(e.get("reason", ""))]
    pick = (timeouts[0] if timeouts else causes[0] if causes else None)
    if pick is not None:
        return "failed", f"rank {pick['rank']}: {pick['reason']}"
    dead = _dead_ranks(results_root, case)
    if dead:
        # torchrun stops a node's other ranks once one exits, so several may look dead; all are named
        who = f"rank {dead[0]}" if len(dead) == 1 else "ranks " + ", ".join(map(str, dead))
        why = (f"{who} ended while running this case without an error of its own (killed by a signal or "
               "the OOM killer, or stopped by torchrun after another rank ended)")
        return "failed", "; ".join([why, *(f"rank {e['rank']}: {e['reason']}" for e in errs)])
    if errs:
        return "failed", f"rank {errs[0]['rank']}: {errs[0]['reason']}"
    return "failed", default_reason


def _culprits(results_root, group: list[str], by_id: dict[str, Case], experiment: str) -> set[str]:
    """Which cases of an interleaved group caused its failure: those with an error of their own that is
    not a lost peer; else those that a rank which left no error file (killed outright) was running;
    else, nothing being known, all of them."""
    errs = {cid: rank_errors(results_root, by_id[cid]) for cid in group if cid in by_id}
    caused = {cid for cid, es in errs.items() if any(not peer_lost(e.get("reason", "")) for e in es)}
    if caused:
        return caused
    ranks_with_err = {e["rank"] for es in errs.values() for e in es}
    hard = {cid for r, cid in _currents(results_root, experiment).items() if r not in ranks_with_err and cid in group}
    return hard or set(group)


def finalize_unfinished(results_root, cases: list[Case], default_reason: str) -> list[str]:
    """Record every case that was started but has no record since; returns their ids.

    A case timed in an interleaved group (its marker lists the group) is recorded only if it caused
    the failure (``_culprits``); the others are left unrecorded, so the next launch runs them again."""
    out: list[str] = []
    by_exp: dict[str, dict] = {}
    by_id = {c.case_id: c for c in cases}
    unfinished: list[tuple[Case, dict]] = []
    for case in cases:
        marker = marker_path(results_root, case)
        if not marker.exists():
            continue
        if case.experiment not in by_exp:
            by_exp[case.experiment] = latest_by_case(
                read_records(experiment_dir(results_root, case.experiment) / RESULTS_FILE))
        rec = by_exp[case.experiment].get(case.case_id)
        started = marker.stat().st_mtime
        if rec is None or datetime.datetime.fromisoformat(rec["timestamp"]).timestamp() < started - 1:
            unfinished.append((case, _marker(results_root, case)))
        else:
            clear_work(results_root, case)
    for case, m in unfinished:
        group = [g for g in (m.get("group") or [case.case_id])]
        if len(group) > 1 and case.case_id not in _culprits(results_root, group, by_id, case.experiment):
            continue
        status, reason = failure_from_errors(results_root, case, default_reason)
        if not rank_errors(results_root, case) and len(group) > 1:
            others = [f"rank {e['rank']} (in {cid.split('.')[0]}): {e['reason']}" for cid in group if cid in by_id
                      for e in rank_errors(results_root, by_id[cid])]
            reason = "; ".join([reason, *others])
        append_record(results_root, base_record(case, status, reason))
        out.append(case.case_id)
    for case, _ in unfinished:
        clear_work(results_root, case)
    for exp in {c.experiment for c, _ in unfinished}:
        for p in work_dir(results_root, exp).glob("current.rank*"):
            p.unlink(missing_ok=True)
    return out
