"""The model as it is now against every committed run of an emulated experiment.

One run on this VM moves with the machine (how much: docs/findings.md, "The overlap probe at the hop size"), so
one run's verdict says little about the model and a change judged on one run is judged on noise. ``runs_of`` lists
the commits that changed an experiment's records under a results root; ``replay`` extracts each (``git archive``:
the records, the kernel table and the probes as that commit holds them) into a temporary root and prices it with
the model of the working tree, each run with its own probes, as its report did; ``history_table`` gives each
run's count within the target and each case's median error over the runs. A probe of the machine itself rather
than of a run's window (``MACHINE_FILES``: the send probe, the kernel's socket buffers) that a run's commit predates
comes from the working tree's root, so every run is priced with it. ``kernel_table`` prices every run with one
kernel table instead of its own (a table timed afresh on this machine: each run's records carry their own load,
which carries the table to it).

    burst-bench cluster history cpu_varlen_magiattention_2x4 --results results/reference/<root> --target 0.15
    burst-bench cluster history cpu_varlen_magiattention_2x4 --results results/reference/<root> \
        --kernel-table results/reference/<root>/cpu_varlen_magiattention_2x4/kernel_times.json
    burst-bench cluster history cpu_decode_full_2x4 --results results/reference/<root> --commits 66a8bfc,924248d
    burst-bench cluster history cpu_ttft_emulated_2x4 --results results/reference/<root> --bring-up-load
    burst-bench cluster history cpu_decode_full_2x4 --results results/reference/<root> --memory-rule bring-up

A run whose records the model cannot price now (a kernel key its table lacks, a record from before a field) is
listed with the reason and left out of the medians; nothing is measured here.
"""
from __future__ import annotations

import io
import statistics
import subprocess
import tarfile
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from ...harness import results as R
from .send_buffer import SEND_FILE
from .validate import KERNEL_TIMES_FILE, TARGET, check_memory_rule, validate_experiment
from .validate_decode import is_inference, validate_inference

MACHINE_FILES = (SEND_FILE,)     # the root's files of the machine, not of a run's window (module docstring)


@dataclass(frozen=True)
class Run:
    commit: str
    errors: dict = field(default_factory=dict)     # case label -> predicted / measured - 1
    skipped: str = ""                               # why the model could not price it


def _git(repo: Path, *args: str) -> bytes:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True).stdout


def _repo_path(results_root) -> tuple[Path, str]:
    """(the repository's top folder, ``results_root`` relative to it)."""
    root = Path(results_root).resolve()
    if not root.is_dir():
        raise ValueError(f"results={str(results_root)!r}: no such folder")
    try:
        top = Path(_git(root, "rev-parse", "--show-toplevel").decode().strip())
    except subprocess.CalledProcessError:
        raise ValueError(f"results={str(results_root)!r}: not inside a git repository (runs are commits)") from None
    return top, root.relative_to(top).as_posix()


def runs_of(results_root, experiment: str) -> list[str]:
    """Commits (oldest first) that changed ``<results_root>/<experiment>``'s records: one a run."""
    top, rel = _repo_path(results_root)
    out = _git(top, "log", "--format=%H", "--", f"{rel}/{experiment}/{R.RESULTS_FILE}").decode().split()
    return out[::-1]


def extract(commit: str, results_root, experiment: str, dest: Path, kernel_table: Path | None = None) -> Path:
    """The experiment's folder and the root's own files (probes it falls back to) as ``commit`` holds them,
    under ``dest`` (its kernel table replaced by ``kernel_table`` when given); returns the results root there."""
    top, rel = _repo_path(results_root)
    names = _git(top, "ls-tree", "--name-only", commit, f"{rel}/").decode().splitlines()
    files = [n for n in names if n.endswith(".json")]
    data = _git(top, "archive", "--format=tar", commit, f"{rel}/{experiment}", *files)
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        tar.extractall(dest, filter="data")
    for name in MACHINE_FILES:
        here, there = Path(results_root) / name, dest / rel / name
        if here.exists() and not there.exists():
            there.write_bytes(here.read_bytes())
    if kernel_table is not None:
        (dest / rel / experiment / KERNEL_TIMES_FILE).write_bytes(Path(kernel_table).read_bytes())
    return dest / rel


def _errors(root: Path, experiment: str, at_reference: bool = True, memory_rule: str = "compute",
            cfs: bool = False, lockstep: bool = False) -> dict:
    """{case label: error} of the model as it is now on the records under ``root`` (measuring nothing);
    ``at_reference``, ``memory_rule``, ``cfs`` and ``lockstep`` (training records only): as
    ``validate.validate_experiment``'s."""
    if is_inference(root, experiment):
        rows = validate_inference(root, experiment, measure_missing=False, write=False,
                                  at_reference=at_reference, memory_rule=memory_rule)["rows"]
        return {f"{r['mode']} G{r['world_size']} B{r['batch']} N{r['seqlen']} {r['row']}": r["error"] for r in rows}
    rows = validate_experiment(root, experiment, measure_missing=False, at_reference=at_reference,
                               memory_rule=memory_rule, cfs=cfs, lockstep=lockstep)["rows"]
    return {f"{r['method']} N{r['seqlen']} {r['case']}": r["error"] for r in rows}


def _commit(results_root, name: str) -> str:
    try:
        return _git(Path(results_root).resolve(), "rev-parse", "--verify", f"{name}^{{commit}}").decode().strip()
    except subprocess.CalledProcessError:
        raise ValueError(f"commits: {name!r} is not a commit of this repository") from None


def replay(results_root, experiment: str, commits: list[str] | None = None, *, at_reference: bool = True,
           memory_rule: str = "compute", kernel_table=None, cfs: bool = False, lockstep: bool = False) -> list[Run]:
    """Each run of ``commits`` (default ``runs_of``) priced by the model of the working tree; ``at_reference``
    False: every record at its run's bring-up load (``validate.compare``), as reports before 2026-12-07;
    ``memory_rule``: the load memory-bound work goes at (``validate.loads_of``); ``kernel_table``: one table for
    every run (``extract``); ``cfs``: the ranks' compute under CFS as a fluid (``cfs.py``, opt-in); ``lockstep``: each
    run's work x its own lockstep probe's factor (``lockstep.py``; 1 for a run without the probe; opt-in)."""
    check_memory_rule(memory_rule)
    if kernel_table is not None and not Path(kernel_table).is_file():
        raise ValueError(f"kernel_table={str(kernel_table)!r}: no such file")
    commits = commits or runs_of(results_root, experiment)
    if not commits:
        raise ValueError(f"experiment={experiment!r}: no commit changed its records under {results_root}")
    out = []
    for full in [_commit(results_root, c) for c in commits]:      # every name checked before any is priced
        with tempfile.TemporaryDirectory(prefix="burst-history-") as tmp:
            try:
                root = extract(full, results_root, experiment, Path(tmp), kernel_table)
                out.append(Run(full, _errors(root, experiment, at_reference, memory_rule, cfs, lockstep)))
            except (ValueError, KeyError, RuntimeError, subprocess.CalledProcessError) as e:
                why = (str(e).splitlines() or [type(e).__name__])[0].replace(f"{tmp}/", "")
                out.append(Run(full, skipped=why[:160]))
    return out


def history_table(runs: list[Run], target: float = TARGET, table: str = "kernel table") -> dict:
    """Text and numbers: per run, its cases within ``target``; per case, its median error over the priced runs
    that have it and how many of them put it within ``target``; the cases beyond it on one side in every run.
    ``table``: the kernel table the runs were priced with, as the heading names it."""
    priced = [r for r in runs if not r.skipped]
    cases = sorted({k for r in priced for k in r.errors})
    lines = [f"the model as it is now against {len(priced)} committed run(s) (of {len(runs)}), each with its own "
             f"probes and {table}; target |error| <= {target:.0%}",
             f"{'run':<10} {'within':>9} {'median |e|':>10} {'worst':>8}"]
    for r in runs:
        if r.skipped:
            lines.append(f"{r.commit[:9]:<10} not priced: {r.skipped}")
            continue
        a = [abs(x) for x in r.errors.values()]
        worst = max(r.errors.values(), key=abs)
        lines.append(f"{r.commit[:9]:<10} {sum(x <= target for x in a):>4} of {len(a):<2} {statistics.median(a):10.1%} "
                     f"{worst:+8.1%}")
    medians, same_side = {}, []
    lines.append(f"{'case':<64} {'median':>7} {'runs within':>11}  errors, run by run")
    for k in cases:
        xs = [r.errors[k] for r in priced if k in r.errors]
        medians[k] = statistics.median(xs)
        if all(x > target for x in xs) or all(x < -target for x in xs):
            same_side.append(k)
        lines.append(f"{k:<64} {medians[k]:+7.1%} {sum(abs(x) <= target for x in xs):>5} of {len(xs):<3}  "
                     + " ".join(f"{x * 100:+.0f}" for x in xs))
    a = [abs(x) for x in medians.values()]
    if a:
        lines.append(f"case medians: {sum(x <= target for x in a)} of {len(a)} within {target:.0%}, median "
                     f"{statistics.median(a):.1%}, worst {max(medians.values(), key=abs):+.1%}; beyond it on one "
                     f"side in every run: {', '.join(same_side) if same_side else 'none'}")
    return {"runs": [{"commit": r.commit, "skipped": r.skipped, "errors": r.errors} for r in runs],
            "case_medians": medians, "same_side": same_side, "target": target, "text": "\n".join(lines)}
