"""Run an experiment spec or a preset.

    python -m experiments.run cpu                       # the CPU preset (all CPU specs)
    python -m experiments.run experiments/cpu/fig2_train.yaml
    python -m experiments.run fig2_train_7b_8gpu --dry-run   # print the commands, run nothing
    python -m experiments.run a100_32                   # cluster preset: SLURM jobs, one per world size

Results belong to a machine: they go to ``results/<machine>/`` (this machine's
hardware slug, or the SLURM cluster profile's name) and plots to
``plots/<machine>/``. Cases that already have a result from the same machine
and commit are skipped (``--force`` re-runs them, ``--retry-failed`` re-runs
failed ones); results from another machine or commit (e.g. the committed
``results/reference/``) never count, so a fresh clone re-measures. The run ends
with a summary per experiment (``experiments.harness.summary``): interval widths,
speedups with intervals, and pairs sharing a code path that differ. Cases that cannot run on this machine
(an adapter whose package is missing) are recorded as skipped with the reason
and re-evaluated by every run.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections import OrderedDict
from pathlib import Path

import yaml
from rich.console import Console
from rich.progress import (BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn)
from rich.text import Text

from burst_impl.flops import MODE_FACTOR, MODEL_MODE

from .cli import DEBUG_FLAG, DEBUG_HELP, prog, run_cli
from .cluster.emulator.emulated import CalibrationShape, EmulatedCluster, local_info
from .cluster.jobs import merge_leftovers
from .cluster.slurm import check_submittable, render_sbatch, write_sbatch
from .harness import results as R
from .harness.env import REPO, machine_slug
from .harness.executor import run_batch
from .harness.launch import local_launcher, worker_cmd, worker_env
from .harness.spec import Case, Preset, Spec, load_any
from burst_impl.model import get_config
from .cluster.report import (FIGURE_FILE, NO_OVERLAP, figure, loopback_twin, ratios_of, report, with_model,
                             write_report)
from .harness.summary import write_summary
from .perfmodel.emulated.validate_decode import write_report as inference_report
from .plots import draw_all


def _cost(c: Case) -> float:
    """Rough relative cost of a case, so the progress bar's time-left estimate is sensible."""
    work = c.batch * c.seqlen ** 2 * c.heads * c.head_dim / c.world_size * (0.5 if c.causal else 1.0)
    # train/prefill: model level (the attention term of every layer; the matmuls are cheap beside it on CPU)
    # perplexity (model level): train_steps training steps, not a timed mode
    mode = (MODE_FACTOR["fwd_bwd"] * c.train_steps if c.mode == "perplexity"
            else MODE_FACTOR.get(MODEL_MODE.get(c.mode, c.mode), 1.0))
    if c.level == "inference" and c.mode != "ttft":   # decode (and a cache fill) touch the cache once: linear in N
        work /= c.seqlen
    if c.level == "model":
        work *= get_config(c.model).n_layers
    reps = (c.repeats + c.repeat_cap) / 2   # adaptive: somewhere between the minimum and the cap
    return 1.0 + (c.warmup + reps + 3) * mode * work / 2e9


def machine_label(preset: Preset) -> str:
    """Whose results these are: a real SLURM cluster profile's name, else this machine's hardware slug
    (an emulated cluster runs on this machine; its records name the profile besides)."""
    slurm = sorted({s.cluster for s in preset.specs if s.profile.scheduler == "slurm"})
    if len(slurm) > 1:
        raise SystemExit(f"preset {preset.name} runs on several SLURM cluster profiles {slurm}: run it once per "
                         "profile (--cluster NAME) so each profile's results stay in results/<profile>/")
    return slurm[0] if slurm else machine_slug()


def plan(preset: Preset, *, results_root: Path, force: bool, retry_failed: bool
         ) -> "OrderedDict[tuple[str, int], list[Case]]":
    """Pending cases grouped by (spec, world size), in spec order (each spec's plan, ``Spec.plan``)."""
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
    # Logs (make reproduce > log) are not terminals: keep one line per case readable there too.
    console = Console(stderr=False, width=None if os.isatty(1) else 150)
    # Everything shown comes from outside rich's markup language (spec names, case ids, exception
    # texts such as gloo's "[/__w/pytorch/.../pair.cc:537]"): print it literally (markup=False, Text).
    return console, Progress(TextColumn("{task.fields[pos]}", style="bold", markup=False),
                             TextColumn("{task.description}", markup=False),
                             BarColumn(), TimeElapsedColumn(), TextColumn("left"), TimeRemainingColumn(),
                             console=console, transient=False, refresh_per_second=4)


def _calibration_shape(preset: Preset, batches, profile_name: str) -> CalibrationShape | None:
    """The ring step the emulated links are scaled at: the largest block (N/G tokens) among the cases that
    run on ``profile_name``, with that case's heads, head dim and dtype."""
    cases = [c for (name, _), cs in batches.items() if preset.spec(name).cluster == profile_name for c in cs]
    if not cases:
        return None
    c = max(cases, key=lambda c: (_block(c), c.heads * c.head_dim))
    return CalibrationShape(tokens=_block(c), heads=c.heads, head_dim=c.head_dim, dtype=c.dtype)


# An inference case computes no N/G x N/G block (decode: a few queries over the cache): its links are scaled at
# a ring step of at most this many tokens (a 128K-token fwd+bwd block would take the calibration minutes).
INFERENCE_CALIBRATION_TOKENS = 2048


def _block(c: Case) -> int:
    n = c.seqlen // c.world_size
    return min(n, INFERENCE_CALIBRATION_TOKENS) if c.level == "inference" else n


def _set_cluster_env(info: dict) -> None:
    # The driver writes records too (skipped cases, killed launches): they say where they ran as well.
    os.environ[R.CLUSTER_ENV] = json.dumps(info)


def run_local(preset: Preset, batches, *, results_root: Path) -> dict[str, int]:
    """Local and emulated (torchrun) specs; each emulated profile is brought up once, torn down at the end."""
    with contextlib.ExitStack() as stack:
        clusters: dict[str, EmulatedCluster] = {}

        def cluster_for(spec: Spec) -> EmulatedCluster:
            if spec.cluster not in clusters:
                clusters[spec.cluster] = stack.enter_context(EmulatedCluster(
                    spec.profile, shape=_calibration_shape(preset, batches, spec.cluster)))
            return clusters[spec.cluster]

        return _run_local(preset, batches, results_root=results_root, cluster_for=cluster_for)


def _run_local(preset: Preset, batches, *, results_root: Path, cluster_for) -> dict[str, int]:
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
            spec = preset.spec(spec_name)
            _set_cluster_env(local_info(spec.profile, ws))
            runnable = []
            for c in cases:
                why = spec.plan.problem(c.case_id)
                if why:
                    R.append_record(results_root, R.base_record(c, "skipped", why))
                    on_record(R.latest_by_case(R.read_records(
                        R.experiment_dir(results_root, c.experiment) / R.RESULTS_FILE))[c.case_id])
                else:
                    runnable.append(c)
            progress.update(task, description=f"{spec_name} G={ws}: launching {len(runnable)} case(s)")
            launcher = local_launcher(results_root, ws, spec.profile.device, REPO)
            if spec.profile.scheduler == "emulated" and runnable:
                cl = cluster_for(spec)
                _set_cluster_env(cl.info(ws))
                launcher = _emulated_launcher(cl, ws, results_root)
            run_batch(runnable, results_root=results_root, launcher=launcher, repo=REPO,
                      on_record=on_record, on_start=on_start)
    return counts


def _emulated_launcher(cl: EmulatedCluster, ws: int, results_root: Path):
    def launcher(cases_file: Path, n: int):
        args = ["--cases", str(cases_file), "--results", str(results_root), "--device", "cpu"]
        env = {**worker_env(ws, "cpu", REPO), **cl.env(ws)}
        # A fresh port per launch: a relaunch must not meet the previous launch's TIME_WAIT sockets.
        return [(cmd, env) for cmd in cl.launches(ws, args, port=29600 + n % 1000)]
    return launcher


def _slurm_files(spec_name: str, ws: int, cases: list[Case], prof, *, results_root: Path, out_dir: Path | None
                 ) -> tuple[Path, str]:
    """Write the cases file and the job script of one batch; ``out_dir`` (dry run) keeps them out of results/."""
    work = out_dir if out_dir is not None else R.work_dir(results_root, spec_name)
    cases_file = work / f"{spec_name}-G{ws}.cases.json"
    cases_file.write_text(json.dumps([c.to_dict() for c in cases]))
    script = render_sbatch(spec_name=spec_name, profile=prof, world_size=ws, n_cases=len(cases),
                           cases_file=str(cases_file.resolve()), results_root=str(results_root.resolve()),
                           repo=str(REPO), log_dir=str(R.experiment_dir(results_root, spec_name).resolve()),
                           case_budget_s=sum(c.case_timeout_s for c in cases), machine=R.current_machine())
    where = out_dir if out_dir is not None else R.experiment_dir(results_root, spec_name) / "slurm"
    return write_sbatch(where / f"{spec_name}-G{ws}.sbatch", script), script


def run_slurm(preset: Preset, batches, *, results_root: Path, dry_run: bool, wait: bool) -> dict[str, int]:
    """One job per (spec, world size). A real cluster's profile must have no placeholders left (checked before
    anything is submitted); an emulated one brings its SLURM cluster up here and waits for each job."""
    profiles = {s.cluster: s.profile for s in (preset.spec(name) for name, _ in batches)}
    out_dir = Path(tempfile.mkdtemp(prefix="burst-dry-run-")) if dry_run else None
    for prof in profiles.values():
        if prof.scheduler == "slurm":
            try:
                check_submittable(prof)
            except ValueError as e:
                if not dry_run:
                    raise SystemExit(f"refusing to submit: {e}") from None
                print(f"WARNING (dry run): {e}", file=sys.stderr)
    if dry_run:
        print(f"# dry run: job scripts and cases files in {out_dir} (nothing written under {results_root})")
    counts = {s: 0 for s in R.STATUSES}
    with contextlib.ExitStack() as stack:
        clusters: dict[str, EmulatedCluster] = {}
        for (spec_name, ws), cases in batches.items():
            spec = preset.spec(spec_name)
            prof = spec.profile
            path, script = _slurm_files(spec_name, ws, cases, prof, results_root=results_root, out_dir=out_dir)
            emulated = prof.scheduler == "emulated"
            cmd = ["sbatch", "--parsable", *(["--wait"] if wait or emulated else []), str(path)]
            if dry_run or (not emulated and not shutil.which("sbatch")):
                print(f"# {spec_name}, world size {ws}: {len(cases)} case(s) -> {path}")
                print(script)
                print("$ " + shlex.join(cmd))
                if not dry_run:
                    print("sbatch is not installed here: submit the script above on the cluster.")
                continue
            if not emulated:
                out = subprocess.run(cmd, capture_output=True, text=True)
                print(f"{spec_name} G={ws}: {'job ' + out.stdout.strip() if out.returncode == 0 else out.stderr}")
                continue
            if spec.cluster not in clusters:
                clusters[spec.cluster] = stack.enter_context(EmulatedCluster(
                    prof, shape=_calibration_shape(preset, batches, spec.cluster)))
            cl = clusters[spec.cluster]
            if cl.slurm is None:
                raise SystemExit(f"profile {prof.name}: no emulated SLURM cluster here ({cl.fallback}); "
                                 "run its specs with launcher: torchrun or on a machine that permits namespaces")
            env = {**worker_env(ws, "cpu", REPO), **cl.env(ws)}
            t0 = time.monotonic()
            job = cl.slurm.sbatch(path, env=env)
            print(f"{spec_name} G={ws}: job {job} submitted to emulated SLURM cluster {cl.topo.run_id}")
            state, code = cl.slurm.wait(job, timeout_s=prof.time_limit_s + 120)
            recs = R.latest_by_case(R.read_records(R.experiment_dir(results_root, spec_name) / R.RESULTS_FILE))
            mine = [recs[c.case_id] for c in cases if c.case_id in recs]
            for r in mine:
                counts[r["status"]] += 1
            print(f"{spec_name} G={ws}: job {job} {state} (exit {code}) after {time.monotonic() - t0:.0f} s: "
                  + ", ".join(f"{r['status']} {r['case_id']}" for r in mine))
    return counts


class _Renamed(argparse.Action):
    """An option that was renamed: using it is an error naming the new name."""

    def __init__(self, option_strings, dest, new: str, **kw):
        super().__init__(option_strings, dest, **kw)
        self.new = new

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string} was renamed {self.new}; use {self.new} {values}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=prog("python -m experiments.run"), description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", help="preset name (experiments/presets/<name>.yaml), spec name or spec file")
    ap.add_argument("--cluster", dest="cluster",
                    help="override the specs' cluster profile (cpu, local or experiments/clusters/<name>)")
    ap.add_argument("--target", action=_Renamed, new="--cluster", help=argparse.SUPPRESS)
    ap.add_argument("--results", default=None,
                    help="results root (default: results/<machine>/, machine = this machine's hardware slug or "
                         "the SLURM cluster profile)")
    ap.add_argument("--plots", default=None, help="figures root (default: plots/<machine>/)")
    ap.add_argument("--dry-run", action="store_true", help="print the launch commands / SLURM scripts only")
    ap.add_argument("--force", action="store_true", help="re-run cases that already have results")
    ap.add_argument("--retry-failed", action="store_true", help="re-run cases recorded as failed")
    ap.add_argument("--no-plots", action="store_true", help="do not redraw figures after a local run")
    ap.add_argument("--wait", action="store_true", help="SLURM: sbatch --wait (block until each job ends)")
    ap.add_argument(DEBUG_FLAG, action="store_true", help=DEBUG_HELP)
    args = ap.parse_args(argv)

    preset = load_any(args.what, cluster=args.cluster)
    machine = machine_label(preset)
    os.environ[R.MACHINE_ENV] = machine        # every record, worker and job names it
    results_root = Path(args.results) if args.results else R.machine_root(machine)
    args.results = str(results_root)
    args.plots = args.plots or str(REPO / "plots" / machine)
    print(f"results of machine {machine!r}: {results_root}")
    if not args.dry_run:
        merged = merge_leftovers(results_root)
        if merged:
            print(f"merged {merged} record(s) that earlier SLURM jobs left in {results_root / '.jobs'}")
    batches = plan(preset, results_root=results_root, force=args.force, retry_failed=args.retry_failed)
    n = sum(len(v) for v in batches.values())
    total = sum(len(s.cases()) for s in preset.specs)
    print(f"{preset.name}: {len(preset.specs)} spec(s), {total} case(s), {n} to run "
          f"({total - n} already have results from this machine and commit{'' if not args.force else '; --force'})")
    via_slurm = {s.profile.via_slurm for s in preset.specs}
    if len(via_slurm) > 1:
        raise SystemExit("a preset must not mix SLURM cluster profiles (real or emulated) with local or "
                         "emulated-torchrun ones; use --cluster to run it on one of them")
    if not args.dry_run:
        for spec in preset.specs:
            write_resolved(spec, results_root)
    t0 = time.monotonic()
    if via_slurm == {True}:
        counts = run_slurm(preset, batches, results_root=results_root, dry_run=args.dry_run, wait=args.wait)
        if args.dry_run or not any(s.profile.scheduler == "emulated" for s in preset.specs):
            return 0
        return _finish(preset, counts, t0, args)
    if args.dry_run:
        for (spec_name, ws), cases in batches.items():
            spec = preset.spec(spec_name)
            cmd = worker_cmd(R.experiment_dir(results_root, spec_name) / ".work" / f"batch-G{ws}.json",
                             results_root, ws, spec.profile.device)
            where = (f" (on emulated cluster {spec.cluster}: one torchrun per node namespace)"
                     if spec.profile.scheduler == "emulated" else "")
            print(f"# {spec_name}, world size {ws}: {len(cases)} case(s){where}")
            print("$ " + shlex.join(cmd))
        return 0
    counts = run_local(preset, batches, results_root=results_root)
    return _finish(preset, counts, t0, args)


def _finish(preset: Preset, counts: dict, t0: float, args) -> int:
    print(f"done in {time.monotonic() - t0:.0f} s: " + ", ".join(f"{v} {k}" for k, v in counts.items() if v))
    for spec in preset.specs:
        if (R.experiment_dir(args.results, spec.name) / R.RESULTS_FILE).exists():
            print(write_summary(args.results, spec.name, spec.baseline))
    reports = _emulation_reports(preset, Path(args.results))
    if not args.no_plots:
        files = draw_all(Path(args.results), Path(args.plots), experiments=[s.name for s in preset.specs])
        files += [figure(rep, Path(args.plots) / rep["experiment"] / FIGURE_FILE) for rep in reports]
        print(f"{len(files)} figure(s) in {args.plots}")
    return 0


def _emulation_reports(preset: Preset, results_root: Path) -> list[dict]:
    """Measured vs modelled ratios of each emulated spec, printed and written next to its results."""
    out = []
    for spec in preset.specs:
        # attention steps and whole models' training steps alike (perfmodel/emulated/cases.py); a perplexity
        # run times nothing
        if spec.profile.scheduler != "emulated" or "perplexity" in spec.measure.modes:
            continue
        if spec.measure.level == "inference":     # decode and TTFT: the inference model's own comparison
            print(inference_report(results_root, spec.name))
            continue
        try:
            rep = report(spec.name, results_root=results_root, compute_from=loopback_twin(preset, spec))
        except ValueError as e:        # nothing measured (all failed): the records say why
            print(f"{spec.name}: no report: {e}")
            continue
        try:
            rep = with_model(rep, results_root, require_calibration=True)
        except (ValueError, RuntimeError) as e:   # a loopback fallback has no links to model; a timing failed
            rep = {**rep, "text": rep["text"] + f"\n\nperformance model: not compared: {e}"}
        write_report(rep, results_root)
        print(rep["text"])
        if any(m.endswith(NO_OVERLAP) for m in spec.methods) and spec.baseline in spec.methods:
            rat = ratios_of(spec.name, results_root=results_root, ref=spec.baseline)
            (R.experiment_dir(results_root, spec.name) / "ratios.txt").write_text(rat["text"] + "\n")
            print(rat["text"])
        out.append(rep)
    return out

if __name__ == "__main__":
    raise SystemExit(run_cli(main))
