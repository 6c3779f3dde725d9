"""The overlap probe's pieces that need no cluster (experiments/cluster/emulator/overlap_probe.py): its
case syntax, who talks to whom in each pattern, and the excess it reports. A run on an emulated cluster
is ``python -m experiments.cluster overlap <profile>`` (root; measured in docs/findings.md)."""
from __future__ import annotations

import pytest

from experiments.cluster.emulator import overlap_probe as P


def test_cases_parse_and_bad_ones_name_the_rule():
    assert P.parse_cases("ring:256:524288,pair:1024:8") == [P.Case("ring", 256, 524288), P.Case("pair", 1024, 8)]
    for bad, words in (("loop:256:8", "pattern in"), ("ring:256", "<pattern>:<tokens>:<bytes>"),
                       ("ring:0:8", "positive"), ("ring:256:6", "multiple of 4")):
        with pytest.raises(ValueError, match=words):
            P.parse_cases(bad)


def test_patterns_pair_the_ranks_as_the_rings_do():
    # 2 nodes x 4: ring = the node's ring; pair = the same local rank of the other node, both ways;
    # oneway = node 0 sends, node 1 receives
    assert [P.peers("ring", r, 8, 4) for r in (0, 3, 4)] == [(1, 3), (0, 2), (5, 7)]
    assert [P.peers("pair", r, 8, 4) for r in (1, 5)] == [(5, 5), (1, 1)]
    assert [P.peers("oneway", r, 8, 4) for r in (2, 6)] == [(6, None), (None, 2)]
    with pytest.raises(ValueError, match="pattern"):
        P.peers("star", 0, 8, 4)


def test_summary_excess_is_both_over_the_slower_of_the_two():
    c = P.Case("ring", 256, 1024)
    # two ranks, two rounds: the slowest rank's wall times (the same on every rank), each rank's CPU times
    wall = {"compute": [0.10, 0.12], "transfer": [0.05, 0.15], "both": [0.13, 0.16]}
    ranks = [{c.name: {"wall": wall, "cpu": {"compute": [0.02, 0.02], "transfer": [0.01, 0.01],
                                             "both": [0.03, 0.03 + r]}}} for r in (0.0, 0.02)]
    (row,) = P.summarize(ranks, [c])
    assert row["excess_samples_s"] == pytest.approx([0.03, 0.01])       # both - max(compute, transfer)
    assert row["excess_s"] == pytest.approx(0.02)
    assert row["both_cpu_s"] == pytest.approx(0.03)                     # median over ranks and rounds
    # the CPU the hop adds (median both - median compute = 0.01 s) at the ranks' CPU rate (0.11 s wall
    # per 0.02 s CPU of compute)
    assert row["cpu_excess_s"] == pytest.approx(0.01 * 0.11 / 0.02)
    assert P.cpu_excess({"compute": 0.02, "both": 0.019}, 0.1) == 0.0    # noise below 0 counts as none
    assert row["transfer_bytes_per_s"] == pytest.approx(1024 / 0.10)
    assert "ring:256:1024" in P.table([row])
