"""The report's sparse-training section (experiments/report/sparse_training.py) from synthetic records: the
modelled table's rows in the paper's order with the ratio to causal on the balanced layout, the measured
table's tokens/s interval (the slow end of the step's interval is the low end), OOM marked, the paper's
column saying it is not transcribed, and the section wired into the page."""
from __future__ import annotations

from pathlib import Path

from experiments.report.build import build_doc
from experiments.report.claims import load_rules
from experiments.report.context import Context
from experiments.report.doc import Heading, Table
from experiments.report.evidence import Experiment, Root
from experiments.report.paper import load_methods
from experiments.report.sparse_training import NOT_TRANSCRIBED, sparse_blocks

N, G = 262144, 8


def _rec(model, mask, layout, t, status="ok", **kw):
    return {"model": model, "mask": mask, "layout": layout, "time_median_s": t, "status": status, "batch": 1,
            "seqlen": N, "world_size": G, "work_imbalance_rows": 1.0 if layout != "contiguous" else 1.008,
            "source": "modelled", "hardware_profile": "a800_ib_4x8", **kw}


def _exp(name, *recs, kind="modelled") -> Experiment:
    return Experiment(Root(Path("/nonexistent") / kind, kind), name, tuple(recs))


def _tables(blocks) -> list[Table]:
    return [b for b in blocks if isinstance(b, Table)]


def test_modelled_rows_order_ratio_and_paper_column():
    recs = (_rec("burstengine_14b", "window:4096:0", "contiguous", 2.0), _rec("burstengine_14b", "", "balanced", 8.0),
            _rec("llama2_7b", "window:4096:0", "balanced", 1.0, mfu=0.5), _rec("llama2_7b", "", "balanced", 4.0),
            _rec("burstengine_14b", "window:4096:0", "balanced", None, status="oom"))
    (table,) = _tables(sparse_blocks([_exp("model_burstengine_sparse_train_x", *recs)], [], str))
    rows = [r[:5] for r in table.rows]
    assert rows == [
        ("llama2_7b", "causal", "balanced", f"{N / 4.0 / G:,.0f}", "x1.00"),
        ("llama2_7b", "window:4096:0", "balanced", f"{N / 1.0 / G:,.0f}", "x4.00"),
        ("burstengine_14b", "causal", "balanced", f"{N / 8.0 / G:,.0f}", "x1.00"),
        ("burstengine_14b", "window:4096:0", "balanced", "OOM", "—"),
        ("burstengine_14b", "window:4096:0", "contiguous (mask-based, unbalanced)", f"{N / 2.0 / G:,.0f}", "x4.00"),
    ]
    assert table.rows[1][5] == "50%" and table.rows[4][6] == "1.008"
    assert all(r[-1] == NOT_TRANSCRIBED for r in table.rows)


def test_measured_interval_and_missing_experiments():
    rec = _rec("cpu_small", "window:32:0", "striped", 2.0, time_ci_lo_s=1.6, time_ci_hi_s=2.5, source=None)
    rec.update(seqlen=2048)
    blocks = sparse_blocks([], [_exp("cpu_model_burstengine_sparse_train", rec, kind="reference")], str)
    (table,) = _tables(blocks)
    assert table.rows[0][4] == f"{2048 / 2.0 / G:,.0f} [{2048 / 2.5 / G:,.0f}, {2048 / 1.6 / G:,.0f}]"
    assert table.rows[0][2] == "striped (the authors' balanced)" and table.rows[0][5] == "2.000"
    text = " ".join(str(p) for b in blocks if hasattr(b, "pieces") for p in b.pieces)
    assert "Modelled: no records of model_burstengine_sparse_train_*" in text
    none = sparse_blocks([], [], str)
    assert not _tables(none) and "Measured: no records" in " ".join(p for b in none for p in b.pieces)


def test_the_section_is_on_the_page(tmp_path):
    ctx = Context({}, load_methods(), [], [], tmp_path, load_rules())
    heads = [b.anchor for b in build_doc(ctx).blocks if isinstance(b, Heading)]
    assert "sparse-training" in heads
