"""`make model`'s work split into independent jobs (one per spec, one for BurstEngine's model-level
figures), run one process per core. Model-level specs (BurstEngine's main table, its ablation) are
jobs of their own (``model_figures.write_model_spec``).

The model is deterministic and every job writes its own folders, so the jobs need nothing from each
other; what each job prints comes back to the parent and is printed in job order.
"""
from __future__ import annotations

import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from .model_figures import (SCALING_METHODS, SCALING_WORLD_SIZES, write_burstengine, write_model_spec,
                            write_spec_model_level)
from .inference_records import write_inference_spec
from .predict import write_experiment


def run_jobs(jobs: list[dict]) -> list[tuple[list[str], int]]:
    """``write_job`` over ``jobs``, in parallel where there is more than one core. Processes are spawned,
    not forked: the parent has torch (and its OpenMP pool) loaded."""
    workers = min(len(jobs), os.cpu_count() or 1)
    if workers <= 1:
        return [write_job(job) for job in jobs]
    # Longest first, so that no core is left with one big spec at the end. A ring pass simulates
    # every rank at every step: a case costs about world_size**2.
    order = sorted(range(len(jobs)), key=lambda i: -_weight(jobs[i]))
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {i: pool.submit(write_job, jobs[i]) for i in order}
        return [futures[i].result() for i in range(len(jobs))]


def _weight(job: dict) -> int:
    if "spec" not in job:
        # BurstEngine's model-level scaling cases
        return len(SCALING_METHODS) * sum(g * g for g in SCALING_WORLD_SIZES)
    return sum(c.shape.world_size ** 2 for c in job["spec"].cases())


def write_job(job: dict) -> tuple[list[str], int]:
    """One job: a spec's modelled records, figures and table (and its whole-model step), or BurstEngine's
    model-level scaling. Returns (lines to print, number of files written)."""
    results, plots = Path(job["results"]), Path(job["plots"])
    if job.get("burstengine"):
        be = write_burstengine(results_root=results, plots_root=plots, draw=job["draw"])
        where = sorted({str(f.parent) for f in be if f.suffix == ".md"})
        return [f"BurstEngine scaling, whole model -> {where}"], len(be)
    spec = job["spec"]
    if spec.measure.level == "inference":    # decode, TTFT, KV capacity (inference_records.py)
        files = write_inference_spec(spec, hardware=job["hardware"], results_root=results, plots_root=plots)
        return [f"{spec.name}: {len(spec.cases())} inference cases -> {files[-1].parent}"], len(files)
    if spec.measure.level == "model":        # a model-level spec: its whole-model steps (model_figures.py)
        files = write_model_spec(spec, hardware=job["hardware"], results_root=results, plots_root=plots,
                                 draw=job["draw"])
        return [f"{spec.name}: {len(spec.cases())} cases, whole model -> {files[-1].parent}"], len(files)
    files = write_experiment(spec, hardware=job["hardware"], results_root=results, plots_root=plots,
                             draw=job["draw"], variants=job["variants"])
    table = next(f for f in files if f.name == "table_modelled.md")
    lines, n = [f"{spec.name}: {len(spec.cases())} cases -> {table.parent}"], len(files)
    if job["model_level"]:
        ml = write_spec_model_level(spec, hardware=job["hardware"], results_root=results, plots_root=plots,
                                    draw=job["draw"])
        n += len(ml)
        if ml:
            lines.append(f"{spec.name}: whole model -> {ml[-1].parent}")
    return lines, n
