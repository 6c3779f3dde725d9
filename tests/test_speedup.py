"""The one speedup and its interval (experiments.harness.speedup): paired vs unpaired, modelled, missing
samples, an interval that straddles 1; and the same interval for the same two records on every path that
shows one (the run summary, the figures, the emulator's report and ratios, the claims page)."""
from __future__ import annotations

import random

import pandas as pd
import pytest

from experiments.cluster import report as cluster_report
from experiments.harness import speedup as S
from experiments.harness import summary
from experiments.harness.timing import summarize
from experiments.plots import _speedup
from experiments.report import compare
from tests._helpers import write_rows

SHAPE = "op.fwd_bwd.N1024.G4"


def _rec(method: str, samples: list[float] | None, *, together: tuple[str, ...] = (), **kw) -> dict:
    """A measured ok record of ``method`` at one shape; ``together``: the methods timed in its rounds."""
    rec = {"case_id": f"{method}.{SHAPE}", "method": method, "status": "ok", "mode": "fwd_bwd", "seqlen": 1024,
           "world_size": 4, "batch": 1, "interleaved_with": [f"{m}.{SHAPE}" for m in together]}
    if samples is not None:
        rec.update(summarize(samples), time_samples_s=samples)
    return {**rec, **kw}


def _drifting(k: int = 12, seed: int = 0) -> tuple[list[float], list[float]]:
    """Two methods timed in the same rounds on a machine that slows both alike (x1 .. x1.5): ``fast`` takes
    1/1.25 of ``slow``'s time per round, each with 1% noise of its own."""
    rng = random.Random(seed)
    drift = [1 + 0.5 * i / k for i in range(k)]
    slow = [1.25 * d * (1 + rng.uniform(-0.01, 0.01)) for d in drift]
    fast = [1.00 * d * (1 + rng.uniform(-0.01, 0.01)) for d in drift]
    return fast, slow


def test_paired_where_timed_in_the_same_rounds_else_unpaired():
    fast, slow = _drifting()
    paired = S.speedup(_rec("a", fast, together=("b",)), _rec("b", slow, together=("a",)))
    unpaired = S.speedup(_rec("a", fast), _rec("b", slow))
    assert paired.how == S.PAIRED and unpaired.how == S.UNPAIRED
    assert paired.value == pytest.approx(unpaired.value) and 1.2 < paired.value < 1.3
    assert paired.lo <= paired.value <= paired.hi and paired.faster() is True
    # the drift slowed both alike: pairing by round takes it out of the interval
    assert unpaired.hi - unpaired.lo > 3 * (paired.hi - paired.lo)
    assert (paired.n_rec, paired.n_base, paired.level) == (12, 12, 0.95)
    # a round missing on one side: the samples are no longer one per round, so not paired
    assert S.speedup(_rec("a", fast[:-1], together=("b",)), _rec("b", slow, together=("a",))).how == S.UNPAIRED


def test_modelled_records_give_an_exact_ratio_with_no_interval():
    a = _rec("a", None, source="modelled", time_median_s=1.0)
    b = _rec("b", None, source="modelled", time_median_s=1.5)
    s = S.speedup(a, b)
    assert (s.how, s.value, s.lo, s.hi, s.has_interval) == (S.MODELLED, 1.5, None, None, False)
    assert s.faster() is True and S.speedup(b, a).faster() is False
    with pytest.raises(ValueError, match="a prediction over a measurement is not a speedup"):
        S.speedup(a, _rec("b", [1.0] * 8))
    with pytest.raises(ValueError, match="level=1.5 must be between 0 and 1"):
        S.speedup(a, b, level=1.5)


@pytest.mark.parametrize("rec_samples, base_samples", [
    (None, None),                      # records written before samples were kept
    ([1.0] * 8, None),
    ([1.0, 1.1, 0.9, 1.0, 1.05], [2.0] * 8),    # 5 samples: the median has no 95% interval, nor the ratio
])
def test_too_few_or_no_samples_give_a_value_that_decides_nothing(rec_samples, base_samples):
    rec = _rec("a", rec_samples, time_median_s=1.0)
    base = _rec("b", base_samples, time_median_s=2.0)
    s = S.speedup(rec, base)
    assert (s.how, s.value, s.lo, s.hi) == (S.NO_INTERVAL, 2.0, None, None)
    assert s.faster() is None and not s.resolved
    r = compare.time_ratio(rec, base)
    assert r.status == compare.NO_INTERVAL and r.text() == "2.00x (no interval: decides nothing)"
    (row,) = summary.ratios([rec, base], "b")
    assert row["lo"] is None and not row["resolved"]


def test_an_interval_that_straddles_one_decides_nothing():
    rng = random.Random(1)
    a = [1.0 + rng.uniform(-0.1, 0.1) for _ in range(12)]
    b = [1.0 + rng.uniform(-0.1, 0.1) for _ in range(12)]
    rec, base = _rec("a", a), _rec("b", b)
    s = S.speedup(rec, base)
    assert s.lo < 1 < s.hi and s.faster() is None and not s.resolved
    assert compare.time_ratio(rec, base).status == compare.INCONCLUSIVE
    (row,) = summary.ratios([rec, base], "b")
    assert not row["resolved"]


def _write(root, experiment: str, recs: list[dict]) -> None:
    d = root / experiment
    d.mkdir(parents=True)
    extra = {"cluster": {}, "comm_fwd_bytes": 0, "comm_bwd_bytes": 0, "experiment": experiment}
    write_rows(d / "results.jsonl", [{**extra, **r} for r in recs])


def test_every_path_gives_the_same_interval_for_the_same_two_records(tmp_path):
    """The run summary, the figure, the emulator's report and ratios and the claims page each show
    the speedup of a over b: the same value and interval (before harness.speedup the report used
    [min, max] extreme over extreme and the claims page the medians' intervals, extreme over extreme)."""
    fast, slow = _drifting()
    a, b = _rec("a", fast, together=("b",)), _rec("b", slow, together=("a",))
    want = S.speedup(a, b)
    assert want.how == S.PAIRED
    got = {}
    (row,) = summary.ratios([a, b], "b")
    got["summary"] = (row["speedup"], row["lo"], row["hi"])
    df = pd.DataFrame([a, b])
    fig = _speedup("b")(df[df["method"] == "a"], df, "a").iloc[0]
    got["figure"] = (fig["speedup"], fig["speedup_lo"], fig["speedup_hi"])
    _write(tmp_path, "exp", [a, b])
    # the emulator's report: t(method) / t(ref), so with ref a the row of b is the speedup of a over b
    rep = {x["method"]: x for x in cluster_report.report("exp", results_root=tmp_path, ref="a")["rows"]}
    got["emulator report"] = (rep["b"]["ratio"], rep["b"]["ratio_lo"], rep["b"]["ratio_hi"])
    rat = {x["method"]: x for x in cluster_report.ratios_of("exp", results_root=tmp_path, ref="b")["speedup"]}
    got["emulator ratios"] = (rat["a"]["speedup"], rat["a"]["lo"], rat["a"]["hi"])
    claim = compare.time_ratio(a, b)
    got["claims"] = (claim.value, claim.lo, claim.hi)
    for path, (value, lo, hi) in got.items():
        assert (value, lo, hi) == pytest.approx((want.value, want.lo, want.hi), rel=1e-12), path
