"""Small blocking messages on the emulated cluster: the message probe's pieces that need no cluster
(experiments/cluster/emulator/message_probe.py), the line fitted to it (experiments/perfmodel/emulated/message.py)
and where the emulated cost model charges it. A run on an emulated cluster is ``burst-bench cluster messages
<profile>`` (root; measured in docs/findings.md)."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from baselines import AttnShape
from experiments.cluster.emulator import message_probe as P
from experiments.perfmodel.costs import CostModel
from experiments.perfmodel.emulated.costs import EmulatedCosts
from experiments.perfmodel.emulated.hardware import emulated_hardware
from experiments.perfmodel.emulated.measured import HBM, KernelTimes, needed
from experiments.perfmodel.emulated.message import (MESSAGE_FILE, MessageCost, fit_messages, load_messages,
                                                   messages_of)
from experiments.perfmodel.model import predict_case
from experiments.perfmodel.schedules.common import EXCESS_SUFFIX
from experiments.profiles.hardware import load_hardware

HELD = (0.002, 10e-9)                  # s per message, s per byte: the synthetic probe's truth
INTRA, INTER = 4e6, 1e6                # bytes/s per rank of the synthetic cluster


def _cluster() -> dict:
    return {"emulated": True, "nodes": 2, "ranks_per_node": 2, "profile": "t_emu", "summary": "synthetic 2x2",
            "links": {"intra": {"bytes_per_s": INTRA, "kind": "nvlink", "latency_us": 0.0},
                      "inter": {"bytes_per_s": INTER, "kind": "roce", "latency_us": 0.0}}}


def test_cases_parse_and_bad_ones_name_the_rule():
    assert P.parse_cases("ring:256,all_to_all:2048") == [P.Case("ring", 256), P.Case("all_to_all", 2048)]
    for bad, words in (("star:256", "pattern in"), ("ring:0", "positive"), ("ring:6", "multiple of 4"),
                       ("ring:256:8", "<pattern>:<bytes>")):
        with pytest.raises(ValueError, match=words):
            P.parse_cases(bad)
    with pytest.raises(ValueError, match="nodes >= 2, not 1"):
        P.check_shape([P.Case("pair", 256)], 1, 4)
    P.check_shape([P.Case("all_gather", 256), P.Case("ring", 256)], 1, 4)


def test_summary_is_the_slowest_ranks_wall_and_the_median_cpu():
    c = P.Case("all_gather", 256)
    ranks = [{c.name: {"wall": [0.02, 0.03, 0.04], "cpu": [0.001, 0.002, 0.003 + r]}} for r in (0.0, 0.01)]
    (row,) = P.summarize(ranks, [c])
    assert row["wall_s"] == pytest.approx(0.03) and row["cpu_s"] == pytest.approx(0.002)
    assert row["pattern"] == "all_gather" and row["bytes"] == 256 and "all_gather:256" in P.table([row])


def test_messages_per_call_are_gloos():
    assert messages_of("ring", 512, 4) == (1, 512.0)
    assert messages_of("all_gather", 512, 4) == (3, 512.0)          # ring all-gather: G-1 chunks
    assert messages_of("all_reduce", 512, 4) == (6, 128.0)          # ring all-reduce: 2(G-1) of 1/G
    assert messages_of("all_to_all", 512, 4) == (3, 512.0)          # one piece per other rank


def _record() -> dict:
    """A probe record whose collectives' messages hold their rank HELD exactly, lone hops twice as long, and one
    collective row bound by its link."""
    rows = []
    for pattern in ("ring", "pair", "all_gather", "all_reduce", "all_to_all"):
        for nbytes in (256, 4096, 16384):
            n, each = messages_of(pattern, nbytes, 4)
            slow = 2.0 if pattern in ("ring", "pair") else 1.0
            rows.append({"pattern": pattern, "bytes": nbytes, "wall_s": slow * n * (HELD[0] + HELD[1] * each),
                         "cpu_s": n * 1e-4})
    # 3 x 64 KiB across nodes at 1 MB/s: 65 ms a message on the link, which the transfer already carries
    rows.append({"pattern": "all_gather", "bytes": 65536, "wall_s": 3 * 0.07, "cpu_s": 3e-4})
    return {"profile": "t_emu", "cluster": _cluster(), "rows": rows}


def test_the_line_goes_through_the_collectives_and_leaves_out_what_the_link_bounds():
    m = fit_messages(_record())
    assert (m.held_s, m.held_s_per_byte) == pytest.approx(HELD)
    assert m.max_bytes == 65536 and m.cpu_s == pytest.approx(1e-4)
    assert [p[3] for p in m.points if p[1] == 65536] == [False]
    assert not [p for p in m.points if p[0] in ("ring", "pair") and p[3]]
    assert m.covers(65536) and not m.covers(65537) and not m.covers(0)
    assert "2.00 ms + 10.00 ns/B per message" in m.text and "lone hops, not fitted: 4.08 ms" in m.text
    assert m.cpu_only(0.25).held(4096) == pytest.approx(4e-4)          # 0.1 ms CPU at a quarter core
    with pytest.raises(ValueError, match="no collective"):
        fit_messages({**_record(), "rows": _record()["rows"][-1:]})


def test_load_needs_the_runs_profile(tmp_path):
    (tmp_path / MESSAGE_FILE).write_text(json.dumps(_record()))
    assert load_messages(tmp_path, "t_emu").held_s == pytest.approx(HELD[0])
    assert load_messages(tmp_path, "other_emu") is None and load_messages(tmp_path / "none", "t_emu") is None


def test_an_experiments_own_probes_come_before_the_roots(tmp_path):
    """A run that measured its probes in its own window (``<root>/<experiment>/``) is priced with them; an
    experiment without its own falls back to the root's, file by file."""
    from experiments.perfmodel.emulated.host_cost import CALL_CPU_FILE, load_call_cpu

    slower = _record()
    slower["rows"] = [{**r, "wall_s": 2 * r["wall_s"]} for r in slower["rows"]]
    (tmp_path / MESSAGE_FILE).write_text(json.dumps(slower))
    (tmp_path / CALL_CPU_FILE).write_text(json.dumps({"rows": [{"method": "root"}]}))
    (tmp_path / "exp").mkdir()
    (tmp_path / "exp" / MESSAGE_FILE).write_text(json.dumps(_record()))
    assert load_messages(tmp_path, "t_emu", "exp").held_s == pytest.approx(HELD[0])
    assert load_messages(tmp_path, "t_emu", "other").held_s == pytest.approx(fit_messages(slower).held_s)
    assert fit_messages(slower).held_s > HELD[0]
    assert load_messages(tmp_path, "t_emu").path == str(tmp_path / MESSAGE_FILE)
    assert load_call_cpu(tmp_path, "exp")["rows"] == [{"method": "root"}]      # the root's, none of its own
    (tmp_path / "exp" / CALL_CPU_FILE).write_text(json.dumps({"rows": [{"method": "own"}]}))
    assert load_call_cpu(tmp_path, "exp")["rows"] == [{"method": "own"}]


def test_small_messages_hold_their_sender_per_message_and_large_ones_keep_the_excess():
    """ulysses at a tiny shape: every all-to-all piece is in range, so each transfer's excess is pieces x held;
    the same schedule with the range below its pieces charges the overlap excess line instead."""
    shape = AttnShape(batch=1, seqlen=64, heads=4, kv_heads=4, head_dim=8, world_size=4, dtype="float32",
                      causal=False, layout="contiguous")
    hw = emulated_hardware(_cluster(), "float32")
    keys = needed([SimpleNamespace(method="ulysses", shape=shape, mode="fwd_bwd", level="op")], hw,
                  predict=predict_case)
    times = KernelTimes(procs=4, threads=1, seconds={k: (1e-9 if k == HBM else 0.01) for k in keys})
    m, excess = fit_messages(_record()), {"intra": (0.5, 0.0), "inter": (0.7, 0.0)}

    def extras(msgs):
        sch = predict_case("ulysses", shape, mode="fwd_bwd", level="op", hardware=hw, keep_schedule=True,
                           costs=lambda h, dt: EmulatedCosts(h, dt, times=times, excess=excess, messages=msgs)).schedule
        sends = {t.name: t for t in sch.tasks if t.kind == "comm" and sum(t.nbytes.values())}
        return [(sends[t.name[:-len(EXCESS_SUFFIX)]], t.duration) for t in sch.tasks if t.name.endswith(EXCESS_SUFFIX)]

    small = extras(m)
    assert small
    for send, held in small:
        pieces = 1 if ".intra[" in send.name else 2            # 2 x 2: one peer in the node, two across
        each = sum(send.nbytes.values()) / pieces
        assert held == pytest.approx(pieces * (HELD[0] + HELD[1] * each))
    large = extras(MessageCost(0.002, 0.0, max_bytes=4, cpu_s=1e-4))      # a range of 4 B: no piece is in it
    assert [d for _, d in large] == [0.5 if ".intra[" in s.name else 0.7 for s, _ in large]
    # an accelerator's cost model charges nothing, whatever the pieces
    assert CostModel(load_hardware("a100_pcie_8"), "bfloat16").sender_seconds(4096, False, 3) == 0.0
