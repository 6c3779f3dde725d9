"""A SLURM job's own results folder, merged into the shared results at the end of the job.

A job writes ``<results>/.jobs/<job id>/<experiment>/results.jsonl`` (and its
run-time markers) so that jobs sharing a node or a file system never append
to one file. Its last step (``slurm.py``), once the executor has recorded
every case of the job (``experiments.harness.executor``), appends the job's
records to ``<results>/<experiment>/results.jsonl`` under an exclusive lock
and removes the job's folder. A job killed before that step leaves its folder
behind; ``merge_leftovers`` (run by ``experiments.run`` before planning) merges it.

    python -m experiments.cluster.jobs merge --job DIR --results ROOT
"""
from __future__ import annotations

import argparse
import fcntl
import shutil
import sys
from pathlib import Path

from ..harness import record, results as R

JOBS_DIR = ".jobs"


def merge(job_root: Path, results_root: Path) -> int:
    """Append the job's records to the shared results files (exclusive lock per file); returns the count."""
    n = 0
    for src in sorted(Path(job_root).glob(f"*/{R.RESULTS_FILE}")):
        good = [record.dumps(r) for r in record.read(src)]   # the one reader skips a torn last line
        dst = R.experiment_dir(results_root, src.parent.name) / R.RESULTS_FILE
        dst.parent.mkdir(parents=True, exist_ok=True)
        with open(dst, "a", encoding="utf-8") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                f.write("".join(good))
                f.flush()
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)
        n += len(good)
    shutil.rmtree(job_root, ignore_errors=True)
    try:
        Path(job_root).parent.rmdir()       # .jobs/, once no job is left in it
    except OSError:
        pass
    return n


def merge_leftovers(results_root: Path) -> int:
    """Merge job folders that a killed job left behind (no job is running: call before submitting)."""
    d = Path(results_root) / JOBS_DIR
    return sum(merge(p, results_root) for p in sorted(d.iterdir()) if p.is_dir()) if d.exists() else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.cluster.jobs")
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("merge", help="merge the job's records into the shared results, remove its folder")
    m.add_argument("--job", required=True)
    m.add_argument("--results", required=True)
    args = ap.parse_args(argv)
    n = merge(Path(args.job), Path(args.results))
    print(f"merged {n} record(s) into {args.results}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
