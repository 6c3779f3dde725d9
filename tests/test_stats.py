"""Numbers a reader can trust (issue 8): statistics helpers, interleaved adaptive repeats, paired
ratios, code-path flags, resume keyed by machine and commit, figure marks. No process groups: fast."""
from __future__ import annotations

import math
import random
import time

import matplotlib
import pandas as pd
import pytest
import torch

from burst_impl.shape import AttnShape
from experiments.harness import record, results as R
from experiments.harness import summary as S
from experiments.harness.spec import Case, parse_spec
from experiments.harness.timing import (RepeatPolicy, autorange, ci_halfwidth, median_ci, ratio_interval, summarize,
                                        time_interleaved)

matplotlib.use("Agg")
CPU = torch.device("cpu")


# ---------------------------------------------------------------- intervals


def test_median_ci_is_the_binomial_order_statistic_interval():
    assert median_ci([1, 2, 3, 4, 5]) is None                 # n=5: coverage 1 - 2/32 = 0.94 < 0.95
    assert median_ci([6, 1, 5, 2, 4, 3]) == (1, 6)            # n=6: 1 - 2/64 = 0.969
    assert median_ci(list(range(9))) == (1, 7)                # n=9: k=2, 1 - 2*10/512 = 0.961
    assert median_ci(list(range(8))) == (0, 7)                # n=8: k=2 would cover 0.93 only
    assert median_ci(list(range(9)), level=0.5)[0] >= 2       # a lower level gives a narrower interval
    assert ci_halfwidth([1.0] * 5) == math.inf                # no interval yet
    assert ci_halfwidth([1.0, 1.0, 1.0, 1.1, 0.95, 1.0]) == pytest.approx(0.1)
    s = summarize([1.0] * 3)
    assert s["time_ci_lo_s"] is None and s["time_ci_halfwidth_rel"] is None


def test_median_ci_covers_the_true_median_about_95_percent():
    """Coverage check on exponential samples (skewed like step times): 95% nominal, >= 95% exact
    for order statistics; 400 trials give a standard error of ~1.1%, so >= 0.92 cannot fail by chance."""
    rng = random.Random(1)
    true = math.log(2)
    hits = 0
    for _ in range(400):
        lo, hi = median_ci([rng.expovariate(1.0) for _ in range(15)])
        hits += lo <= true <= hi
    assert 0.92 <= hits / 400 <= 1.0


def test_repeat_policy_stops_for_a_stated_reason():
    p = RepeatPolicy(min_repeats=6, max_repeats=10, target=0.05, budget_s=100)
    assert p.stop([[1.0] * 5], 0, 0) is None                  # below the minimum
    assert p.stop([[1.0] * 6], 0, 0) == "converged"
    noisy = [1.0, 2.0, 1.0, 2.0, 1.0, 2.0]
    assert p.stop([noisy], 0, 0) is None
    assert p.stop([noisy * 2], 0, 0) == "max_repeats"
    assert p.stop([noisy], 99.5, 1.0) == "time_budget"
    assert p.stop([[1.0] * 6, noisy], 0, 0) is None           # every step must converge
    with pytest.raises(ValueError, match="max_repeats"):
        RepeatPolicy(min_repeats=6, max_repeats=3)
    with pytest.raises(ValueError, match="target"):
        RepeatPolicy(min_repeats=1, max_repeats=3, target=0)


def test_time_interleaved_alternates_and_pairs_samples_by_round():
    calls = []
    steps = [(lambda: calls.append("A"), lambda: calls.append("a")), (lambda: calls.append("B"), None)]
    res = time_interleaved(steps, warmup=1, policy=RepeatPolicy(min_repeats=3, max_repeats=3), device=CPU)
    assert res.rounds == 3 and res.stop in ("converged", "max_repeats")
    assert [len(s) for s in res.samples] == [3, 3]
    assert calls == ["a", "A", "B"] + ["a", "A", "B", ] * 3   # warm-up each, then rounds A B A B


def test_time_interleaved_records_each_ranks_cpu_per_round():
    """A step that spins holds its CPU for its whole wall time; one that sleeps holds almost none. 30 ms each:
    the process clock's resolution is far finer, and a spin cannot take less CPU than about its wall time
    unless the machine takes the core away (then its wall time grows too, so the ratio's 0.5 bound holds)."""
    def spin():
        t = time.perf_counter()
        while time.perf_counter() - t < 0.03:
            pass

    res = time_interleaved([(spin, None), (lambda: time.sleep(0.03), None)], warmup=0, device=CPU,
                           policy=RepeatPolicy(min_repeats=3, max_repeats=3))
    (spin_cpu,), (sleep_cpu,) = res.cpu_samples          # one rank, three rounds each
    assert len(spin_cpu) == len(sleep_cpu) == 3
    assert all(c > 0.5 * w for c, w in zip(spin_cpu, res.samples[0]))
    assert all(c < 0.01 for c in sleep_cpu)
    (spin_main,), (sleep_main,) = res.cpu_main_samples    # the timing thread's share: here all of it
    assert all(0.5 * c < m <= c + 1e-3 for m, c in zip(spin_main, spin_cpu))
    assert all(m < 0.01 for m in sleep_main)


def test_autorange_runs_enough_calls_for_a_minimum_sample_and_per_call_divides_by_them():
    """A 10 ms call and a 0.1 s minimum: about 10 calls (sleep overshoots, so 5-10), its setup before each
    pilot; no minimum: one call and nothing run; the cap holds."""
    runs = []
    call = lambda: (runs.append("c"), time.sleep(0.01))     # noqa: E731
    n = autorange(call, lambda: runs.append("s"), 0.1, cap=64, device=CPU, pilots=3)
    assert 5 <= n <= 10, n
    assert runs == ["s", "c"] * 4                             # one untimed call, then three pilots
    runs.clear()
    assert autorange(call, None, 0.0, cap=64, device=CPU) == 1 and runs == []
    assert autorange(call, None, 10.0, cap=4, device=CPU) == 4
    with pytest.raises(ValueError, match="cap=0"):
        autorange(call, None, 0.1, cap=0, device=CPU)
    res = time_interleaved([(lambda: time.sleep(0.004), None), (lambda: None, None)], warmup=0, device=CPU,
                           policy=RepeatPolicy(min_repeats=3, max_repeats=3))
    per = res.per_call([4, 1])
    assert per.samples[0] == [x / 4 for x in res.samples[0]] and per.samples[1] == res.samples[1]
    assert per.cpu_samples[0] == [[x / 4 for x in r] for r in res.cpu_samples[0]]
    assert per.mean_samples[0] == [x / 4 for x in res.mean_samples[0]] and per.rounds == res.rounds
    with pytest.raises(ValueError, match="one count >= 1 per step"):
        res.per_call([1])


def test_adaptive_repeats_stop_when_converged():
    res = time_interleaved([(lambda: None, None)], warmup=0, device=CPU,
                           policy=RepeatPolicy(min_repeats=6, max_repeats=400, target=10.0))
    assert res.stop == "converged" and res.rounds == 6       # a +-1000% target is met at the first interval


def test_paired_ratio_is_tighter_than_unpaired_under_drift():
    """Both methods slowed alike by a drifting machine (x1 .. x2 over the rounds): the paired interval
    of the 1.25 ratio stays tight, the unpaired one is wide."""
    rng = random.Random(0)
    drift = [1 + i / 20 for i in range(20)]
    a = [1.25 * d * (1 + rng.uniform(-0.01, 0.01)) for d in drift]
    b = [1.00 * d * (1 + rng.uniform(-0.01, 0.01)) for d in drift]
    paired, unpaired = ratio_interval(a, b, paired=True), ratio_interval(a, b)
    assert paired["lo"] <= 1.25 <= paired["hi"] and paired["hi"] - paired["lo"] < 0.05
    assert unpaired["hi"] - unpaired["lo"] > 3 * (paired["hi"] - paired["lo"])
    with pytest.raises(ValueError, match="paired"):
        ratio_interval(a, b[:-1], paired=True)


# ---------------------------------------------------------------- spec keys


def test_spec_repeat_keys_and_groups():
    raw = {"name": "t", "methods": ["burst", "ring"], "sweep": {"seqlen": [64, 128], "world_size": 2, "heads": 2,
           "head_dim": 8}, "cluster": "cpu", "repeats": 6, "max_repeats": 20, "ci_target": 0.03}
    spec = parse_spec(raw)
    c = spec.cases()[0]
    assert (c.repeats, c.repeat_cap, c.ci_target, c.interleave) == (6, 20, 0.03, True)
    assert Case.from_dict(c.to_dict()) == c
    from experiments.harness.worker import groups

    gs = groups(spec.cases())
    assert [[x.method for x in g] for g in gs] == [["burst", "ring"], ["burst", "ring"]]
    assert [len(g) for g in groups(parse_spec({**raw, "interleave": False}).cases())] == [1, 1, 1, 1]
    with pytest.raises(ValueError, match="max_repeats"):
        parse_spec({**raw, "max_repeats": 3})
    with pytest.raises(ValueError, match="ci_target"):
        parse_spec({**raw, "ci_target": 2})


# ---------------------------------------------------------------- records: summary, resume


def _case(method="burst", n=64, **kw) -> Case:
    shape = AttnShape(seqlen=n, world_size=2, batch=1, heads=2, kv_heads=2, head_dim=8)
    return Case(experiment="t_stats", method=method, level="op", mode="fwd_bwd", shape=shape, warmup=0,
                repeats=6, seed=0, **kw)


def _ok(case: Case, samples: list[float], with_: list[Case] = ()) -> dict:
    rec = R.base_record(case, "ok")
    rec.update(summarize(samples), time_samples_s=samples, interleaved_with=[c.case_id for c in with_])
    return rec


def test_code_path_pairs_that_differ_are_flagged():
    a, b, r = _case("burst"), _case("burst_qring"), _case("ring")
    same = [1.0, 1.01, 0.99, 1.0, 1.02, 0.98, 1.0]
    recs = [_ok(a, same, [b, r]), _ok(b, [x * 1.3 for x in same], [a, r]), _ok(r, same, [a, b])]
    flags = S.code_path_flags(recs)
    assert [(f["a"], f["b"]) for f in flags] == [("burst", "burst_qring")] and flags[0]["paired"]
    recs[1] = _ok(b, same, [a, r])
    assert S.code_path_flags(recs) == []
    rat = {x["method"]: x for x in S.ratios(recs, "ring")}
    assert not rat["burst"]["resolved"] and rat["burst"]["speedup"] == pytest.approx(1.0)
    # overlap off changes the schedule on purpose: not a pair expected to agree
    assert S.code_path_pairs(["burst", "burst_no_overlap"]) == []


def test_resume_counts_only_this_machine_and_commit(tmp_path, monkeypatch):
    root = tmp_path / "results"
    here = {"commit": "c" * 40, "dirty": False}
    monkeypatch.setenv(R.MACHINE_ENV, "box-a")
    mine, other_machine, other_commit = _case(n=64), _case(n=128), _case(n=256)
    for c in (mine, other_machine, other_commit):
        R.append_record(root, _ok(c, [1.0] * 6))
    path = root / "t_stats" / R.RESULTS_FILE
    recs = record.read(path)
    for r in recs:
        r["git"] = dict(here)
    recs[1]["machine"] = "box-b"
    recs[2]["git"] = {**here, "commit": "d" * 40}
    record.write_all(path, recs)
    assert R.done_case_ids(root, "t_stats", machine="box-a", git=here) == {mine.case_id}
    assert R.done_case_ids(root, "t_stats", machine="box-a", git={**here, "dirty": True}) == set()
    assert R.done_case_ids(root, "t_stats", machine="box-b", git=here) == {other_machine.case_id}
    assert recs[0]["machine"] == "box-a"                          # every record names its machine
    assert R.machine_root("box-a", tmp_path).name == "box-a"


def test_plan_ignores_reference_results_of_another_machine(tmp_path, monkeypatch):
    from experiments.harness.spec import Preset
    from experiments.run import plan

    spec = parse_spec({"name": "t_stats", "methods": ["burst"], "sweep": {"seqlen": 64, "world_size": 2,
                       "heads": 2, "head_dim": 8}, "cluster": "cpu"})
    root = tmp_path / "r"
    monkeypatch.setenv(R.MACHINE_ENV, "elsewhere")
    R.append_record(root, R.base_record(spec.cases()[0], "ok"))
    preset = Preset(name="p", path="-", specs=(spec,))
    assert plan(preset, results_root=root, force=False, retry_failed=False) == {}
    monkeypatch.setenv(R.MACHINE_ENV, "fresh-clone-machine")
    assert sum(len(v) for v in plan(preset, results_root=root, force=False, retry_failed=False).values()) == 1


def test_failure_in_an_interleaved_group_is_charged_to_its_cause(tmp_path):
    root = tmp_path / "r"
    a, b = _case("burst"), _case("ring")
    for c in (a, b):
        R.write_marker(root, c, [a.case_id, b.case_id])
    R.write_rank_error(root, a, 0, "failed", "RuntimeError: Connection closed by peer [/x/pair.cc:1]")
    R.write_current(root, a, 0)
    R.write_current(root, b, 1)                  # rank 1 was killed in ring and left no error file
    assert R.finalize_unfinished(root, [a, b], "killed") == [b.case_id]
    rec = R.latest_by_case(R.read_records(root / "t_stats" / R.RESULTS_FILE))[b.case_id]
    assert rec["status"] == "failed" and "[/x/pair.cc:1]" in rec["reason"]
    assert not R.marker_path(root, a).exists()   # burst is run again by the next launch


# ---------------------------------------------------------------- figures


def _fig_records(tmp_path, statuses: dict) -> "pd.DataFrame":
    recs = []
    for (method, n), st in statuses.items():
        c = _case(method, n)
        recs.append(_ok(c, [1.0 + 0.01 * i for i in range(6)]) if st == "ok" else R.base_record(c, st, f"{st} here"))
    return pd.DataFrame([r.row() for r in recs]).dropna(axis=1, how="all")   # as results.load_results


def test_skipped_and_oom_cases_are_marked_not_dropped(tmp_path):
    import matplotlib.pyplot as plt

    from experiments import figure_parts

    df = _fig_records(tmp_path, {("burst", 64): "ok", ("burst", 128): "oom", ("ring", 64): "skipped",
                                 ("ring", 128): "failed"})
    fig, ax = plt.subplots()
    for m in ("burst", "ring"):
        figure_parts.mark_bad(ax, df, "seqlen", m)
    marks = {(ln.get_marker(), ln.get_xdata()[0]) for ln in ax.lines}
    assert marks == {("v", 128), ("s", 64), ("X", 128)}
    texts = {t.get_text() for t in ax.texts}
    assert {"burst OOM", "ring skip", "ring fail"} <= texts
    plt.close(fig)


def test_figures_name_their_origin_and_draw_no_backward_bars_for_forward_runs(tmp_path, monkeypatch):
    import matplotlib.figure

    from experiments import figure_parts, plots

    saved = []
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda self, *a, **k: saved.append(self))
    monkeypatch.setenv(R.MACHINE_ENV, "box-a")
    recs = []
    for m, src in (("burst", "counted"), ("ulysses", "formula")):
        c = Case(experiment="t_fwd", method=m, level="op", mode="forward", shape=_case().shape, warmup=0, repeats=6,
                 seed=0)
        r = _ok(c, [1.0] * 6)
        r.update(comm_fwd_bytes=1 << 20, comm_fwd_formula_bytes=1 << 20, comm_bwd_bytes=None,
                 comm_bwd_formula_bytes=7 << 20, bytes_source=src)
        recs.append(r)
    df = pd.DataFrame([r.row() for r in recs]).dropna(axis=1, how="all")   # as results.load_results
    assert plots.comm_figure(df, {"origin": "results/reference/box-a"}, tmp_path / "c.png")
    ax = saved[-1].axes[0]
    (foot,) = [t.get_text() for t in saved[-1].texts if t.get_gid() == figure_parts.FOOTER_GID]
    assert "measured on box-a" in foot and "results/reference/box-a" in foot
    labels = [t.get_text() for lg in (ax.get_legend(), *[a for a in ax.artists]) if lg for t in lg.get_texts()]
    assert not [lb for lb in labels if "backward" in lb], labels
    assert any("formula by the adapter" in lb for lb in labels)
    hatches = [p.get_hatch() for p in ax.patches if p.get_height() > 0]
    assert "xx" in hatches and {None, ""} & set(hatches), hatches
    df["source"] = "modelled"
    assert figure_parts.hw_and_date(df).startswith("modelled")


def test_slurm_jobs_name_the_machine_their_records_belong_to():
    from experiments.profiles.cluster import load_profile
    from experiments.cluster.slurm import render_sbatch

    kw = dict(spec_name="fig3", profile=load_profile("a100_32"), world_size=32, n_cases=1, cases_file="c",
              results_root="/x/results/a100_32", repo="/x/repo", log_dir="/x/logs", case_budget_s=99)
    assert "export EXPERIMENTS_MACHINE=a100_32" in render_sbatch(**kw)
    assert "export EXPERIMENTS_MACHINE=box-a" in render_sbatch(**kw, machine="box-a")


def test_layer_tflops_count_the_projections_that_were_timed():
    from burst_impl import flops

    s = AttnShape(seqlen=1024, world_size=4, batch=2, heads=8, kv_heads=2, head_dim=32, causal=True)
    att = 3.5 * 4 * 2 * 8 * 32 * 1024 * 1024 / 2                               # causal: N^2/2 entries
    h = 8 * 32
    proj = 2 * 2 * 1024 * h * (h + 2 * 2 * 32) + 2 * 2 * 1024 * h * h          # QKV (GQA) + output, forward
    assert flops.case_flops("op", s, "fwd_bwd") == (att, flops.SCOPES["op"])
    assert flops.case_flops("layer", s, "fwd_bwd")[0] == pytest.approx(att + 3 * proj)
    assert flops.case_flops("layer", s, "forward")[0] == pytest.approx(att / 3.5 + proj)
    with pytest.raises(ValueError, match="level"):
        flops.case_flops("kernel", s, "forward")
