"""The model against every committed run of an emulated experiment (perfmodel/emulated/history.py)."""
from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from experiments.cli import run_cli
from experiments.cluster.__main__ import main as cluster_main
from experiments.perfmodel.emulated import history as H

REPO = Path(__file__).resolve().parents[1]
MASK_ROOT = REPO / "results/reference/cpu2-amd-epyc+a800_ib_emu_2x4"
MASK = "cpu_varlen_magiattention_2x4"


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout


@pytest.fixture
def repo(tmp_path):
    """A repository whose results root holds two runs of ``exp`` and a root-level probe of the first."""
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "config", "user.email", "t@example.com")
    _git(tmp_path, "config", "user.name", "t")
    root = tmp_path / "results" / "r"
    (root / "exp").mkdir(parents=True)
    for n in (1, 2):
        (root / "exp" / "results.jsonl").write_text(json.dumps({"run": n}) + "\n")
        if n == 1:
            (root / "overlap_probe.json").write_text("{}")
        (root / "notes.txt").write_text(str(n))       # a root file that is not a probe: not extracted
        _git(tmp_path, "add", "-A")
        _git(tmp_path, "commit", "-qm", f"run {n}")
    (root / "exp" / "kernel_times.json").write_text("{}")    # a later commit that is no run
    _git(tmp_path, "add", "-A")
    _git(tmp_path, "commit", "-qm", "table")
    return root


def test_runs_are_the_commits_that_changed_the_records_oldest_first(repo):
    runs = H.runs_of(repo, "exp")
    assert len(runs) == 2
    assert [_git(repo, "log", "-1", "--format=%s", c).strip() for c in runs] == ["run 1", "run 2"]


def test_extract_gives_the_run_as_its_commit_holds_it(repo, tmp_path):
    first = H.runs_of(repo, "exp")[0]
    root = H.extract(first, repo, "exp", tmp_path / "x")
    assert json.loads((root / "exp" / "results.jsonl").read_text()) == {"run": 1}
    assert (root / "overlap_probe.json").exists()          # the probes a report falls back to
    assert not (root / "notes.txt").exists() and not (root / "exp" / "kernel_times.json").exists()


def test_replay_prices_each_run_and_lists_one_it_cannot(repo, monkeypatch):
    asked = []

    def errors(root, experiment, at_reference, memory_rule, cfs=False, lockstep=False):
        asked.append("cfs+lockstep" if cfs and lockstep else "cfs" if cfs
                     else at_reference if memory_rule == "compute" else memory_rule)
        n = json.loads((root / experiment / "results.jsonl").read_text())["run"]
        if n == 2:
            raise KeyError("no measured time for ('attention', 1)")
        return {"a": 0.1 * n, "b": -0.3}
    monkeypatch.setattr(H, "_errors", errors)
    runs = H.replay(repo, "exp")
    assert runs[0].errors == {"a": 0.1, "b": -0.3} and not runs[0].skipped
    assert runs[1].skipped.startswith("\"no measured time") and runs[1].errors == {}
    assert asked == [True, True]                          # each group at its own reference by default
    H.replay(repo, "exp", at_reference=False)
    assert asked[2:] == [False, False]
    H.replay(repo, "exp", memory_rule="bring-up")                # the rule of 2026-12-06, for the history
    assert asked[4:] == ["bring-up", "bring-up"]
    H.replay(repo, "exp", cfs=True)                              # the opt-in CFS fluid (perfmodel/emulated/cfs.py)
    assert asked[6:] == ["cfs", "cfs"]
    H.replay(repo, "exp", cfs=True, lockstep=True)               # and each run's own lockstep factor (lockstep.py)
    assert asked[8:] == ["cfs+lockstep", "cfs+lockstep"]
    with pytest.raises(ValueError, match="memory_rule='stream' must be one of compute, bring-up, group"):
        H.replay(repo, "exp", memory_rule="stream")
    with pytest.raises(ValueError, match="commits: 'nope' is not a commit"):
        H.replay(repo, "exp", ["nope"])
    with pytest.raises(ValueError, match="experiment='other': no commit changed its records"):
        H.replay(repo, "other")


def test_one_kernel_table_can_price_every_run(repo, tmp_path, monkeypatch):
    table = tmp_path / "fresh.json"
    table.write_text('{"fresh": 1}')
    root = H.extract(H.runs_of(repo, "exp")[0], repo, "exp", tmp_path / "x", table)
    assert json.loads((root / "exp" / "kernel_times.json").read_text()) == {"fresh": 1}
    seen = []
    monkeypatch.setattr(H, "_errors", lambda root, *a: seen.append((root / "exp" / "kernel_times.json").read_text())
                        or {"a": 0.0})
    H.replay(repo, "exp", kernel_table=table)
    assert seen == ['{"fresh": 1}'] * 2
    with pytest.raises(ValueError, match="kernel_table='.*nope.json': no such file"):
        H.replay(repo, "exp", kernel_table=tmp_path / "nope.json")


def test_a_results_root_outside_a_repository_is_refused(tmp_path):
    with pytest.raises(ValueError, match="not inside a git repository"):
        H.runs_of(tmp_path, "exp")
    with pytest.raises(ValueError, match="no such folder"):
        H.runs_of(tmp_path / "missing", "exp")


def test_history_table_counts_runs_and_case_medians():
    runs = [H.Run("a" * 40, {"x": 0.05, "y": -0.30, "z": 0.20}), H.Run("b" * 40, {"x": -0.10, "y": -0.25}),
            H.Run("c" * 40, {"x": 0.30, "y": -0.40, "z": -0.10}), H.Run("d" * 40, skipped="no kernel key")]
    out = H.history_table(runs, target=0.15)
    assert out["case_medians"] == pytest.approx({"x": 0.05, "y": -0.30, "z": 0.05})
    assert out["same_side"] == ["y"]                       # below -15% in every run that has it
    assert "dddddddd" in out["text"] and "not priced: no kernel key" in out["text"]
    assert "2 of 3 within 15%" in out["text"]
    assert "   1 of 3 " in out["text"]                       # run a: only x within 15%


def test_cli_rejects_a_bad_target_and_a_bad_commit(capsys):
    assert run_cli(cluster_main, ["history", MASK, "--results", str(MASK_ROOT), "--target", "1.5"]) == 2
    assert "target=1.5 must be in (0, 1)" in capsys.readouterr().err
    if not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    assert run_cli(cluster_main, ["history", MASK, "--results", str(MASK_ROOT), "--commits", "nope"]) == 2
    assert "not a commit of this repository" in capsys.readouterr().err


def test_the_committed_mask_run_replays_as_its_report_priced_it():
    """HEAD's mask run priced from a git archive equals the same model on the working tree's files."""
    if not (REPO / ".git").exists() or not (MASK_ROOT / MASK / "results.jsonl").exists():
        pytest.skip("needs the repository's committed mask run")
    if _git(REPO, "status", "--porcelain", "--", str(MASK_ROOT)).strip():
        pytest.skip("the results root differs from HEAD's")
    (run,) = H.replay(MASK_ROOT, MASK, ["HEAD"])
    assert not run.skipped and len(run.errors) == 45
    assert run.errors == pytest.approx(H._errors(MASK_ROOT, MASK))
    # its groups' references differ from its bring-up load, so the bring-up's prices differ
    (bring,) = H.replay(MASK_ROOT, MASK, ["HEAD"], at_reference=False)
    assert bring.errors == pytest.approx(H._errors(MASK_ROOT, MASK, at_reference=False))
    assert bring.errors != pytest.approx(run.errors)
