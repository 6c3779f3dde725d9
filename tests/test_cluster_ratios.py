"""experiments.cluster.report.ratios on synthetic records: speedups over the reference and overlap gains
with bootstrap intervals, and the fraction of communication hidden. No cluster, no processes."""
from __future__ import annotations

import math

import pytest

from experiments.cluster.report import ratios


def _rec(method, n, samples, waits=None, status="ok"):
    return {"status": status, "seqlen": n, "method": method, "time_samples_s": list(samples),
            "comm_wait_s_per_rank": waits}


def _noisy(center, k=7, spread=0.02):
    # deterministic small spread around ``center`` (+-spread relative), so intervals are narrow but not empty
    return [center * (1 + spread * (i - k // 2) / (k // 2)) for i in range(k)]


RECORDS = [
    _rec("burst", 4096, _noisy(3.0)),
    _rec("burst_double_ring", 4096, _noisy(2.0)),
    _rec("ulysses", 4096, _noisy(3.0)),
    _rec("burst_no_overlap", 4096, _noisy(4.0), waits=[1.8, 2.0, 2.0, 2.4]),
    _rec("burst_double_ring_no_overlap", 4096, _noisy(2.5), waits=[0.9, 1.0, 1.0, 1.1]),
    _rec("burst", 2048, _noisy(1.0)),
    _rec("burst_double_ring", 2048, [9.9], status="failed"),     # failed records are ignored
]


def test_speedups_and_their_intervals():
    out = ratios(RECORDS, ref="burst")
    by = {(x["seqlen"], x["method"]): x for x in out["speedup"]}
    dr = by[(4096, "burst_double_ring")]
    assert dr["speedup"] == pytest.approx(1.5)
    assert 1.4 < dr["lo"] < 1.5 < dr["hi"] < 1.6 and dr["resolved"]
    uly = by[(4096, "ulysses")]                       # same times: the interval covers 1, not a speedup
    assert uly["speedup"] == pytest.approx(1.0) and uly["lo"] < 1 < uly["hi"] and not uly["resolved"]
    assert (2048, "burst_double_ring") not in by      # failed
    assert by[(4096, "burst")]["speedup"] == 1.0 and not by[(4096, "burst")]["resolved"]   # the reference's noise
    assert out["largest_seqlen"] == 4096
    assert "burst_double_ring" in out["text"] and "1.50" in out["text"]


def test_overlap_gain_and_hidden_fraction():
    out = ratios(RECORDS, ref="burst")
    ov = {x["method"]: x for x in out["overlap"]}
    assert set(ov) == {"burst", "burst_double_ring"}   # methods with a *_no_overlap twin at the same N
    b = ov["burst"]
    # off 4.0 s, on 3.0 s, transfers waited for 2.0 s (median over ranks) with overlap off: half hidden
    assert b["gain"] == pytest.approx(4.0 / 3.0) and b["comm_off_s"] == pytest.approx(2.0)
    assert b["hidden"] == pytest.approx(0.5)
    assert b["hidden_lo"] < 0.5 < b["hidden_hi"] and b["gain_lo"] < b["gain"] < b["gain_hi"]
    assert b["compute_off_s"] == pytest.approx(2.0) and math.isnan(b["compute_cal_s"])   # no calibration recorded
    d = ov["burst_double_ring"]
    assert d["hidden"] == pytest.approx((2.5 - 2.0) / 1.0)


def test_hidden_is_nan_without_wait_times_and_no_records_is_an_error():
    out = ratios([_rec("a", 8, [1.0, 1.1]), _rec("a_no_overlap", 8, [2.0, 2.1])], ref="a")
    assert [x["method"] for x in out["speedup"]] == ["a", "a_no_overlap"] and math.isnan(out["overlap"][0]["hidden"])
    with pytest.raises(ValueError, match="no ok records"):
        ratios([_rec("burst", 8, [1.0], status="failed")])
