"""One answer to a user's mistake for every command line of the suite: ``error: <message>``, exit 2.

A wrong spec name, an unknown key, a missing results folder are the user's to fix, and a Python
traceback hides the (good) message that the loaders already write. ``--debug`` anywhere on the
command line re-raises instead, for whoever is debugging the suite itself. A tool that fails where its
message is the answer (``ToolFailed``: the emulated cluster's probes and self-tests) answers the same way.
A leaf module: it imports nothing of the suite, so every ``main`` can use it without an import cycle.
"""
from __future__ import annotations

import contextvars
import sys
from typing import Callable, Sequence

USER_ERROR_EXIT = 2          # argparse's own exit status for a bad command line: one status for both
DEBUG_FLAG = "--debug"
DEBUG_HELP = "show the Python traceback of an error instead of the one-line message"
# What the loaders and the runner raise for the user's input (spec, preset, profile, paths).
# (Not KeyError and the like: those are the suite's own bugs, and their traceback is the useful answer.)
USER_ERRORS = (ValueError, FileNotFoundError, NotADirectoryError)


class ToolFailed(RuntimeError):
    """A tool ran and failed where its message is the whole answer: the emulated cluster's ranks of a probe
    died (their log's tail is in the message), a self-test's flow broke, namespaces are forbidden here. The
    user reads the message and fixes the machine or the inputs; a traceback of the tool adds nothing."""


# The command line a user typed, for a parser's usage line: burst-bench sets "burst-bench <subcommand>" while
# it dispatches, so that `burst-bench run --help` does not tell the user to type `python -m experiments.run`.
INVOKED_AS: contextvars.ContextVar[str | None] = contextvars.ContextVar("invoked_as", default=None)


def prog(module_form: str) -> str:
    """The usage line's program: the subcommand burst-bench is running, else ``module_form``."""
    return INVOKED_AS.get() or module_form


def run_cli(main: Callable[[list[str]], int | None], argv: Sequence[str] | None = None) -> int:
    """``main(argv)`` with the user's errors as ``error: <message>`` on stderr and exit status 2."""
    args = list(sys.argv[1:] if argv is None else argv)
    debug = DEBUG_FLAG in args
    try:
        # stripped here so subcommand parsers need not know it; the mains list it for --help only
        return int(main([a for a in args if a != DEBUG_FLAG]) or 0)
    except (*USER_ERRORS, ToolFailed) as e:
        if debug:
            raise
        return _fail(e)
    except SystemExit as e:
        # raise SystemExit("message") is how the runner refuses; numeric exits (argparse) pass through
        if debug or e.code is None or isinstance(e.code, int):
            raise
        return _fail(e.code)


def _fail(message) -> int:
    print(f"error: {message}", file=sys.stderr)
    return USER_ERROR_EXIT
