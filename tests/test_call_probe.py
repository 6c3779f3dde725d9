"""The host term's probe on the emulated cluster (experiments/cluster/emulator/call_probe.py) and the measurement it
shares with the loopback benchmark (experiments/harness/call_cpu.py): the pieces that need no cluster. A run on an
emulated cluster is ``burst-bench cluster calls <profile>`` (root; measured in docs/findings.md)."""
from __future__ import annotations

import json

import pytest

from experiments.cli import run_cli
from experiments.cluster import __main__ as cli
from experiments.cluster.emulator import call_probe as P
from experiments.harness.call_cpu import row
from experiments.perfmodel.emulated import host_cost


def test_cases_parse_and_bad_ones_name_the_rule():
    assert P.parse_cases("decode:tp:64:4,burst:64,usp:128:balanced") == [
        P.Case("decode:tp", 64, batch=4), P.Case("burst", 64), P.Case("usp", 128, layout="balanced")]
    assert [c.name for c in P.CASES][:2] == ["decode:cp_all_gather:64:1", "decode:cp_all_gather:64:4"]
    masked = P.parse_cases("ring:64:zigzag:window:0:0")
    assert masked == [P.Case("ring", 64, mask="window:0:0")] and masked[0].name == "ring:64:zigzag:window:0:0"
    for bad, words in (("decode:ring:64:1", "decode:<row>"), ("decode:tp:64:0", "positive batch"),
                       ("decode:tp:64", "decode:<row>"), ("nosuch:64", "registry method"),
                       ("burst:64:diagonal", "layout 'diagonal'"), ("burst:x", "registry method"),
                       ("burst:64:zigzag:window:1", "window:LEFT:RIGHT")):
        with pytest.raises(ValueError, match=words):
            P.parse_cases(bad)


def test_tokens_must_split_over_the_world():
    P.check_shape([P.Case("burst", 16), P.Case("decode:tp", 8)], 2, 4)
    for case, words in ((P.Case("burst", 24), "multiple of 2 x world size \\(16\\)"),
                        (P.Case("decode:tp", 4), ">= world size \\(8\\)")):
        with pytest.raises(ValueError, match=words):
            P.check_shape([case], 2, 4)


def test_rows_are_call_cpu_rows_the_validation_reads(tmp_path):
    """The probe's rows: each rank's median CPU, their median and the slowest rank's wall per call, in the schema
    ``host_cost`` finds a decode step's row by (row, world and node size, dtype, batch)."""
    c = P.Case("decode:tp", 64, batch=4)
    meta = {"method": "decode:tp", "mode": "decode", "seqlen": 64, "batch": 4, "world_size": 2, "node_size": 2,
            "heads": 8, "kv_heads": 2, "head_dim": 64, "dtype": "float32", "causal": True, "layout": "zigzag",
            "steps_per_sample": 16}
    ranks = [{c.name: {"meta": meta, "cpu": [0.001, 0.002, 0.003 + r], "wall": [0.01, 0.02 + r, 0.03]}}
             for r in (0.0, 0.05)]
    (out,) = P.summarize(ranks, [c])
    assert out["cpu_s_per_rank"] == [0.002, 0.002] and out["cpu_s_median"] == 0.002
    assert out["wall_s_median"] == pytest.approx(0.03) and out["where"] == "emulated" and out["calls"] == 3
    assert out["cpu_samples_s_per_rank"][1] == pytest.approx([0.001, 0.002, 0.053]) and out["wall_samples_s"][1] == 0.07
    assert "decode:tp" in P.table([out])
    (tmp_path / host_cost.CALL_CPU_FILE).write_text(json.dumps({"probe": "calls", "rows": [out]}))
    small = host_cost.decode_small_case(host_cost.load_call_cpu(tmp_path), "tp", world_size=2, node_size=2,
                                        dtype="float32", batch=4)
    assert small.cpu_s == 0.002 and small.shape.kv_heads == 2 and small.shape.batch == 4
    assert row(meta, [r[c.name] for r in ranks]) == {k: v for k, v in out.items() if k != "where"}


def test_probes_at_two_world_sizes_fill_one_file_each_row_with_its_provenance(tmp_path):
    out = tmp_path / "call_cpu.json"
    g4 = {"method": "decode:tp", "seqlen": 64, "world_size": 4, "node_size": 4, "batch": 1, "cpu_s_median": 1.0}
    g8 = {**g4, "world_size": 8}
    P.write(out, [g4, g8], {"git": "a", "cluster": {"nodes": 1}})
    P.write(out, [{**g8, "cpu_s_median": 2.0}], {"git": "b", "cluster": {"nodes": 2}})
    rows = json.loads(out.read_text())["rows"]
    assert sorted((r["world_size"], r["cpu_s_median"], r["provenance"]["git"]) for r in rows) == [
        (4, 1.0, "a"), (8, 2.0, "b")]


def test_probe_world_size_is_refused_before_any_bring_up(monkeypatch, capsys):
    monkeypatch.setattr(cli, "_launch_probe", lambda *a, **k: pytest.fail("brought a cluster up"))
    for world in ("6", "9", "0"):
        assert run_cli(cli.main, ["calls", "a800_ib_emu_2x4", "--world-size", world]) == 2
        assert f"world_size={world} must be at most" in capsys.readouterr().err
    assert run_cli(cli.main, ["calls", "a800_ib_emu_2x4", "--world-size", "4", "--cases", "decode:tp:2:1"]) == 2
    assert ">= world size (4)" in capsys.readouterr().err


def _decode_measure() -> dict:
    from experiments.harness.call_cpu import measure
    meta, mine = measure("decode:tp", 8, node_size=2, calls=2)
    return {"steps": meta["steps_per_sample"], "cpu": len(mine["cpu"]), "wall": len(mine["wall"])}


def test_decode_steps_run_back_to_back_as_the_inference_benchmark_times_them(pools):
    """A decode sample is as many steps as ``timing.autorange`` gives the benchmark's 0.2 s (the same on every
    rank), and each sample's CPU is per step."""
    got = pools.run(2, _decode_measure, timeout=120)
    assert got[0] == got[1] and got[0]["cpu"] == got[0]["wall"] == 2 and got[0]["steps"] > 1
