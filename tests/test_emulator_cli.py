"""The emulated cluster's self-test as a command (``burst-bench cluster selftest``): a self-test that
cannot run or misses its tolerance answers one ``error:`` line and exit status 2, like every tool of the
emulator; ``--debug`` shows the traceback. No namespaces needed: the cluster and the measurement are
stand-ins (the real ones: tests/test_emulator.py). The overlap probe's: tests/test_overlap_probe.py."""
from __future__ import annotations

import contextlib
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from experiments.cli import ToolFailed, run_cli
from experiments.cluster import __main__ as cluster_cli

RATE = 4e6


def _cluster(emulated: bool):
    link = SimpleNamespace(bytes_s=RATE)
    return SimpleNamespace(emulated=emulated, fallback=None if emulated else "no veth here",
                           topo=SimpleNamespace(nodes=1, ranks_per_node=2),
                           scaling=SimpleNamespace(links={"intra": link}))


def _selftest_measuring(monkeypatch, measured: float | None):
    """A one-node cluster whose intra flows run at ``measured`` bytes/s (None: namespaces are forbidden)."""
    cl = _cluster(measured is not None)
    monkeypatch.setattr(cluster_cli, "EmulatedCluster", lambda prof: contextlib.nullcontext(cl))
    monkeypatch.setattr(cluster_cli, "show", lambda cl=None: None)
    monkeypatch.setattr(cluster_cli, "_message_lines", lambda cl: [])
    monkeypatch.setattr(cluster_cli.selftest, "measure",
                        lambda topo, seconds: {"intra": {"bytes_per_s": measured,
                                                         "flows": [{"bytes_per_s": measured}]}})


def test_a_selftest_within_its_tolerance_passes(monkeypatch, capsys):
    _selftest_measuring(monkeypatch, RATE * (1 + cluster_cli.SELFTEST_TOLERANCE / 2))
    assert run_cli(cluster_cli.main, ["selftest", "a800_ib_emu_3x2"]) == 0
    assert "worst deviation" in capsys.readouterr().out


@pytest.mark.parametrize("measured, words", [(RATE * 0.5, "worst deviation 50.0%"), (None, "no veth here")],
                         ids=["off-tolerance", "no-namespaces"])
def test_a_failed_selftest_is_one_error_line_and_exit_2(monkeypatch, capsys, measured, words):
    _selftest_measuring(monkeypatch, measured)
    assert run_cli(cluster_cli.main, ["selftest", "a800_ib_emu_3x2"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    (line,) = [ln for ln in err.splitlines() if ln.strip()]
    assert line.startswith("error: ") and words in line


def test_a_failed_selftest_shows_its_traceback_with_debug(monkeypatch):
    _selftest_measuring(monkeypatch, RATE * 0.5)
    with pytest.raises(ToolFailed, match="tolerance"):
        run_cli(cluster_cli.main, ["selftest", "a800_ib_emu_3x2", "--debug"])


def _decode_root(tmp_path):
    """A copy of the committed 2 x 4 decode run (records, kernel table, probes): nothing is timed again."""
    src = Path(__file__).resolve().parents[1] / "results" / "reference" / "cpu2-amd-epyc+a800_ib_emu_2x4"
    root = tmp_path / "root"
    shutil.copytree(src / "cpu_decode_emulated_2x4", root / "cpu_decode_emulated_2x4")
    for f in ("overlap_probe.json", "message_probe.json", "call_cpu.json"):
        shutil.copy(src / f, root / f)
    (root / "cpu_decode_emulated_2x4" / "inference_validation.json").unlink()
    return root


def test_report_of_an_inference_run_is_the_inference_models(tmp_path, capsys):
    """`cluster report` on decode records prints validate_decode's table (it once failed on mode 'decode');
    --write writes the validation file, without it nothing is written; --json is refused as a user's error."""
    root = _decode_root(tmp_path)
    assert run_cli(cluster_cli.main, ["report", "cpu_decode_emulated_2x4", "--results", str(root), "--model"]) == 0
    out = capsys.readouterr().out
    assert "inference model" in out and "decode  8   1   131072 tp" in out
    assert not (root / "cpu_decode_emulated_2x4" / "inference_validation.json").exists()
    assert run_cli(cluster_cli.main, ["report", "cpu_decode_emulated_2x4", "--results", str(root), "--write"]) == 0
    assert (root / "cpu_decode_emulated_2x4" / "inference_validation.json").exists()
    assert run_cli(cluster_cli.main, ["report", "cpu_decode_emulated_2x4", "--results", str(root), "--json"]) == 2
    assert "is an inference experiment" in capsys.readouterr().err
