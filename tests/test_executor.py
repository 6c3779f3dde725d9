"""The executor (experiments/harness/executor.py): a rank killed at start-up or inside a case costs at most
the case in flight, through the fault-injection option BURST_BENCH_FAULT; a launch that runs no case is
retried a bounded number of times; an experiment with no ok case draws no figure."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from experiments.harness import executor as X
from experiments.harness import faults as F
from experiments.harness import results as R
from experiments.harness.env import REPO
from experiments.harness.spec import load_spec
from experiments.harness.worker import groups

SPEC = {"name": "t_exec", "methods": ["burst", "ring"], "baseline": "ring",
        "sweep": {"seqlen": [32, 64], "world_size": 2, "heads": 2, "head_dim": 8, "layout": "zigzag"},
        "measure": {"modes": ["fwd_bwd"], "level": "op", "memory": False}, "warmup": 0, "repeats": 1, "seed": 1,
        "cluster": "cpu", "timeouts": {"case_s": 60, "pg_s": 20}}


def _spec(tmp_path: Path) -> Path:
    p = tmp_path / f"{SPEC['name']}.yaml"
    p.write_text(yaml.safe_dump(SPEC))
    return p


def _run(tmp_path: Path, fault: str, *extra: str) -> tuple[subprocess.CompletedProcess, dict[str, dict]]:
    """``python -m experiments.run`` as a user runs it, with the fault set; its output and newest records."""
    env = {**os.environ, "PYTHONPATH": str(REPO), X.FAULT_ENV: fault}
    proc = subprocess.run([sys.executable, "-m", "experiments.run", str(_spec(tmp_path)), "--results",
                           str(tmp_path / "r"), "--plots", str(tmp_path / "p"), *extra],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    recs = R.latest_by_case(R.read_records(tmp_path / "r" / SPEC["name"] / R.RESULTS_FILE))
    return proc, recs


def _assert_clean(proc: subprocess.CompletedProcess) -> None:
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "Traceback" not in out and "error:" not in out, out[-3000:]


def test_a_rank_killed_at_start_up_costs_no_case(tmp_path):
    proc, recs = _run(tmp_path, "rank:1@start")
    _assert_clean(proc)
    cases = load_spec(_spec(tmp_path)).cases()
    assert set(recs) == {c.case_id for c in cases}
    assert {r["status"] for r in recs.values()} == {"ok"}, {k: r["reason"] for k, r in recs.items()}
    logs = sorted((tmp_path / "r" / SPEC["name"] / ".work").glob("launch-G2-*.log"))
    assert len(logs) == 2, logs                 # the killed launch, then one clean relaunch
    assert (tmp_path / "p" / SPEC["name"] / "speedup_vs_seqlen.png").exists()


def _assert_only_in_flight_failed(cases, recs: dict[str, dict], rank: int, k: int) -> None:
    in_flight = [c for g in groups(cases) for c in g][k - 1]
    assert set(recs) == {c.case_id for c in cases}
    failed = {cid: r for cid, r in recs.items() if r["status"] != "ok"}
    assert list(failed) == [in_flight.case_id], {cid: r["reason"] for cid, r in recs.items()}
    # the killed rank is named (torchrun may have stopped the others before they saw the loss: then they too)
    who = failed[in_flight.case_id]["reason"].split(" ended while running this case")[0]
    assert who == f"rank {rank}" or (who.startswith("ranks ") and str(rank) in who), who


FAKE_SRUN = """#!/bin/bash
# one node: skip srun's options, run its command as node 0 of 1
while [ "$1" != bash ]; do shift; done
export SLURM_NODEID=0 SLURM_NNODES=1
exec "$@"
"""
FAKE_SCONTROL = """#!/bin/bash
if [ "$2" = hostnames ]; then echo node0; else echo "NodeName=node0 NodeAddr=127.0.0.1 State=IDLE"; fi
"""


def test_a_slurm_job_runs_the_same_executor(tmp_path):
    """The rendered job script, run by bash with srun and scontrol stood in for (one node, two ranks): the
    executor relaunches after rank 1 is killed inside the 2nd case (``rank:<r>@case:<k>``; the same kill in a
    local run: tests/test_defects.py's killed worker), only that case fails, and the job's records are merged."""
    from experiments.cluster.slurm import render_sbatch
    from experiments.profiles.cluster import load_profile

    cases = load_spec(_spec(tmp_path)).cases()
    cases_file, root = tmp_path / "cases.json", tmp_path / "r"
    cases_file.write_text(json.dumps([c.to_dict() for c in cases]))
    script = render_sbatch(spec_name="t_exec", profile=load_profile("a100_roce_emu_slurm"), world_size=2,
                           n_cases=len(cases), cases_file=str(cases_file), results_root=str(root), repo=str(REPO),
                           log_dir=str(tmp_path), case_budget_s=sum(c.case_timeout_s for c in cases))
    # the profile names its namespaces' interface; on this machine's loopback the ranks meet on lo
    script = script.replace("export GLOO_SOCKET_IFNAME=eth0", "export GLOO_SOCKET_IFNAME=lo")
    (tmp_path / "job.sbatch").write_text(script)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "SLURM_JOB_ID": "7",
           "SLURM_JOB_NODELIST": "node0", "SLURM_JOB_NAME": "t", "PYTHONPATH": str(REPO),
           X.FAULT_ENV: "rank:1@case:2"}
    proc = subprocess.run(["bash", str(tmp_path / "job.sbatch")], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=600)
    _assert_clean(proc)
    assert not (root / ".jobs").exists()                       # merged, the job's folder removed
    recs = R.latest_by_case(R.read_records(root / SPEC["name"] / R.RESULTS_FILE))
    _assert_only_in_flight_failed(cases, recs, 1, 2)


def _failing_launcher(calls: list[int]):
    def launcher(cases_file: Path, n: int):
        calls.append(n)
        return [([sys.executable, "-c", "import sys; print('cannot start'); sys.exit(1)"], dict(os.environ))]
    return launcher


def test_a_launch_that_runs_no_case_is_retried_a_bounded_number_of_times(tmp_path):
    cases = load_spec(_spec(tmp_path)).cases()
    calls: list[int] = []
    X.run_batch(cases, results_root=tmp_path / "r", launcher=_failing_launcher(calls))
    assert calls == list(range(1, X.MAX_EMPTY_LAUNCHES + 1))
    recs = R.latest_by_case(R.read_records(tmp_path / "r" / SPEC["name"] / R.RESULTS_FILE))
    assert set(recs) == {c.case_id for c in cases}
    for r in recs.values():
        assert r["status"] == "failed" and f"launch failed {X.MAX_EMPTY_LAUNCHES} times" in r["reason"]
        assert "cannot start" in r["reason"]


def test_no_ok_case_draws_no_figure_and_says_so(tmp_path, monkeypatch, capsys):
    import experiments.run as run

    monkeypatch.setattr(run, "local_launcher", lambda *a: _failing_launcher([]))
    assert run.main([str(_spec(tmp_path)), "--results", str(tmp_path / "r"), "--plots", str(tmp_path / "p")]) == 0
    assert "t_exec: no figure: none of its 4 case(s) is ok" in capsys.readouterr().out
    assert not (tmp_path / "p" / SPEC["name"]).exists()


def test_the_fault_fires_on_the_first_launch_only():
    specs = [(["x"], {X.FAULT_ENV: "rank:0@start", "A": "1"})]
    assert X._first_launch_only(specs, 1) == specs
    assert X._first_launch_only(specs, 2) == [(["x"], {"A": "1"})]


@pytest.mark.parametrize("bad", ["rank:1", "rank:x@start", "rank:1@case:0", "1@start", "rank:1@case:"])
def test_a_malformed_fault_is_a_clear_error(bad):
    with pytest.raises(ValueError, match=rf"{X.FAULT_ENV}=.*rank:<r>@start or rank:<r>@case:<k>"):
        F.parse_fault(bad)
    assert F.parse_fault("rank:3@case:12") == F.Fault(rank=3, case=12)
    assert F.parse_fault("") is None


def test_the_slurm_launcher_moves_the_port_per_launch(tmp_path):
    launcher = X.slurm_launcher(results_root=tmp_path, procs_per_node=4, device="cuda",
                                entry=["-m", "experiments.harness.worker"], master_port=29700)
    (cmd1, _), = launcher(tmp_path / "c.json", 1)
    (cmd2, _), = launcher(tmp_path / "c.json", 2)
    assert cmd1[:3] == ["srun", "--kill-on-bad-exit=1", "--ntasks-per-node=1"]
    assert "--master-port 29700" in cmd1[-1] and "--master-port 29701" in cmd2[-1]
    assert '--node-rank "$SLURM_NODEID"' in cmd1[-1] and "--nproc-per-node 4" in cmd1[-1]
    assert '--nnodes "$SLURM_NNODES"' in cmd1[-1] and '--master-addr "$MASTER_ADDR"' in cmd1[-1]
    assert "-m experiments.harness.worker --cases" in cmd1[-1] and "--device cuda" in cmd1[-1]


def test_a_malformed_fault_stops_the_run_with_error(tmp_path, monkeypatch, capsys):
    from experiments.cli import run_cli
    from experiments.run import main as run_main

    monkeypatch.setenv(X.FAULT_ENV, "rank:1@case:first")
    assert run_cli(run_main, [str(_spec(tmp_path)), "--results", str(tmp_path / "r"), "--no-plots"]) == 2
    assert f"error: {X.FAULT_ENV}='rank:1@case:first'" in capsys.readouterr().err
    assert not (tmp_path / "r" / SPEC["name"] / R.RESULTS_FILE).exists()      # nothing ran
