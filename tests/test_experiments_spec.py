"""Experiment harness, no processes launched: specs, FLOPs, timing/memory helpers, records, SLURM."""
from __future__ import annotations

import dataclasses
import json
import subprocess
from pathlib import Path

import pytest
import torch
import yaml

from burst_impl.shape import AttnShape
from burst_impl import flops
from experiments.harness import results as R
from experiments.harness.memory import is_oom, measure_peak
from experiments.profiles.cluster import load_profile
from experiments.cluster.slurm import render_sbatch
from experiments.harness.spec import EXPERIMENTS_DIR, load_any, load_preset, load_spec, parse_spec
from experiments.harness.timing import quantile, summarize, time_steps

GOOD = {
    "name": "t_good",
    "methods": ["burst", "burst_qring"],
    "sweep": {"seqlen": [64, 128], "world_size": 2, "heads": 2, "head_dim": 16, "layout": "zigzag"},
    "measure": {"modes": ["fwd_bwd"], "level": "op"},
    "warmup": 0,
    "repeats": 2,
    "cluster": "cpu",
}


def _write(tmp_path: Path, raw: dict, name: str = "s.yaml") -> Path:
    p = tmp_path / name
    p.write_text(yaml.safe_dump(raw))
    return p


# ---------------------------------------------------------------- loading


@pytest.mark.parametrize("path", sorted((EXPERIMENTS_DIR / "specs").glob("*.yaml"))
                         + sorted((EXPERIMENTS_DIR / "cpu").glob("*.yaml")), ids=lambda p: p.stem)
def test_shipped_specs_load(path):
    spec = load_spec(path)
    assert spec.cases(), path
    assert len({c.case_id for c in spec.cases()}) == len(spec.cases())


@pytest.mark.parametrize("preset", ["cpu", "a100_8", "a100_32", "a800_32", "paper"])
def test_presets_load(preset):
    p = load_any(preset)
    assert p.specs


def test_cpu_preset_lists_every_baseline():
    names = {m for s in load_any("cpu").specs for m in s.methods}
    assert {"burst", "burst_qring", "ring", "ring_rsa", "ulysses", "usp", "tp_v1", "tp_v3"} <= names


def test_good_spec_expands(tmp_path):
    spec = load_spec(_write(tmp_path, GOOD))
    cases = spec.cases()
    assert len(cases) == 4
    c = cases[0]
    assert (c.kv_heads, c.dtype, c.causal, c.batch) == (2, "bfloat16", True, 1)
    assert c.case_id == "burst.op.fwd_bwd.N64.G2.B1.Z2.kv2.d16.bfloat16.causal.zigzag"
    assert spec.resolved()["n_cases"] == 4


def _bad(tmp_path, patch: dict, drop: tuple = ()) -> str:
    raw = json.loads(json.dumps(GOOD))
    for k in drop:
        raw.pop(k)
    for k, v in patch.items():
        if "." in k:
            a, b = k.split(".")
            raw[a][b] = v
        else:
            raw[k] = v
    p = _write(tmp_path, raw, "bad.yaml")
    with pytest.raises(ValueError) as e:
        load_spec(p)
    msg = str(e.value)
    assert str(p) in msg, msg
    return msg


@pytest.mark.parametrize("patch,key,rule", [
    ({"repeatz": 3}, "repeatz", "unknown key"),
    ({"sweep.seq_len": 4}, "sweep.seq_len", "unknown key"),
    ({"measure.pass": "fwd"}, "measure.pass", "unknown key"),
    ({"methods": ["burst", "nonsense"]}, "methods", "'nonsense' is not registered"),
    ({"baseline": "ring"}, "baseline", "must be one of methods"),
    ({"sweep.seqlen": [2]}, "sweep", "must be >= 4"),                 # zigzag at G=2: 2G chunks (any N >= 4 splits)
    ({"sweep.world_size": 16, "cluster": "a100_8"}, "sweep.world_size", "exceeds"),
    ({"sweep.world_size": 12, "cluster": "a100_32"}, "sweep.world_size", "multiple of gpus_per_node"),
    ({"measure.modes": ["sideways"]}, "measure.modes", "unknown"),
    ({"measure.level": "galaxy"}, "measure.level", "unknown"),
    ({"repeats": 0}, "repeats", ">= 1"),
    ({"sweep.heads": 3, "sweep.kv_heads": 2}, "sweep", "multiple of kv_heads"),
    ({"cluster": "nowhere"}, "cluster", "no such cluster profile"),
    ({"sweep.dtype": "float8"}, "sweep.dtype", "unknown"),
    ({"sweep.causal": "yes"}, "sweep.causal", "true or false"),
    ({"measure.min_sample_s": -1}, "measure.min_sample_s", ">= 0"),
])
def test_bad_specs_name_file_key_rule(tmp_path, patch, key, rule):
    msg = _bad(tmp_path, patch)
    assert f"key {key!r}" in msg and rule in msg, msg


def test_old_key_and_level_names_are_errors_naming_the_new_ones(tmp_path):
    """``target:`` (now ``cluster:``) and ``level: block`` (now ``layer``) no longer load."""
    raw = dict(GOOD)
    raw["target"] = raw.pop("cluster")
    with pytest.raises(ValueError, match="old.yaml: key 'target': was renamed 'cluster'"):
        parse_spec(raw, "old.yaml")
    raw = dict(GOOD, methods=["burst", "tp_v1"], measure={"modes": ["fwd_bwd"], "level": "block"})
    with pytest.raises(ValueError, match="key 'measure.level': 'block' was renamed 'layer'"):
        parse_spec(raw, "old.yaml")
    preset = tmp_path / "old_preset.yaml"
    preset.write_text(yaml.safe_dump({"specs": ["cpu/cpu_fig2_train.yaml"], "target": "cpu"}))
    with pytest.raises(ValueError, match="key 'target': was renamed 'cluster'"):
        load_preset(preset)


def test_old_cluster_option_is_an_error_naming_the_new_one(capsys):
    from experiments.run import main

    with pytest.raises(SystemExit) as e:
        main(["cpu", "--target", "cpu", "--dry-run"])
    assert e.value.code == 2 and "--target was renamed --cluster" in capsys.readouterr().err


def test_missing_required_key(tmp_path):
    msg = _bad(tmp_path, {}, drop=("sweep",))
    assert "key 'sweep'" in msg and "required" in msg


def test_layer_only_method_at_op_level_is_an_error(tmp_path):
    msg = _bad(tmp_path, {"methods": ["burst", "tp_v1"]})
    assert "key 'measure.level'" in msg and "layer-only" in msg


def test_method_shape_rule_is_an_error_and_exclude_drops_it(tmp_path):
    raw = dict(GOOD, methods=["burst", "ulysses"])
    raw["sweep"] = dict(GOOD["sweep"], heads=3, kv_heads=3, world_size=[2, 1], seqlen=[64])
    with pytest.raises(ValueError, match="impossible for method 'ulysses'"):
        parse_spec(raw, "mem.yaml")
    raw["exclude"] = [{"method": "ulysses", "world_size": 2}]
    spec = parse_spec(raw, "mem.yaml")
    assert {(c.method, c.world_size) for c in spec.cases()} == {("burst", 2), ("burst", 1), ("ulysses", 1)}


def test_method_unavailable_here_is_skipped_with_its_reason():
    """ring_flash_attn needs CUDA and flash-attn: on this machine its cases are skipped, with why."""
    spec = parse_spec(dict(GOOD, methods=["burst", "ring_flash_attn"]), "mem.yaml")
    rfa = [p for p in spec.plan.cases if p.case.method == "ring_flash_attn"]
    assert rfa and "unavailable here (needs ring-flash-attn)" in rfa[0].problem
    assert all(p.problem is None for p in spec.plan.cases if p.case.method == "burst")


# ---------------------------------------------------------------- FLOPs


def test_flop_formula():
    b, n, z, d = 2, 1024, 8, 64
    fwd = 4 * b * n * n * z * d
    s = AttnShape(b, n, z, 2, d, 1)   # GQA does not change it: Z query heads
    assert flops.attention_flops(s.replace(causal=False)) == fwd
    assert flops.attention_flops(s.replace(causal=True)) == fwd / 2
    assert flops.attention_flops(s.replace(causal=False), mode="backward") == 2.5 * fwd
    assert flops.attention_flops(s.replace(causal=True), mode="fwd_bwd") == 3.5 * fwd / 2
    assert flops.tflops_per_s(2e12, 0.5) == pytest.approx(4.0)
    assert flops.tokens_per_s(2, 1000, 0.5) == 4000
    with pytest.raises(ValueError):
        flops.attention_flops(s, mode="nope")


def test_flops_at_paper_scale():
    # BurstEngine attention-only benchmark: 1M tokens, 40 x 128, causal, fwd+bwd.
    f = flops.attention_flops(AttnShape(1, 1 << 20, 40, 40, 128, 1, causal=True), mode="fwd_bwd")
    assert f == pytest.approx(3.5 * 4 * (1 << 40) * 40 * 128 / 2)


# ---------------------------------------------------------------- timing and memory


def test_timing_summary_and_samples():
    s = summarize([3.0, 1.0, 2.0, 4.0])
    assert s["time_median_s"] == 2.5 and s["time_min_s"] == 1.0 and s["time_max_s"] == 4.0
    assert quantile([0.0, 10.0], 0.1) == pytest.approx(1.0)
    calls = []
    samples = time_steps(lambda: calls.append("s"), setup=lambda: calls.append("u"), warmup=2, repeats=3,
                         device=torch.device("cpu"))
    assert len(samples) == 3 and all(t >= 0 for t in samples)
    assert calls == ["u", "s"] * 5


def test_cpu_peak_memory_is_measured():
    def step():
        a = torch.empty(1 << 20, dtype=torch.float32)       # 4 MiB
        b = torch.empty(2 << 20, dtype=torch.float32)       # 8 MiB, both live: 12 MiB
        del a, b
        c = torch.empty(1 << 20, dtype=torch.float32)       # 4 MiB after the frees
        return c.sum()

    peak = measure_peak(step, torch.device("cpu"), start_bytes=7)
    assert 12 << 20 <= peak.peak_bytes < (12 << 20) + (1 << 16)
    assert peak.start_bytes == 7 and "profiler" in peak.method


def test_cpu_peak_infers_frees_on_other_threads():
    """A free the profiler did not see (another thread dropped the last reference) is inferred when the
    address is allocated again; without that inference the peak here would read 12 (fails if removed)."""
    from experiments.harness.memory import _live_peak

    a, b, old = 0x1000, 0x2000, 0x3000
    events = [(0, a, 4), (1, b, 4), (2, a, 4), (3, b, -4), (4, old, -2), (5, b, 6)]
    # live: a 4 + b 4 = 8 at most (a's second block replaces its first; b is freed, then 6 more after the
    # pre-step block at old is freed); counting the events alone would read 12
    assert _live_peak(events) == 8
    assert _live_peak([(0, a, 4), (1, a, 4)]) == 4


def test_oom_classification():
    assert is_oom(torch.OutOfMemoryError("CUDA out of memory"))
    assert is_oom(RuntimeError("[enforce fail at alloc_cpu.cpp] DefaultCPUAllocator: can't allocate memory"))
    assert not is_oom(RuntimeError("shape mismatch"))


# ---------------------------------------------------------------- records


def test_record_schema_and_resume_bookkeeping(tmp_path):
    spec = load_spec(_write(tmp_path, GOOD))
    c1, c2, c3, _ = spec.cases()
    root = tmp_path / "results"
    for c, st in ((c1, "ok"), (c2, "skipped"), (c3, "failed")):
        R.append_record(root, R.base_record(c, st, "why" if st != "ok" else ""))
    recs = R.read_records(root / "t_good" / "results.jsonl")
    assert len(recs) == 3
    for r in recs:
        assert set(R.REQUIRED_KEYS) <= set(r)
        assert r["git"]["commit"] and isinstance(r["git"]["dirty"], bool)
        assert r["versions"]["torch"] == torch.__version__
        assert r["hardware"]["cpu_count"] >= 1
    assert R.done_case_ids(root, "t_good") == {c1.case_id, c3.case_id}
    assert R.done_case_ids(root, "t_good", retry_failed=True) == {c1.case_id}
    # pandas reads it; newest record per case wins
    R.append_record(root, R.base_record(c3, "ok"))
    df = R.load_results(root, "t_good")
    assert len(df) == 3 and df.set_index("case_id").loc[c3.case_id, "status"] == "ok"
    with pytest.raises(ValueError):
        R.append_record(root, {"case_id": "x"})


def test_unfinished_case_is_finalised_with_the_ranks_reason(tmp_path):
    spec = load_spec(_write(tmp_path, GOOD))
    c = spec.cases()[0]
    root = tmp_path / "results"
    R.marker_path(root, c).write_text("now")
    R.write_rank_error(root, c, 1, "oom", "CUDA out of memory")
    R.write_rank_error(root, c, 0, "failed", "gloo connection closed")
    assert R.finalize_unfinished(root, spec.cases(), "killed") == [c.case_id]
    rec = R.read_records(root / "t_good" / "results.jsonl")[-1]
    assert rec["status"] == "oom" and "rank 1" in rec["reason"]
    assert not R.marker_path(root, c).exists()


# ---------------------------------------------------------------- SLURM


def test_slurm_script_for_a_4_node_profile(tmp_path):
    prof = load_profile("a100_32")
    assert (prof.nodes, prof.gpus_per_node) == (4, 8)
    text = render_sbatch(spec_name="fig3", profile=prof, world_size=32, n_cases=5, cases_file="/x/cases.json",
                         results_root="/x/results", repo="/x/repo", log_dir="/x/logs", case_budget_s=999)
    for needle in ("#SBATCH --nodes=4", "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-node=8",
                   "#SBATCH --partition=", "#SBATCH --account=", "#SBATCH --time=08:00:00",
                   'scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1',
                   "-m experiments.harness.worker", "--fail-rest",
                   "-m experiments.harness.executor --slurm", "--procs-per-node 8",
                   "--deadline-s $(( TIME_LIMIT_S - RESERVE_S - SECONDS ))"):
        assert needle in text, needle
    p = tmp_path / "job.sbatch"
    p.write_text(text)
    assert subprocess.run(["bash", "-n", str(p)]).returncode == 0
    one = render_sbatch(spec_name="fig4a", profile=prof, world_size=4, n_cases=1, cases_file="c", results_root="r",
                        repo="/x", log_dir="l", case_budget_s=10)
    assert "#SBATCH --nodes=1" in one and "--procs-per-node 4" in one


def test_dry_run_prints_commands(tmp_path, capsys):
    from experiments.run import main

    assert main([str(_write(tmp_path, GOOD)), "--dry-run", "--results", str(tmp_path / "r")]) == 0
    out = capsys.readouterr().out
    assert "torch.distributed.run --standalone --nproc-per-node 2" in out and "experiments.harness.worker" in out
    assert not (tmp_path / "r" / "t_good" / "results.jsonl").exists()
    assert main(["a100_32", "--dry-run", "--results", str(tmp_path / "r")]) == 0
    out = capsys.readouterr().out
    assert "#SBATCH --nodes=4" in out and "sbatch --parsable" in out


def test_one_function_builds_the_shape_of_a_case_a_record_and_a_dataframe_row():
    """``axes.shape_from``: Case.from_dict and the figures' FLOPs both build their AttnShape with it."""
    import pandas as pd

    from experiments.harness.axes import shape_from

    spec = parse_spec(GOOD, "good.yaml")
    for case in spec.cases():
        assert shape_from(case.to_dict()) == case.shape
    shape = AttnShape(2, 1024, 8, 2, 32, 4, dtype="float32", causal=False, layout="zigzag", mask="window:64:0")
    rec = {**dataclasses.asdict(shape), "case_id": "x", "status": "ok"}
    old = {k: v for k, v in rec.items() if k not in ("mask", "layout")}      # written before those axes
    rows = pd.DataFrame([rec, old]).to_dict("records")      # numpy scalars; NaN where a column is missing
    assert shape_from(rows[0]) == shape
    assert shape_from(rows[1]) == shape.replace(mask="", layout="contiguous")
    mha = pd.DataFrame([{**rec, "kv_heads": None}, rec]).to_dict("records")[0]    # kv_heads NaN: = heads (MHA)
    assert shape_from(mha) == shape.replace(kv_heads=8)
    assert all(type(getattr(shape_from(rows[0]), a)) is type(getattr(shape, a)) for a in rec if a in shape.__dict__)


def test_op_samples_run_calls_back_to_back_where_the_spec_asks():
    """``measure.min_sample_s``: an op or layer sample runs its call back to back (``steps.consecutive``) until it
    lasts that long; a step with an untimed setup (backward) stays one call; 0 leaves the step as built."""
    import time as _time
    from experiments.harness.steps import consecutive
    from experiments.harness.timed_step import Step
    n = []

    def call():
        n.append(1)
        _time.sleep(0.002)
        return len(n)
    one = Step(step=call, setup=None, start_bytes=0)
    many = consecutive(one, 0.02, device=torch.device("cpu"), group=None)
    assert 5 <= many.calls <= 11 and many.single is call, many.calls      # 0.02 s of ~2 ms calls
    before = len(n)
    many.step()
    assert len(n) - before == many.calls
    assert consecutive(one, 0.0, device=torch.device("cpu"), group=None) is one
    with_setup = Step(step=call, setup=lambda: None, start_bytes=0)
    assert consecutive(with_setup, 0.02, device=torch.device("cpu"), group=None) is with_setup
    spec = parse_spec({**GOOD, "measure": {"min_sample_s": 0.5}}, "t.yaml")
    assert {c.min_sample_s for c in spec.cases()} == {0.5}
    # the mask benchmark times one call a sample, as the model's host terms are measured (docs/emulator.md)
    assert {c.min_sample_s for c in load_spec("experiments/cpu/cpu_varlen_magiattention_2x4.yaml").cases()} == {0.0}
