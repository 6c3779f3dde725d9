"""A user's mistake on any command line of the suite is one line, ``error: <message>``, and exit status 2;
``--debug`` shows the traceback."""
from __future__ import annotations

import importlib
from pathlib import Path

import pytest

from experiments.cli import run_cli

ROOT = Path(__file__).resolve().parent.parent


def _run(module: str, *args: str) -> int:
    """The command line ``python -m <module> <args>`` in this process (what its __main__ guard runs)."""
    mod = importlib.import_module(module if module in ("experiments.run", "experiments.plots")
                                  else f"{module}.__main__")
    return run_cli(mod.main, list(args))


def _bad_spec(tmp_path: Path) -> Path:
    text = (ROOT / "experiments" / "cpu" / "cpu_fig2_train.yaml").read_text()
    p = tmp_path / "bad_spec.yaml"
    p.write_text(text + "\nnot_a_key: 1\n")
    return p


@pytest.mark.parametrize("args, words", [
    (("experiments.run", "no_such_spec", "--dry-run"), ["'no_such_spec' is neither a spec file"]),
    (("experiments.run", "{bad}", "--dry-run"), ["bad_spec.yaml", "not_a_key", "unknown key"]),
    (("experiments.perfmodel", "no_such_spec", "--no-plots"), ["'no_such_spec' is neither a spec file"]),
    (("experiments.cluster", "report", "no_such_experiment", "--results", "{tmp}"), ["no_such_experiment"]),
    (("experiments.cluster", "report", "cpu_double_ring_emulated_2x4", "--plots", "{tmp}"), ["add --write"]),
    (("experiments.report", "--results", "{tmp}/missing"), ["no such folder"]),
    (("experiments.cluster", "overlap", "a800_ib_emu_2x4", "--cases", "ring:256"), ["case='ring:256'"]),
    (("experiments.cluster", "overlap", "a800_ib_emu_3x2", "--cases", "oneway:64:8", "--rates", "intra=1,inter=1",
      "--repeats", "0"), ["repeats=0"]),
    (("experiments.cluster", "selftest", "a100_32"), ["is not an emulated one"]),
    (("experiments.cluster", "down", "notours"), ["'notours' is not one of ours"]),
    (("experiments.plots", "no_such_experiment", "--results", "results/modelled", "--out", "{tmp}"),
     ["['no_such_experiment'] have no results"]),
], ids=["run-unknown-name", "run-unknown-key", "perfmodel", "cluster", "cluster-plots", "report", "overlap",
         "overlap-repeats", "selftest-not-emulated", "down-not-ours", "plots"])
def test_a_user_error_is_one_line_and_exit_2(tmp_path, capsys, args, words):
    args = tuple(a.format(bad=_bad_spec(tmp_path), tmp=tmp_path) for a in args)
    assert _run(*args) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("error: ")
    for w in words:
        assert w in err


def test_debug_shows_the_traceback():
    with pytest.raises(ValueError, match="no_such_spec"):
        _run("experiments.run", "no_such_spec", "--dry-run", "--debug")
