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
