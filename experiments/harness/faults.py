"""Fault injection, for the harness's own tests: the two ways a test makes a rank fail on purpose.

* ``BURST_BENCH_FAULT=rank:<r>@start`` or ``rank:<r>@case:<k>``: that rank SIGKILLs itself once its
  process group is up, or inside the k-th case of the batch (1-based, run order). The executor passes it
  to the first launch of a batch only (``executor._first_launch_only``), so the relaunch runs clean.
* ``EXPERIMENTS_INJECT_FAULT="<case_id substring>:<oom|error|hang|kill>[:<rank>]"`` (``;``-separated):
  every case whose id holds the substring fails that way, on every launch.

The worker reads both (``worker.main``); the executor checks ``BURST_BENCH_FAULT`` before anything runs.
"""
from __future__ import annotations

import os
import re
import signal
import sys
import time
from dataclasses import dataclass

import torch

from .case import Case

FAULT_ENV = "BURST_BENCH_FAULT"
_FAULT_RE = re.compile(r"rank:(\d+)@(start|case:([1-9]\d*))")


@dataclass(frozen=True)
class Fault:
    """Kill ``rank`` at start-up (``case`` None) or inside the ``case``-th case of the batch (1-based)."""

    rank: int
    case: int | None = None


def parse_fault(text: str) -> Fault | None:
    if not text:
        return None
    m = _FAULT_RE.fullmatch(text.strip())
    if not m:
        raise ValueError(f"{FAULT_ENV}={text!r}: must be rank:<r>@start or rank:<r>@case:<k> "
                         "(r a rank, k >= 1 the case's position in the batch)")
    return Fault(rank=int(m.group(1)), case=int(m.group(3)) if m.group(3) else None)


def fault_from_env(environ=os.environ) -> Fault | None:
    return parse_fault(environ.get(FAULT_ENV, ""))


# kill: the rank ends itself with SIGKILL, as the kernel's OOM killer or an operator would.
INJECT_ENV = "EXPERIMENTS_INJECT_FAULT"


def sigkill_self() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def kill_at(fault: Fault | None, rank: int, position: int | None) -> None:
    """SIGKILL this rank if ``fault`` names it and this moment: start-up (``position`` None) or the
    ``position``-th case of the batch."""
    if fault is not None and fault.rank == rank and fault.case == position:
        sigkill_self()


def inject(case: Case, rank: int) -> None:
    spec = os.environ.get(INJECT_ENV, "")
    for item in filter(None, spec.split(";")):
        parts = item.split(":")
        what, kind = parts[0], parts[1]
        only = int(parts[2]) if len(parts) > 2 else None
        if what in case.case_id and (only is None or only == rank):
            if kind == "oom":
                raise torch.OutOfMemoryError("injected: CUDA out of memory. Tried to allocate 1 GiB")
            if kind == "hang":
                time.sleep(3600)
            if kind == "kill":
                sigkill_self()
            raise RuntimeError("injected failure")
