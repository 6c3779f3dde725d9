"""``burst-bench``, the suite's one command (experiments/burst_bench.py): its help lists every subcommand,
each subcommand is its library entry point with that entry point's own options, and a user's mistake
through a subcommand is still ``error: <message>`` and exit status 2 (``--debug``: the traceback)."""
from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from experiments import burst_bench as B
from experiments.cli import run_cli

ROOT = Path(__file__).resolve().parent.parent
# the seven the experiments' middle asks for, and migrate (older results into the record schema 3)
SUBCOMMANDS = ("run", "plots", "model", "report", "cluster", "gpu-check", "migrate", "bench")


def _bb(capsys, *args: str) -> tuple[int, str, str]:
    """``burst-bench <args>`` in this process: (exit status, stdout, stderr)."""
    try:
        rc = run_cli(B.main, list(args))
    except SystemExit as e:            # --help and argparse's own errors exit through argparse
        rc = e.code
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_the_console_script_is_declared():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"burst-bench": "experiments.burst_bench:cli"}


def test_help_lists_every_subcommand_with_a_line_each(capsys):
    rc, out, _ = _bb(capsys, "--help")
    assert rc == 0
    assert tuple(c.name for c in B.SUBCOMMANDS) == SUBCOMMANDS
    listed = out[out.index("<subcommand>\n"):]
    for c in B.SUBCOMMANDS:
        assert f"    {c.name} " in listed and c.summary.split()[0] in listed, c.name


def test_help_needs_no_torch():
    """The listing imports no subcommand (each brings torch): a fresh interpreter answers --help without it."""
    code = ("import sys; from experiments.burst_bench import cli; sys.argv = ['burst-bench', '--help']\n"
            "try: cli()\nexcept SystemExit: pass\nassert 'torch' not in sys.modules, 'torch imported'")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "gpu-check" in out.stdout


@pytest.mark.parametrize("sub, option", [("run", "--dry-run"), ("plots", "--results"), ("model", "--hardware"),
                                         ("report", "--machine"), ("cluster", "overlap"), ("gpu-check", "--repeats"),
                                         ("bench", "checkpoint")])
def test_a_subcommand_shows_its_own_options(capsys, sub, option):
    rc, out, _ = _bb(capsys, sub, "--help")
    assert rc == 0 and option in out
    # its usage line names the command the user typed, not the module form
    assert out.startswith(f"usage: burst-bench {sub} ")


def test_a_benchmark_and_the_module_form_name_their_own_command(capsys):
    rc, out, _ = _bb(capsys, "bench", "checkpoint", "--help")
    assert rc == 0 and out.startswith("usage: burst-bench bench checkpoint ")
    from experiments import plots
    with pytest.raises(SystemExit):
        plots.main(["--help"])        # the module form, outside burst-bench, keeps its own name
    assert capsys.readouterr().out.startswith("usage: python -m experiments.plots ")


def test_bench_finds_the_installed_benchmarks_and_passes_their_options(capsys):
    # found, not listed: a new experiments/benches/<name>_bench.py joins without an edit
    assert {"checkpoint": "experiments.benches.checkpoint_bench",
            "loss": "experiments.benches.loss_bench"}.items() <= B.benches().items()
    rc, out, _ = _bb(capsys, "bench", "loss", "--help")
    assert rc == 0 and "--vocab" in out


@pytest.mark.parametrize("args, words", [
    (("run", "no_such_spec", "--dry-run"), ["'no_such_spec' is neither a spec file"]),
    (("model", "no_such_spec", "--no-plots"), ["'no_such_spec' is neither a spec file"]),
    (("report", "--results", "{tmp}/missing"), ["no such folder"]),
    (("cluster", "overlap", "a800_ib_emu_3x2", "--cases", "ring:256"), ["case='ring:256'"]),
    (("cluster", "overlap", "a800_ib_emu_3x2", "--cases", "ring:64:8", "--repeats", "0"), ["repeats=0"]),
    (("cluster", "selftest", "no_such_profile"), ["no_such_profile"]),
], ids=["run", "model", "report", "overlap-case", "overlap-repeats", "selftest"])
def test_a_user_error_through_a_subcommand_is_one_line_and_exit_2(capsys, tmp_path, args, words):
    rc, _, err = _bb(capsys, *(a.format(tmp=tmp_path) for a in args))
    assert rc == 2
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("error: ")
    for w in words:
        assert w in err


def test_unknown_subcommand_and_none_are_argparse_errors(capsys):
    for args in (("nope",), ()):
        rc, _, err = _bb(capsys, *args)
        assert rc == 2 and "burst-bench: error:" in err


def test_debug_still_shows_the_traceback():
    with pytest.raises(ValueError, match="no_such_spec"):
        run_cli(B.main, ["run", "no_such_spec", "--dry-run", "--debug"])
