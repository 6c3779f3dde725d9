"""The reproduction report: the papers' values load and map to the suite, the verdict logic respects
intervals, and the page builds from the committed results with every section and relative links only."""
from __future__ import annotations

import fnmatch
import shutil
import time
from pathlib import Path

import pytest

from experiments.report.claims import Claim, load_claims
from experiments.report.compare import (CONTRADICTED, INCONCLUSIVE, MISSING, NO_INTERVAL, REPRODUCED,
                                        combine, time_ratio)
from experiments.report.context import load_context
from experiments.report.build import write
from experiments.report.evidence import Experiment, Root
from experiments.report.paper import PAPER_DIR, load_methods, load_tables, values
from experiments.report.steps import steps_outcome
from experiments.report.verdict import judge

ROOT = Path(__file__).resolve().parent.parent
SPEC_NAMES = {p.stem for d in ("specs", "cpu") for p in (ROOT / "experiments" / d).glob("*.yaml")}
# experiments the performance model writes besides the specs' own names (perfmodel/__main__.py)
KNOWN = SPEC_NAMES | {f"{s}_model_level" for s in SPEC_NAMES} | \
    {"burstengine_ablation_14b_1m_model_level", "burstengine_scaling_14b_model_level"}
# paper tables no spec reproduces yet: the report says "no records" for them; remove a name here once its
# spec exists
PENDING: set[str] = set()


def test_every_paper_value_loads_with_its_source_and_maps_to_the_suite():
    tables, methods = load_tables(), load_methods()
    cells = [v for t in tables for v in values(t, methods)]
    assert len(cells) > 100
    for v in cells:
        assert v.table.source in v.source and v.row.label in v.source and v.column.label in v.source
        assert v.select["method"] == v.method.method
    for t in tables:
        patterns = t.modelled + t.measured
        matched = {n for p in patterns for n in KNOWN if fnmatch.fnmatchcase(n, p)}
        assert matched or t.id in PENDING, f"{t.path}: no spec matches {patterns}"
        assert not (matched and t.id in PENDING), f"{t.id} has a spec now: take it out of PENDING"


def _copy_paper(tmp_path: Path) -> Path:
    d = tmp_path / "paper"
    shutil.copytree(PAPER_DIR, d)
    return d


@pytest.mark.parametrize("edit, words", [
    (("rows:", "unknown_key: 1\nrows:"), ["table2_prefill_7b.yaml", "unknown_key", "unknown key"]),
    (("method: RingAttention,", "method: Ring Attention,"), ["rows[0].method", "not a method of methods.yaml"]),
    (("0.42, 0.87, ", ""), ["rows[0].values", "5 values for 7 columns"]),
    (("quantity: latency_s", "quantity: speed"), ["quantity", "unknown quantity 'speed'"]),
])
def test_a_bad_paper_table_is_a_value_error_naming_file_key_and_rule(tmp_path, edit, words):
    d = _copy_paper(tmp_path)
    f = d / "table2_prefill_7b.yaml"
    f.write_text(f.read_text().replace(*edit, 1))
    with pytest.raises(ValueError) as e:
        load_tables(d)
    for w in words:
        assert w in str(e.value)


def test_claims_load_and_name_known_methods_and_tables(tmp_path):
    claims = load_claims({t.id for t in load_tables()})
    assert {c.id for c in claims} >= {"less_comm", "speedup_128k_32gpu", "engine_sota", "exact",
                                      "ablation_steps", "attn_order"}
    d = _copy_paper(tmp_path)
    (d / "claims.yaml").write_text((d / "claims.yaml").read_text().replace("kind: ordering", "kind: sorting"))
    with pytest.raises(ValueError, match="claims.yaml: key '\\[7\\].kind': unknown kind 'sorting'"):
        load_claims({t.id for t in load_tables(d)}, d)


def _rec(method, t, lo=None, hi=None, status="ok", **kw):
    # with an interval: 7 step times spread evenly over [lo, hi] (median t where t is its middle), from which
    # the verdict's speedup interval is computed; without one: a record that kept no samples
    samples = [lo + (hi - lo) * i / 6 for i in range(7)] if lo is not None else None
    return {"method": method, "status": status, "time_median_s": t, "time_ci_lo_s": lo, "time_ci_hi_s": hi,
            "time_samples_s": samples, "mode": "fwd_bwd", "seqlen": 4096, "world_size": 4, "batch": 1,
            "case_id": f"{method}.x", **kw}


def _exp(*recs) -> Experiment:
    return Experiment(Root(ROOT / "results" / "synthetic", "this machine"), "synthetic", tuple(recs))


CLAIM = Claim("c", "BurstAttention", "Burst is faster than TP-V3", "speedup", "BurstAttention",
              ("TP-V3 + FlashAttention",))


@pytest.mark.parametrize("recs, status", [
    ((_rec("burst", 1.0, 0.95, 1.05), _rec("tp_v3", 2.0, 1.9, 2.1)), REPRODUCED),
    ((_rec("burst", 2.0, 1.9, 2.1), _rec("tp_v3", 1.0, 0.95, 1.05)), CONTRADICTED),
    ((_rec("burst", 1.0, 0.8, 1.2), _rec("tp_v3", 1.1, 0.9, 1.3)), INCONCLUSIVE),   # inside the interval
    ((_rec("burst", 1.0), _rec("tp_v3", 2.0)), NO_INTERVAL),                        # no interval: undecided
    ((_rec("burst", 1.0, 0.9, 1.1), _rec("tp_v3", None, status="oom")), REPRODUCED),
])
def test_the_verdict_respects_intervals(recs, status):
    v = judge(CLAIM, [_exp(*recs)], load_methods(), measured=True, tables={}, patterns=("synthetic",))
    assert v.status == status, v


def test_an_unmeasurable_claim_says_why():
    v = judge(CLAIM, [], load_methods(), measured=True, tables={}, patterns=("burstengine_main*",))
    assert v.status == MISSING and "burstengine_main*" in v.reason
    v = judge(CLAIM, [_exp(_rec("burst", 1.0, 0.9, 1.1))], load_methods(), measured=True, tables={},
              patterns=("synthetic",))
    assert v.status == MISSING and "TP-V3" in v.reason


EXACT = Claim("e", "BurstAttention", "the same function", "equal_loss", "BurstAttention", ("RingAttention",),
              tolerance=3e-4)


@pytest.mark.parametrize("ppl, status", [((620.8, 620.8001), REPRODUCED), ((620.8, 640.0), CONTRADICTED)])
def test_equal_function_reads_the_perplexity_where_a_record_has_one(ppl, status):
    """Table 4's own quantity, the held-out perplexity, decides before any training loss."""
    recs = [_rec(m, 1.0, 0.9, 1.1, perplexity=p, losses=[5.0, 4.0]) for m, p in zip(("burst", "ring_rsa"), ppl)]
    v = judge(EXACT, [_exp(*recs)], load_methods(), measured=True, tables={}, patterns=("synthetic",))
    assert v.status == status and "perplexities" in v.outcomes[0].detail, v


def test_a_measured_ablation_mirror_is_read_at_its_own_size():
    """The ablation table selects the paper's size (14B, 1M tokens, 32 GPUs); a CPU mirror's rows, at
    another size, still count, and a step that moves against the paper's is contradicted."""
    table = next(t for t in load_tables() if t.id == "burstengine_ablation")
    names = ("ring_baseline", "qring_backward", "double_ring", "fused_head", "seq_checkpoint", "whole_cache")
    methods = ("ring", "burst_qring", "burst_double_ring", "burst_double_ring", "burst_double_ring",
               "burst_double_ring")
    recs = [_rec(m, 1.0 - 0.05 * i, 0.99 - 0.05 * i, 1.01 - 0.05 * i, variant=n, tokens_per_s=1000 / (1 - 0.05 * i),
                 mem_peak_bytes=2 ** 30) for i, (n, m) in enumerate(zip(names, methods))]
    status, detail = steps_outcome(table, _exp(*recs), load_methods(), measured=True)
    # tokens/s rises at every step: the paper's 4 moving tokens/s steps agree; the memory stays put, so
    # none of the paper's 3 moving memory steps does (not moving is not a decrease either)
    assert status == "mixed" and "4 of 7 step changes" in detail, (status, detail)


def test_modelled_records_are_deterministic_and_combining_says_disagreement():
    r = time_ratio({**_rec("burst", 1.0), "source": "modelled"}, {**_rec("tp_v3", 1.5), "source": "modelled"})
    assert r.status == REPRODUCED and abs(r.value - 1.5) < 1e-12
    assert combine([REPRODUCED, CONTRADICTED]) == "mixed"
    assert combine([REPRODUCED, INCONCLUSIVE]) == "reproduced in part"
    assert combine(["mixed", MISSING]) == "mixed"
    assert combine([MISSING]) == MISSING


SECTIONS = ("claims", "model-error", "intervals", *(f"table-{t.id}" for t in load_tables()))


def test_the_page_builds_from_the_committed_results_with_every_section(tmp_path):
    t0 = time.perf_counter()
    html_path, md_path = write(load_context(page_dir=ROOT / "reports"))
    assert time.perf_counter() - t0 < 30
    html, md = html_path.read_text(), md_path.read_text()
    for anchor in SECTIONS:
        assert f'id="{anchor}"' in html and f'id="{anchor}"' in md
    assert str(ROOT) not in html and str(ROOT) not in md and "/tmp/" not in md
    assert "results/reference/" in md and "results/modelled/" in md
    # the section on records without an interval counts them: every committed timing record has one now
    # (re-measured at 255d5d9); a record without one is undecided (test_verdicts, NO_INTERVAL)
    intervals = md.split('id="intervals"', 1)[1]
    assert "0 of " in intervals.split("\n\n", 2)[1], intervals[:300]


def test_this_machines_run_comes_first_and_supersedes_the_reference(tmp_path):
    """After `make reproduce` the page shows this machine's run of an experiment, not the committed one."""
    base = tmp_path / "results"
    shutil.copytree(ROOT / "results" / "reference" / "cpu2-amd-epyc" / "cpu_fig2_train",
                    base / "reference" / "cpu2-amd-epyc" / "cpu_fig2_train")
    mine = base / "box-b" / "cpu_fig2_train"
    shutil.copytree(base / "reference" / "cpu2-amd-epyc" / "cpu_fig2_train", mine)
    (base / "modelled").mkdir()
    ctx = load_context(base, machine="box-b", page_dir=tmp_path / "reports")
    assert [r.kind for r in ctx.roots] == ["this machine", "reference"]
    (exp,) = ctx.measured(("cpu_fig2_train",))
    assert exp.root.kind == "this machine"
    html_path, md_path = write(ctx)
    md = md_path.read_text()
    assert "box-b/cpu_fig2_train" in md and "results/reference" in md      # the reference root is still listed
