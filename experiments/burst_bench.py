"""burst-bench: the suite's one command; each subcommand is the library entry point of the same name.

    burst-bench run cpu                          # a spec or a preset (experiments/run.py)
    burst-bench plots                            # figures from the results files
    burst-bench model                            # the performance model's predictions
    burst-bench report                           # reports/index.html and index.md
    burst-bench cluster overlap a800_ib_emu_3x2  # the emulated cluster's tools
    burst-bench gpu-check                        # every CUDA kernel and peer once
    burst-bench bench loss --vocab 32768         # a standalone benchmark (experiments/benches/)
    burst-bench migrate results/<machine>        # older results into today's record schema
    burst-bench <subcommand> --help              # that subcommand's own options

Everything after the subcommand's name goes to it unchanged, so its options and its ``--help`` are its
own. A user's mistake is ``error: <message>`` and exit status 2, ``--debug`` anywhere shows the
traceback (``experiments/cli.py``). The ``python -m experiments.<module>`` forms stay, for scripts.
"""
from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import pkgutil
from dataclasses import dataclass
from typing import Callable

from .cli import DEBUG_FLAG, DEBUG_HELP, INVOKED_AS, run_cli

PROG = "burst-bench"
BENCH_PACKAGE = "experiments.benches"
BENCH_SUFFIX = "_bench"


@dataclass(frozen=True)
class Subcommand:
    name: str
    entry: str           # "module:function", called with the options; imported only when chosen (no torch for --help)
    summary: str


SUBCOMMANDS = (
    Subcommand("run", "experiments.run:main",
               "run an experiment spec or a preset, measured on this machine or a cluster"),
    Subcommand("plots", "experiments.plots:main", "draw every figure from the results files (runs nothing)"),
    Subcommand("model", "experiments.perfmodel.__main__:main",
               "the performance model's predictions of specs (runs nothing)"),
    Subcommand("report", "experiments.report.__main__:main",
               "build the reproduction report, reports/index.html and .md"),
    Subcommand("cluster", "experiments.cluster.__main__:main",
               "the emulated cluster: up, show, selftest, overlap, down, report, ratios"),
    Subcommand("gpu-check", "experiments.gpu_check:main", "every CUDA kernel and peer once, on this machine's GPUs"),
    Subcommand("migrate", "experiments.harness.migrate:main",
               "convert results written before the record schema 3 (once per results root)"),
    Subcommand("bench", f"{__name__}:bench_main",
               "a standalone benchmark of experiments/benches/ (`bench --help` lists them)"),
)


def benches() -> dict[str, str]:
    """``{name: module}`` of the installed benchmarks: ``experiments/benches/<name>_bench.py``, found there
    so that a new one needs no entry here."""
    pkg = importlib.import_module(BENCH_PACKAGE)
    return {m.name[:-len(BENCH_SUFFIX)]: f"{BENCH_PACKAGE}.{m.name}" for m in pkgutil.iter_modules(pkg.__path__)
            if m.name.endswith(BENCH_SUFFIX)}


def _summary(module: str) -> str:
    """The first line of ``module``'s docstring, read from its source: no import (torch) for a listing."""
    spec = importlib.util.find_spec(module)
    with open(spec.origin, encoding="utf-8") as f:
        doc = ast.get_docstring(ast.parse(f.read())) or ""
    return doc.split("\n", 1)[0]


def _entry(entry: str) -> Callable[[list[str]], int | None]:
    module, function = entry.split(":")
    return getattr(importlib.import_module(module), function)


def bench_main(argv: list[str]) -> int | None:
    """``burst-bench bench <name> [options]``: that benchmark's ``main`` with the options."""
    found = benches()
    ap = argparse.ArgumentParser(prog=f"{PROG} bench", description=bench_main.__doc__,
                                 epilog="benchmarks:\n" + "\n".join(f"  {n:<12} {_summary(m)}"
                                                                   for n, m in sorted(found.items())),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("name", choices=sorted(found), help="which benchmark; `<name> --help`: its options")
    ap.add_argument("options", nargs=argparse.REMAINDER, help="passed to the benchmark unchanged")
    args = ap.parse_args(argv[:1])
    token = INVOKED_AS.set(f"{PROG} bench {args.name}")
    try:
        return _entry(f"{found[args.name]}:main")(argv[1:])
    finally:
        INVOKED_AS.reset(token)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", metavar="<subcommand>", required=True)
    for c in SUBCOMMANDS:
        # its own parser answers --help and its options: this one only names it
        sub.add_parser(c.name, help=c.summary, add_help=False)
    ap.add_argument(DEBUG_FLAG, action="store_true", help=DEBUG_HELP)
    return ap


def main(argv: list[str]) -> int | None:
    """The subcommand ``argv[0]`` with the rest of ``argv``; this parser sees only what comes before it."""
    by_name = {c.name: c for c in SUBCOMMANDS}
    if not argv or argv[0] not in by_name:
        _parser().parse_args(argv[:1])            # --help; else argparse's own error naming the choices (exit 2)
        return 2
    token = INVOKED_AS.set(f"{PROG} {argv[0]}")
    try:
        return _entry(by_name[argv[0]].entry)(argv[1:])
    finally:
        INVOKED_AS.reset(token)


def cli() -> int:
    """The console script (``[project.scripts]``)."""
    return run_cli(main)


if __name__ == "__main__":
    raise SystemExit(cli())
