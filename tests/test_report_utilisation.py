"""The report's implied utilisation (experiments/report/utilisation.py): the paper's time and the model's over
one FLOP count, the GPUs and their peak, beside the model's communication share, in each modelled table of
whole-model times. Synthetic records, no results folder."""
from __future__ import annotations

from pathlib import Path

import pytest

from experiments.report.doc import Table
from experiments.report.evidence import Experiment, Root
from experiments.report.model_error import cells
from experiments.report.paper import load_methods, load_tables
from experiments.report.table_section import _modelled
from experiments.report.utilisation import utilisation

PEAK = 312e12
FLOPS = 0.05 * 8 * PEAK * 0.44       # 5.0% of 8 A100s' peak over the paper's 0.44 s (Table 2, Burst, 4K)


def _rec(method, seqlen, t, comm, status="ok"):
    return {"method": method, "status": status, "time_median_s": t if status == "ok" else None, "seqlen": seqlen,
            "world_size": 8, "batch": 1, "dtype": "bfloat16", "flops": FLOPS, "source": "modelled",
            "hardware_profile": "synthetic", "case_id": f"{method}.N{seqlen}",
            "hardware": {"accelerator": {"peak_tflops": {"bfloat16": 312.0}}},
            "prediction": {"breakdown": {"makespan_s": t, "critical_comm_s": comm}}}


class _Ctx:
    """What table_section._modelled reads of a Context."""

    def __init__(self, exp):
        self.exp, self.methods = exp, load_methods()

    def modelled(self, patterns):
        return [self.exp]

    def href(self, path):
        return str(path)


@pytest.fixture
def table2():
    return next(t for t in load_tables() if t.id == "table2")


def _exp(*recs):
    return Experiment(Root(Path("/nowhere/modelled"), "modelled"), "table2_prefill_7b_8gpu_model_level", recs)


def test_the_paper_and_the_model_share_one_flop_count_gpus_and_peak(table2):
    exp = _exp(_rec("burst", 4096, 0.22, 0.11), _rec("tp_v1", 4096, None, 0.0, status="oom"))
    cs = cells(table2, load_methods(), [exp])
    burst = next(c for c in cs if c.paper.method.method == "burst" and c.paper.column.label == "4K")
    u = utilisation(burst)
    assert u.paper == pytest.approx(0.05) and u.model == pytest.approx(0.10) and u.comm_share == pytest.approx(0.5)
    assert burst.paper.value / 0.22 == pytest.approx(u.model / u.paper)       # the ratio is the time ratio
    tp = next(c for c in cs if c.paper.method.method == "tp_v1" and c.paper.column.label == "4K")
    assert utilisation(tp).model is None and utilisation(tp).paper == pytest.approx(FLOPS / (0.67 * 8 * PEAK))
    none = next(c for c in cs if c.paper.method.method == "burst" and c.paper.column.label == "8K")
    assert utilisation(none).text() == "—"                                   # no record: nothing to say


def test_the_tables_section_shows_it_per_cell(table2):
    blocks = _modelled(_Ctx(_exp(_rec("burst", 4096, 0.22, 0.11))), table2)
    tables = [b for b in blocks if isinstance(b, Table)]
    assert len(tables) == 2, "the error table and the utilisation table"
    util = tables[1]
    assert util.header[1:] == tuple(c.label for c in table2.columns)
    row = next(r for r in util.rows if r[0] == "7B BurstAttention")
    assert row[1] == "paper 5.0% · model 10.0% (comm 50%)"
