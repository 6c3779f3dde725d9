"""python -m experiments.perfmodel [spec|preset ...] [--hardware NAME | --cluster NAME] [--results DIR] [--plots DIR]

Models every case of the given specs or presets (default: the ``paper`` preset,
each spec on the hardware profile its target names) and writes
``<results>/<experiment>/results.jsonl`` (``"source": "modelled"``), the
figures (drawn by experiments.plots, "modelled" in every title and file name)
and ``<plots>/<experiment>/table_modelled.md``; for every spec that is a layer of a paper model, the
whole model's step as ``<experiment>_model_level`` (model_figures.py); model-level specs (BurstEngine's
main table and ablation) as their whole-model steps; with the ``paper`` preset BurstEngine's scaling/MFU.
Runs nothing on any device.
"""
from __future__ import annotations

import argparse
import time

from ..cli import DEBUG_FLAG, DEBUG_HELP, prog, run_cli
from ..harness.spec import load_any
from ..model_only import MODEL_ONLY
from .jobs import run_jobs
from .model_figures import twin
from .predict import PLOTS_ROOT, RESULTS_ROOT


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=prog("python -m experiments.perfmodel"), description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("names", nargs="*", default=["paper"], help="spec names/files or presets (default: paper)")
    ap.add_argument("--hardware", help="model on this hardware profile (experiments/hardware/<name>.yaml) "
                                       "instead of each spec's target's")
    ap.add_argument("--cluster", help="model on the hardware an emulated cluster profile (experiments/clusters/<name>"
                                      ".yaml) emulates, at its nodes x ranks per node and its NICs (<spec>__<name>)")
    ap.add_argument("--results", default=str(RESULTS_ROOT), help="root of the modelled records")
    ap.add_argument("--plots", default=str(PLOTS_ROOT), help="root of the modelled figures and tables")
    ap.add_argument("--no-plots", action="store_true", help="records and tables only")
    ap.add_argument("--no-model-level", action="store_true",
                    help="attention level only: skip the whole-model steps (<spec>_model_level, BurstEngine's "
                         "scaling and ablation)")
    ap.add_argument("--no-variants", action="store_true",
                    help=f"skip the model-only variants ({', '.join(v.label for v in MODEL_ONLY.values())})")
    ap.add_argument(DEBUG_FLAG, action="store_true", help=DEBUG_HELP)
    args = ap.parse_args(argv)
    if args.cluster and args.hardware:
        ap.error("--cluster and --hardware name the same thing; give one")
    args.hardware = args.hardware or args.cluster
    t0 = time.perf_counter()
    specs = [s for name in args.names for s in load_any(name).specs]
    # Model-level specs are modelled as whole-model steps, except those whose attention-level twin already is
    # (<twin>_model_level), and only in their training/prefill modes (perplexity is a measurement).
    skipped = [s.name for s in specs if s.measure.level == "model"
               and (twin(s) or args.no_model_level or not set(s.measure.modes) & {"train", "prefill"})]
    if skipped:
        print(f"not modelled again (model level: twin of a modelled spec, or no timed mode): {', '.join(skipped)}")
    specs = [s for s in specs if s.name not in skipped]
    jobs = [dict(spec=spec, hardware=args.hardware, results=args.results, plots=args.plots, draw=not args.no_plots,
                 variants=not args.no_variants, model_level=not args.no_model_level) for spec in specs]
    if not args.no_model_level and "paper" in args.names and not args.hardware:
        jobs.append(dict(burstengine=True, results=args.results, plots=args.plots, draw=not args.no_plots))
    done = run_jobs(jobs)
    n = 0
    for lines, count in done:
        n += count
        for line in lines:
            print(line)
    print(f"{n} files for {len(specs)} spec(s) in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(run_cli(main))
