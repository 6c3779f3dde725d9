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
