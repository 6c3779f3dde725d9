"""The model-only variants are listed once (experiments/model_only.py) and every reader takes them from there:
the performance model's schedules, the papers' method map and its measured records, the figures."""
from __future__ import annotations

from baselines.registry import METHODS
from experiments.model_only import MODEL_ONLY
from experiments.perfmodel.schedules import VARIANTS, builder
from experiments.report.compare import method_select
from experiments.report.paper import load_methods


def test_the_perf_model_models_each_variant_on_its_method():
    assert list(VARIANTS) == list(MODEL_ONLY)
    for name, v in MODEL_ONLY.items():
        assert v.method in METHODS and VARIANTS[name][0] == v.method and VARIANTS[name][2] == v.label
        base, fn = builder(name)
        assert base == v.method and all(fn.keywords[k] == val for k, val in v.schedule.items())


def test_the_papers_rows_of_a_variant_find_its_method_on_its_kernel():
    """methods.yaml names the variant; a measured run is found as its method on the variant's kernel."""
    methods = load_methods()
    rows = {name: m for name, m in methods.items() if m.method in MODEL_ONLY}
    assert {m.method for m in rows.values()} >= {"burst_nolao", "tp_v1_noflash"}
    for m in rows.values():
        v = MODEL_ONLY[m.method]
        assert method_select(m, measured=True) == {**m.select, "method": v.method, "kernel": v.kernel}
        assert method_select(m, measured=False) == {**m.select, "method": v.name}
