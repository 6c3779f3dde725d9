"""python -m experiments.report [--results DIR] [--out DIR] [--machine NAME]

Builds the reproduction report, ``reports/index.html`` and its Markdown twin ``reports/index.md``:
every claim of the papers next to what this suite measured (``results/<machine>/``, ``results/gpu_check/``,
the committed ``results/reference/``) and modelled (``results/modelled/``), the papers' values
(``experiments/paper/``), the model's error, and the figures under ``plots/``. Runs nothing.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

from ..cli import DEBUG_FLAG, DEBUG_HELP, prog, run_cli
from ..harness import results as R
from ..harness.env import REPO
from .build import write
from .context import REPORT_DIR, load_context


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=prog("python -m experiments.report"), description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", default=str(R.RESULTS_BASE), help="the results base folder (default: results/)")
    ap.add_argument("--out", default=str(REPORT_DIR), help="where the page goes (default: reports/)")
    ap.add_argument("--machine", default=None, help="whose run counts as this machine's (default: this machine)")
    ap.add_argument(DEBUG_FLAG, action="store_true", help=DEBUG_HELP)
    args = ap.parse_args(argv)
    if not Path(args.results).is_dir():
        raise ValueError(f"--results {args.results}: no such folder")
    t0 = time.perf_counter()
    html_path, md_path = write(load_context(Path(args.results), args.machine, Path(args.out)))
    shown = html_path.resolve()
    shown = shown.relative_to(REPO) if shown.is_relative_to(REPO) else shown
    print(f"report: {shown} (and {md_path.name}) in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(run_cli(main))
