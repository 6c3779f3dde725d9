"""The overlap probe's pieces that need no cluster (experiments/cluster/emulator/overlap_probe.py): its
case syntax, who talks to whom in each pattern at 2, 3 and 4 nodes, the excess it reports, and how the
tool answers a probe that fails. A run on an emulated cluster is ``burst-bench cluster overlap <profile>``
(root; tests/test_emulator_tools.py runs one at 3 nodes; measured in docs/findings.md)."""
from __future__ import annotations

import contextlib

import pytest

from experiments.cli import ToolFailed, run_cli
from experiments.cluster import __main__ as cluster_cli
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


# a ring inside a node needs 2 ranks of it (check_shape refuses one)
SHAPES = [(p, n, k) for p in P.PATTERNS for n in (2, 3, 4) for k in (1, 2, 4) if not (p == "ring" and k < 2)]


@pytest.mark.parametrize("pattern, nodes, per_node", SHAPES)
def test_every_receive_has_its_send_at_any_node_count(pattern, nodes, per_node):
    """What each rank posts matches what its peers post, so no rank waits for a message nobody sends (the
    old ``oneway`` paired nodes by halves: at 3 nodes the last node waited, at 4 node 0 sent to a sender)."""
    world = nodes * per_node
    plan = [P.peers(pattern, r, world, per_node) for r in range(world)]
    for r, (dst, src) in enumerate(plan):
        assert dst != r and src != r, (r, dst, src)
        if dst is not None:
            assert plan[dst][1] == r, f"rank {r} sends to {dst}, which receives from {plan[dst][1]}"
        if src is not None:
            assert plan[src][0] == r, f"rank {r} receives from {src}, which sends to {plan[src][0]}"
        crosses = [x // per_node != r // per_node for x in (dst, src) if x is not None]
        assert all(c == (pattern != "ring") for c in crosses), (r, dst, src)    # ring inside, the others across
    flows = sum(dst is not None for dst, _ in plan)
    # every node takes part but the odd one out of oneway's pairs
    assert flows == {"ring": world, "pair": world, "oneway": (nodes // 2) * per_node}[pattern]
    if pattern == "oneway" and nodes % 2:
        assert plan[-per_node:] == [(None, None)] * per_node


def test_a_case_the_cluster_cannot_pair_is_refused_before_bring_up():
    ring, pair = P.parse_cases("ring:64:8,pair:64:8")
    P.check_shape([ring, pair], 3, 2)
    with pytest.raises(ValueError, match="ranks_per_node >= 2, not 1"):
        P.check_shape([ring], 4, 1)
    with pytest.raises(ValueError, match="nodes >= 2, not 1"):
        P.check_shape([pair], 1, 4)


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


class _Cluster:
    """An emulated cluster that is up without namespaces: what the overlap tool asks of one."""
    emulated, fallback = True, None

    def __init__(self, profile):
        self.profile = profile

    def env(self, world):
        return {}

    def launches(self, world, args, port, module):
        return [["true"]]

    def info(self, world):
        return {"summary": "fake"}


def _probe_that_fails(monkeypatch, *, emulated: bool = True):
    fake = type("Fake", (_Cluster,), {"emulated": emulated, "fallback": None if emulated else "no veth here"})
    monkeypatch.setattr(cluster_cli, "EmulatedCluster", lambda prof: contextlib.nullcontext(fake(prof)))
    monkeypatch.setattr(cluster_cli, "run_launch",
                        lambda *a, **k: (1, "[rank 4] RuntimeError: Connection closed by peer"))


@pytest.mark.parametrize("emulated", [True, False], ids=["ranks-fail", "no-namespaces"])
def test_a_failed_probe_is_one_error_line_and_exit_2(monkeypatch, capsys, emulated):
    _probe_that_fails(monkeypatch, emulated=emulated)
    assert run_cli(cluster_cli.main, ["overlap", "a800_ib_emu_3x2", "--rates", "intra=4e6,inter=1e6"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    (line,) = [ln for ln in err.splitlines() if ln.strip()]
    assert line.startswith("error: ")
    assert ("rank 4" if emulated else "no veth here") in line


def test_a_failed_probe_shows_its_traceback_with_debug(monkeypatch):
    _probe_that_fails(monkeypatch)
    with pytest.raises(ToolFailed, match="overlap probe failed"):
        run_cli(cluster_cli.main, ["overlap", "a800_ib_emu_3x2", "--rates", "intra=4e6,inter=1e6", "--debug"])
