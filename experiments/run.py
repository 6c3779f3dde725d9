"""Run an experiment spec or a preset.

    python -m experiments.run cpu                       # the CPU preset (all CPU specs)
    python -m experiments.run experiments/cpu/fig2_train.yaml
    python -m experiments.run fig2_train_7b_8gpu --dry-run   # print the commands, run nothing
    python -m experiments.run a100_32                   # cluster preset: SLURM jobs, one per world size

Cases that already have a result are skipped (``--force`` re-runs them,
``--retry-failed`` re-runs failed ones). Cases that cannot run on this machine
(an adapter whose package is missing) are recorded as skipped with the reason
and re-evaluated by every run.
"""
from __future__ import annotations

import argparse
import json
import shlex
import shutil
import subprocess
import sys
import time
from collections import OrderedDict
from pathlib import Path

import yaml

from .cluster.slurm import render_sbatch, write_sbatch
from .harness import results as R
from .harness.env import REPO
from .harness.launch import run_batch, worker_cmd
from .harness.spec import Case, Preset, Spec, case_problem, load_any


def _cost(c: Case) -> float:
    """Rough relative cost of a case, so the progress bar's time-left estimate is sensible."""
    work = c.batch * c.seqlen ** 2 * c.heads * c.head_dim / c.world_size * (0.5 if c.causal else 1.0)
    mode = {"forward": 1.0, "backward": 2.5, "fwd_bwd": 3.5}[c.mode]
    return 1.0 + (c.warmup + c.repeats + 3) * mode * work / 2e9


def plan(preset: Preset, *, results_root: Path, force: bool, retry_failed: bool
         ) -> "OrderedDict[tuple[str, int], list[Case]]":
    """Pending cases grouped by (spec, world size), in spec order."""
    batches: OrderedDict[tuple[str, int], list[Case]] = OrderedDict()
    for spec in preset.specs:
        done = set() if force else R.done_case_ids(results_root, spec.name, retry_failed=retry_failed)
        for c in spec.cases():
            if c.case_id not in done:
                batches.setdefault((spec.name, c.world_size), []).append(c)
    return batches


def write_resolved(spec: Spec, results_root: Path) -> None:
    d = R.experiment_dir(results_root, spec.name)
    d.mkdir(parents=True, exist_ok=True)
    (d / "spec.resolved.yaml").write_text(yaml.safe_dump(spec.resolved(), sort_keys=False))


def _progress():
    from rich.console import Console
    from rich.progress import (BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn)

    import os

    # Logs (make reproduce > log) are not terminals: keep one line per case readable there too.
    console = Console(stderr=False, width=None if os.isatty(1) else 150)
    # Everything shown comes from outside rich's markup language (spec names, case ids, exception
    # texts such as gloo's "[/__w/pytorch/.../pair.cc:537]"): print it literally (markup=False, Text).
    return console, Progress(TextColumn("{task.fields[pos]}", style="bold", markup=False),
                             TextColumn("{task.description}", markup=False),
                             BarColumn(), TimeElapsedColumn(), TextColumn("left"), TimeRemainingColumn(),
                             console=console, transient=False, refresh_per_second=4)


def run_local(preset: Preset, batches, *, results_root: Path) -> dict[str, int]:
    from rich.text import Text

    console, progress = _progress()
    total_cases = sum(len(v) for v in batches.values())
    counts = {s: 0 for s in R.STATUSES}
    seen: set[tuple[str, str]] = set()
    with progress:
        task = progress.add_task("starting", total=sum(_cost(c) for v in batches.values() for c in v),
                                 pos=f"0/{total_cases}")
        cost = {(c.experiment, c.case_id): _cost(c) for v in batches.values() for c in v}

        def on_record(rec: dict) -> None:
            key = (rec["experiment"], rec["case_id"])
            if key in seen or key not in cost:
                return
            seen.add(key)
            counts[rec["status"]] = counts.get(rec["status"], 0) + 1
            progress.update(task, advance=cost[key], pos=f"{len(seen)}/{total_cases}")
            t = rec.get("time_median_s")
            reason = " ".join(str(rec.get("reason") or "").split())  # one line per case in logs
            detail = f"{t * 1e3:9.1f} ms" if rec["status"] == "ok" and t else reason[:110]
            style = {"ok": "green", "oom": "yellow", "failed": "red", "skipped": "dim"}[rec["status"]]
            console.print(Text.assemble((f"{rec['status']:>7}", style),
                                        f" {rec['experiment']:<24} {rec['case_id']:<70} {detail}"),
                          overflow="ellipsis", no_wrap=True, highlight=False)

        def on_start(c: Case) -> None:
            progress.update(task, description=f"{c.experiment} G={c.world_size} {c.case_id}")

        for (spec_name, ws), cases in batches.items():
            runnable = []
            for c in cases:
                why = case_problem(c)
                if why:
                    R.append_record(results_root, R.base_record(c, "skipped", why))
                    on_record(R.latest_by_case(R.read_records(
                        R.experiment_dir(results_root, c.experiment) / R.RESULTS_FILE))[c.case_id])
                else:
                    runnable.append(c)
            progress.update(task, description=f"{spec_name} G={ws}: launching {len(runnable)} case(s)")
            device = next(s for s in preset.specs if s.name == spec_name).profile.device
            run_batch(runnable, results_root=results_root, device=device, repo=REPO,
                      on_record=on_record, on_start=on_start)
    return counts


def run_slurm(preset: Preset, batches, *, results_root: Path, dry_run: bool, wait: bool) -> None:
    for (spec_name, ws), cases in batches.items():
        spec = next(s for s in preset.specs if s.name == spec_name)
        prof = spec.profile
        work = R.work_dir(results_root, spec_name)
        cases_file = work / f"batch-G{ws}.json"
        cases_file.write_text(json.dumps([c.to_dict() for c in cases]))
        script = render_sbatch(spec_name=spec_name, profile=prof, world_size=ws, n_cases=len(cases),
                               cases_file=str(cases_file.resolve()), results_root=str(results_root.resolve()),
                               repo=str(REPO), log_dir=str(R.experiment_dir(results_root, spec_name).resolve()),
                               launch_timeout_s=int(sum(c.case_timeout_s for c in cases) + 600))
        path = write_sbatch(R.experiment_dir(results_root, spec_name) / "slurm" / f"{spec_name}-G{ws}.sbatch",
                            script)
        cmd = ["sbatch", "--parsable", *(["--wait"] if wait else []), str(path)]
        if dry_run or not shutil.which("sbatch"):
            print(f"# {spec_name}, world size {ws}: {len(cases)} case(s) -> {path}")
            print(script)
            print("$ " + shlex.join(cmd))
            if not dry_run:
                print("sbatch is not installed here: submit the script above on the cluster.")
            continue
        out = subprocess.run(cmd, capture_output=True, text=True)
        print(f"{spec_name} G={ws}: {'job ' + out.stdout.strip() if out.returncode == 0 else out.stderr}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.run", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", help="preset name (experiments/presets/<name>.yaml), spec name or spec file")
    ap.add_argument("--cluster", "--target", dest="cluster",
                    help="override the specs' cluster profile (cpu, local or experiments/clusters/<name>); "
                         "--target is its old name")
    ap.add_argument("--results", default=str(REPO / "results"), help="results root (default: results/)")
    ap.add_argument("--plots", default=str(REPO / "plots"), help="figures root (default: plots/)")
    ap.add_argument("--dry-run", action="store_true", help="print the launch commands / SLURM scripts only")
    ap.add_argument("--force", action="store_true", help="re-run cases that already have results")
    ap.add_argument("--retry-failed", action="store_true", help="re-run cases recorded as failed")
    ap.add_argument("--no-plots", action="store_true", help="do not redraw figures after a local run")
    ap.add_argument("--wait", action="store_true", help="SLURM: sbatch --wait (block until each job ends)")
    args = ap.parse_args(argv)

    preset = load_any(args.what, cluster=args.cluster)
    results_root = Path(args.results)
    batches = plan(preset, results_root=results_root, force=args.force, retry_failed=args.retry_failed)
    n = sum(len(v) for v in batches.values())
    total = sum(len(s.cases()) for s in preset.specs)
    print(f"{preset.name}: {len(preset.specs)} spec(s), {total} case(s), {n} to run "
          f"({total - n} already have results{'' if not args.force else '; --force'})")
    profiles = {s.profile.scheduler for s in preset.specs}
    if len(profiles) > 1:
        raise SystemExit("a preset must not mix local and SLURM cluster profiles")
    if not args.dry_run:
        for spec in preset.specs:
            write_resolved(spec, results_root)
    if profiles == {"slurm"}:
        run_slurm(preset, batches, results_root=results_root, dry_run=args.dry_run, wait=args.wait)
        return 0
    if args.dry_run:
        for (spec_name, ws), cases in batches.items():
            spec = next(s for s in preset.specs if s.name == spec_name)
            dev = spec.profile.device
            cmd = worker_cmd(R.experiment_dir(results_root, spec_name) / ".work" / f"batch-G{ws}.json",
                             results_root, ws, dev)
            print(f"# {spec_name}, world size {ws}: {len(cases)} case(s)")
            print("$ " + shlex.join(cmd))
        return 0
    t0 = time.monotonic()
    counts = run_local(preset, batches, results_root=results_root)
    print(f"done in {time.monotonic() - t0:.0f} s: " + ", ".join(f"{v} {k}" for k, v in counts.items() if v))
    if not args.no_plots:
        from .plots import draw_all

        files = draw_all(results_root, Path(args.plots), experiments=[s.name for s in preset.specs])
        print(f"{len(files)} figure(s) in {args.plots}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
