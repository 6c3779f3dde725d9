"""Test cases taken from the registry (``baselines.registry.methods_with``).

A test about every method of a capability builds its cases from the registry's answer, so a method
added there is covered without an edit. A method that cannot run on this machine (``available()``
false: a peer package or CUDA missing) stays in a parametrised list as a skipped case with that
reason, rather than dropping out silently.
"""
from __future__ import annotations

import pytest

from baselines.registry import METHODS


def unavailable_reason(name: str) -> str | None:
    """Why registry method ``name`` cannot run here, else None (also for a name a test gives a case of
    its own, such as test_defects' "burst_lse")."""
    m = METHODS.get(name)
    if m is None or m.available():
        return None
    return f"method {name!r} is unavailable here (needs {m.external or 'an optional package'})"


def method_params(cases: list[tuple]) -> list:
    """``cases`` (tuples whose first item is a method name) as pytest params, those of a method that
    cannot run here marked skip with the reason."""
    out = []
    for case in cases:
        reason = unavailable_reason(case[0])
        out.append(pytest.param(*case, marks=pytest.mark.skip(reason=reason)) if reason else pytest.param(*case))
    return out


def write_rows(path, rows: list[dict]) -> None:
    """Synthetic result rows (record fields and shape keys side by side, as tests build them) written
    through the suite's one writer: the shape keys become the case's config, the provenance a test does
    not care about gets placeholders."""
    from experiments.harness import record

    for r in rows:
        row = {"experiment": "t", "case_id": r.get("method", "m"), "method": "m", "level": "op", "mode": "fwd_bwd",
               "timestamp": "2026-01-01T00:00:00", "git": {}, "versions": {}, "hardware": {}, "machine": "test",
               **r}
        cfg = {k: v for k, v in row.items() if k not in record.FIELDS and k not in ("status", "reason", "schema")}
        rec = record.Record.from_row({"status": "ok", **{k: v for k, v in row.items() if k not in cfg}})
        rec["config"] = {**cfg, **(row.get("config") or {})}
        record.write(path, rec)


def deepspeed_comm_without_shm_op() -> None:
    """On this rank, DeepSpeed's comm backend starts without its shared-memory op. DeepSpeed 0.19.8's
    ``TorchBackend`` JIT-compiles that C++ op (csrc/cpu/comm/shm*.cpp, about 90 CPU-seconds: 35-45 s of a
    fresh checkout's suite on 2 cores) when its comm starts, and uses it only in ``inference_all_reduce``;
    ``DistributedAttention``'s all-to-alls go through torch.distributed with or without it
    (deepspeed/comm/torch.py). Call it in a rank before its first DeepSpeed call."""
    import importlib

    # by module path: the package attribute deepspeed.comm.torch is torch itself (its ``from .comm import *``)
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
