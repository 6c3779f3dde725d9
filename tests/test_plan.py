"""The resolved plan (experiments/harness/plan.py): a spec's cases are expanded and validated once, when it
loads; the driver's plan step and the worker read them, and the worker asks the plan's one function why a
case cannot run in its launch."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import yaml

import experiments.run as run
from experiments.harness import plan as P
from experiments.harness import results as R
from experiments.harness import spec as S
from experiments.harness import worker as W

SPEC = {"name": "t_plan", "methods": ["burst", "ring"], "baseline": "ring",
        "sweep": {"seqlen": 32, "world_size": [1, 2], "heads": 2, "head_dim": 8, "layout": "contiguous"},
        "measure": {"modes": ["forward"], "level": "op", "memory": False, "comm": False},
        "warmup": 0, "repeats": 1, "seed": 1, "cluster": "cpu", "timeouts": {"case_s": 60, "pg_s": 20}}


def _spec_file(tmp_path: Path) -> Path:
    p = tmp_path / f"{SPEC['name']}.yaml"
    p.write_text(yaml.safe_dump(SPEC))
    return p


@pytest.fixture
def expansions(monkeypatch):
    """Counts the calls of the one expansion function."""
    calls = []
    real = P.expand

    def counting(spec):
        calls.append(spec.name)
        return real(spec)

    monkeypatch.setattr(P, "expand", counting)
    return calls


def _worker(tmp_path: Path, cases, monkeypatch) -> dict[str, dict]:
    """The worker as one local rank (world size 1) over a cases file as the executor writes it."""
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    cases_file = tmp_path / "batch.json"
    cases_file.write_text(json.dumps([c.to_dict() for c in cases]))
    assert W.main(["--cases", str(cases_file), "--results", str(tmp_path / "r"), "--device", "cpu"]) == 0
    return R.latest_by_case(R.read_records(R.experiment_dir(tmp_path / "r", SPEC["name"]) / R.RESULTS_FILE))


def test_the_plan_is_built_once_per_spec_load(tmp_path, expansions, monkeypatch):
    preset = S.load_any(str(_spec_file(tmp_path)))
    (spec,) = preset.specs
    assert expansions == [SPEC["name"]]
    batches = run.plan(preset, results_root=tmp_path / "r", force=False, retry_failed=False)
    spec.cases(), spec.resolved(), spec.plan.problem(spec.cases()[0].case_id)
    assert expansions == [SPEC["name"]]
    assert [(name, ws, [c.case_id for c in cs]) for (name, ws), cs in batches.items()] == [
        (SPEC["name"], ws, [c.case_id for c in spec.cases() if c.world_size == ws]) for ws in (1, 2)]
    recs = _worker(tmp_path, spec.cases(), monkeypatch)
    assert expansions == [SPEC["name"]]                  # the worker reads its cases file, expands nothing
    by_ws = {c.case_id: c.world_size for c in spec.cases()}
    assert {cid: r["status"] for cid, r in recs.items()} == {
        cid: "ok" if ws == 1 else "skipped" for cid, ws in by_ws.items()}
    assert {r["reason"] for cid, r in recs.items() if by_ws[cid] == 2} == {
        "launched with world size 1, case needs 2"}


def test_the_worker_asks_the_plans_function(tmp_path, monkeypatch):
    """A problem the plan's case_problem finds on the worker's node is the worker's skip reason."""
    cases = [c for c in S.load_spec(_spec_file(tmp_path)).cases() if c.world_size == 1]
    monkeypatch.setattr(P, "case_problem", lambda case: f"not on this node ({case.method})")
    recs = _worker(tmp_path, cases, monkeypatch)
    assert {cid: (r["status"], r["reason"]) for cid, r in recs.items()} == {
        c.case_id: ("skipped", f"not on this node ({c.method})") for c in cases}


def test_validation_and_expansion_live_in_the_plan_only():
    for gone in ("validate_cases", "case_problem", "expand"):
        assert not hasattr(S, gone), gone
    assert not hasattr(W, "case_problem") and not hasattr(run, "case_problem")
    assert W.launch_problem is P.launch_problem


def test_the_profile_and_the_plan_are_read_once_and_frozen(tmp_path, monkeypatch):
    spec = S.load_spec(_spec_file(tmp_path))
    monkeypatch.setattr(S, "load_profile", lambda name: pytest.fail(f"profile {name} re-read"))
    assert spec.profile is spec.profile is spec.plan.profile
    assert spec.plan is spec.plan and spec.plan.spec is spec
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.plan.cases = ()
    assert spec.cases() == [p.case for p in spec.plan.cases] and spec.cases() is not spec.cases()


def test_a_bad_combination_is_still_a_load_error(tmp_path):
    raw = {**SPEC, "exclude": [{"method": m} for m in SPEC["methods"]]}
    with pytest.raises(ValueError, match=r"t\.yaml: key 'exclude'.*excludes every case of the sweep"):
        S.parse_spec(raw, "t.yaml")
