"""Experiment harness end to end on CPU: real torchrun launches on gloo, records, resume, figures,
failures (error, OOM, timeout) recorded while the sweep goes on, and the pytest-benchmark entry point."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

from experiments.harness import results as R
from experiments.harness.env import REPO
from experiments.harness.record import Record
from experiments.run import main as run_main

SPEC = {
    "name": "t_e2e",
    "methods": ["burst", "ring"],
    "baseline": "ring",
    "sweep": {"seqlen": [64, 128], "world_size": 2, "heads": 2, "head_dim": 16, "layout": "zigzag"},
    "measure": {"modes": ["fwd_bwd"], "level": "op"},
    "warmup": 0,
    "repeats": 2,
    "seed": 1,
    "cluster": "cpu",
    "timeouts": {"case_s": 60, "pg_s": 30},
}


def _spec(tmp_path: Path, **over) -> Path:
    raw = {**SPEC, **over}
    p = tmp_path / f"{raw['name']}.yaml"
    p.write_text(yaml.safe_dump(raw))
    return p


def _run(tmp_path, spec: Path, *extra) -> list[dict]:
    assert run_main([str(spec), "--results", str(tmp_path / "results"), "--plots", str(tmp_path / "plots"),
                     *extra]) == 0
    name = yaml.safe_load(spec.read_text())["name"]
    return R.read_records(tmp_path / "results" / name / "results.jsonl")


def test_tiny_sweep_records_figures_and_resume(tmp_path):
    spec = _spec(tmp_path)
    recs = _run(tmp_path, spec)
    assert len(recs) == 4 and {r["status"] for r in recs} == {"ok"}, [r["reason"] for r in recs]
    for r in recs:
        assert set(R.REQUIRED_KEYS) <= set(r)
        assert len(r["time_samples_s"]) == 2 and r["time_median_s"] > 0
        assert r["world_size"] == 2 and r["config"]["backend"] == "gloo"
        assert r["tflops_total"] > 0 and r["tokens_per_s"] > 0
        assert r["mem_peak_bytes"] > 0 and len(r["mem_peak_bytes_per_rank"]) == 2
        # each rank's process CPU per step beside the time: a step cannot cost a rank more CPU than its wall
        # time on every core of the machine, nor nothing
        cpu = r["time_cpu_s_per_rank"]
        assert len(cpu) == 2 and all(0 < c <= (os.cpu_count() or 1) * r["time_max_s"] for c in cpu), cpu
        # of it the timing thread's: each round's is part of that round's process CPU, so their medians are ordered
        main = r["time_cpu_main_s_per_rank"]
        assert len(main) == 2 and all(0 < m <= c for m, c in zip(main, cpu)), (main, cpu)
        # the byte counters agree with each method's formula
        assert r["comm_fwd_bytes"] == r["comm_fwd_formula_bytes"] > 0
        assert r["comm_bwd_bytes"] == r["comm_bwd_formula_bytes"] > 0
    assert (tmp_path / "results" / "t_e2e" / "spec.resolved.yaml").exists()
    figs = {p.name for p in (tmp_path / "plots" / "t_e2e").glob("*.png")}
    assert {"speedup_vs_seqlen.png", "memory_vs_seqlen.png", "comm_volume.png"} <= figs

    # Re-running skips what has results; --force re-runs.
    assert len(_run(tmp_path, spec, "--no-plots")) == 4
    assert len(_run(tmp_path, spec, "--no-plots", "--force")) == 8

    # Figures are redrawn from the results files alone.
    from experiments.plots import main as plots_main

    out = tmp_path / "replot"
    assert plots_main(["--results", str(tmp_path / "results"), "--out", str(out)]) == 0
    assert (out / "t_e2e" / "speedup_vs_seqlen.png").stat().st_size > 10_000


def test_failures_are_recorded_and_the_sweep_goes_on(tmp_path, monkeypatch):
    # ring at N=64: rank 1 runs out of memory (rank 0 is then stuck in a collective and
    # gets killed); burst at N=64 raises on rank 0; burst at N=128 hangs past its budget.
    monkeypatch.setenv("EXPERIMENTS_INJECT_FAULT",
                       "ring.op.fwd_bwd.N64.:oom:1;burst.op.fwd_bwd.N64.:error:0;burst.op.fwd_bwd.N128.:hang")
    # case_s: the hang costs its group's budget (2 x case_s); 4 s is still ~10x what a case here takes loaded
    spec = _spec(tmp_path, name="t_fail", timeouts={"case_s": 4, "pg_s": 10})
    recs = {r["case_id"].split(".G")[0]: r for r in _run(tmp_path, spec, "--no-plots")}
    assert recs["ring.op.fwd_bwd.N64"]["status"] == "oom", recs["ring.op.fwd_bwd.N64"]["reason"]
    assert "rank 1" in recs["ring.op.fwd_bwd.N64"]["reason"]
    assert recs["burst.op.fwd_bwd.N64"]["status"] == "failed"
    assert "injected failure" in recs["burst.op.fwd_bwd.N64"]["reason"]
    assert recs["burst.op.fwd_bwd.N128"]["status"] == "failed"
    assert "timeout" in recs["burst.op.fwd_bwd.N128"]["reason"]
    assert recs["ring.op.fwd_bwd.N128"]["status"] == "ok"
    # Failed cases count as done; --retry-failed runs them again.
    monkeypatch.delenv("EXPERIMENTS_INJECT_FAULT")
    recs = _run(tmp_path, spec, "--no-plots", "--retry-failed")
    latest = R.latest_by_case(recs)
    assert sum(r["status"] == "ok" for r in latest.values()) == 3  # the OOM one stays recorded as OOM
    # the failed figure marks OOM / failed points
    from experiments.plots import draw_all

    files = draw_all(tmp_path / "results", tmp_path / "plots")
    assert any(f.name == "speedup_vs_seqlen.png" for f in files)


def test_pytest_benchmark_smoke(tmp_path):
    spec = _spec(tmp_path, name="t_bench", methods=["burst", "tp_v3"], baseline="burst",
                 sweep={"seqlen": [64], "world_size": 1, "heads": 2, "head_dim": 16},
                 measure={"modes": ["fwd_bwd"], "level": "layer"})
    out = tmp_path / "bench.json"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "benchmarks",
                           "--spec", str(spec), f"--benchmark-json={out}"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert len(data["benchmarks"]) == 2
    # the suite's record type, as the harness writes it
    info = Record.from_json(data["benchmarks"][0]["extra_info"]["record"]).row()
    for key in ("method", "seqlen", "world_size", "comm_fwd_bytes", "comm_fwd_formula_bytes", "mem_peak_bytes",
                "flops", "time_median_s", "time_mean_rank_s", "git"):
        assert info[key] is not None, key
    assert info["seqlen"] == 64 and info["mem_peak_bytes"] > 0
