"""The mean rank's time beside the slowest rank's (issue 37 item 3): the performance model's per-rank ends, the
one TFLOP/s helper of both, and what a record measured before the field existed shows (nothing invented)."""
from __future__ import annotations

import pytest

from baselines import AttnShape
from experiments.perfmodel.model import predict_case
from experiments.perfmodel.simulator import Schedule


def test_schedule_rank_ends_mean_and_max():
    """Rank 0 computes 3 s, rank 1 computes 1 s then sends 1 s: ends 3 and 2; makespan 3, mean 2.5."""
    s = Schedule()
    s.add("c0", kind="compute", resource="compute/0", duration=3.0, rank=0)
    c1 = s.add("c1", kind="compute", resource="compute/1", duration=1.0, rank=1)
    s.add("send1", kind="comm", resource="send.intra/1", duration=1.0, deps=[c1], rank=1)
    assert s.rank_ends() == {0: 3.0, 1: 2.0}
    b = s.breakdown()
    assert b["makespan_s"] == 3.0 and b["mean_rank_end_s"] == pytest.approx(2.5)


def test_modelled_mean_rank_time_is_at_most_the_slowest_and_equal_when_even():
    """An imbalanced ring (contiguous causal) has ranks that finish early; Ulysses' ranks all end together."""
    hw = "h100_sxm_ib_8x8"
    ring = predict_case("ring", AttnShape(1, 8 * 4096, 8, 8, 64, 8, causal=True, layout="contiguous"),
                        mode="fwd_bwd", level="op", hardware=hw)
    assert ring.breakdown["mean_rank_end_s"] < 0.99 * ring.time_s
    uly = predict_case("ulysses", AttnShape(1, 8 * 4096, 8, 8, 64, 8, causal=True), mode="fwd_bwd", level="op",
                       hardware=hw)
    assert uly.breakdown["mean_rank_end_s"] == pytest.approx(uly.time_s, rel=1e-9)


def _rec(case_id, method, layout, causal, mask, t, t_mean, *, g=8, n=4096):
    return {"case_id": case_id, "status": "ok", "method": method, "layout": layout, "causal": causal, "mask": mask,
            "seqlen": n, "world_size": g, "time_median_s": t, "time_mean_rank_s": t_mean, "flops": 8e12,
            "tflops_per_rank": 8e12 / t / g / 1e12, "prediction": {"memory": {"total_bytes": 2 ** 30},
                                                                    "breakdown": {"critical_comm_s": 0.0,
                                                                                  "makespan_s": t}}}


def test_tflops_from_either_rank_and_records_without_the_mean():
    from experiments.harness import rank_times as RT

    r = _rec("a", "burst", "zigzag", True, "", 2.0, 1.6)
    assert RT.tflops_per_rank(r) == pytest.approx(0.5) and RT.tflops_per_rank(r, RT.MEAN) == pytest.approx(0.625)
    assert RT.spread(r) == pytest.approx(1.25)
    old = {**r, "time_mean_rank_s": None}               # measured before the field existed: nothing made up
    assert RT.tflops_per_rank(old, RT.MEAN) is None and RT.spread(old) is None
    with pytest.raises(ValueError, match="which='median'"):
        RT.rank_time(r, "median")


def test_summary_reports_the_spread_and_counts_old_records():
    from experiments.harness.summary import rank_spread

    recs = [_rec("a", "burst", "zigzag", True, "", 2.0, 1.6), _rec("b", "ring", "zigzag", True, "", 1.0, 1.0),
            {**_rec("c", "ring", "zigzag", False, "", 1.0, None)}]
    got = rank_spread(recs)
    assert got["with_mean_rank"] == 2 and got["without_mean_rank"] == 1
    assert got["max"] == pytest.approx(1.25) and got["max_case"] == "a"


def test_modelled_table_facets_masks_and_layouts_and_shows_both_ranks():
    """A spec sweeping masks and layouts: one grid per mask, a column per (method, layout), and the mean rank's
    TFLOP/s beside the slowest's (the old table showed only the first record of each method)."""
    from experiments.perfmodel import tables as T

    recs = [_rec("a", "burst", "balanced", True, "docs:magiattention:0", 2.0, 1.6),
            _rec("b", "burst", "zigzag", True, "docs:magiattention:0", 4.0, 2.0),
            _rec("c", "burst", "zigzag", True, "", 1.0, 1.0)]
    facets = dict(T._facets(recs))
    assert set(facets) == {"varlen-causal (docs:magiattention:0)", "causal"}
    grid = T._grid(facets["varlen-causal (docs:magiattention:0)"], ["burst"], "seqlen", "tflops_mean", 10.0,
                   by_layout=True)
    assert grid[0] == "| N | burst (balanced) | burst (zigzag) |"
    assert grid[2] == "| 4K | 1 (6%) | 0 (5%) |"
    assert T.mask_name(False, "docs:pile:1") == "varlen-full (docs:pile:1)" and T.mask_name(False, "") == "full"
