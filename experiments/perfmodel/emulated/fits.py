"""Least-squares fits with no term below 0, for the emulated cluster's probes (``excess.fit_excess``,
``message.fit_messages``): the probes' noise can make an unconstrained intercept or slope negative, which
no transfer costs."""
from __future__ import annotations

import itertools
import statistics

import torch


def line(pts: list[tuple[float, float]], *, one_size: str) -> tuple[float, float]:
    """Least squares ``y = a + k x``, neither term below 0 (a < 0: through the origin instead). Points at one
    ``x`` only fix one term: ``one_size="intercept"`` puts all of ``y`` in ``a`` (a flat line), ``"slope"`` in
    ``k`` (a line through the origin)."""
    if len({x for x, _ in pts}) < 2:
        if one_size == "intercept":
            return max(0.0, statistics.fmean(y for _, y in pts)), 0.0
        return 0.0, max(0.0, sum(y for _, y in pts) / sum(x for x, _ in pts))
    mx, my = statistics.fmean(x for x, _ in pts), statistics.fmean(y for _, y in pts)
    k = max(0.0, sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts))
    a = my - k * mx
    if a < 0:
        a, k = 0.0, max(0.0, sum(x * y for x, y in pts) / sum(x * x for x, _ in pts))
    return a, k


def plane(pts: list[tuple[float, float, float]]) -> tuple[float, float, float]:
    """Least squares ``y = a + k b + c x`` over points ``(b, x, y)`` with no term below 0: of the fits on each
    subset of the three terms, the feasible one (every term >= 0) of least squared error (non-negative least
    squares, by enumeration); (0, 0, 0) where none is."""
    cols = (lambda b, x: 1.0, lambda b, x: b, lambda b, x: x)
    y = torch.tensor([[v] for _, _, v in pts], dtype=torch.float64)
    best: tuple[float, tuple] | None = None
    for use in itertools.product((False, True), repeat=3):
        idx = [i for i in range(3) if use[i]]
        if not idx:
            continue
        a = torch.tensor([[cols[i](b, x) for i in idx] for b, x, _ in pts], dtype=torch.float64)
        coef = torch.linalg.lstsq(a, y).solution[:, 0].tolist()
        if any(c < 0 for c in coef):
            continue
        full = [0.0, 0.0, 0.0]
        for i, c in zip(idx, coef):
            full[i] = c
        sse = sum((v - full[0] - full[1] * b - full[2] * x) ** 2 for b, x, v in pts)
        if best is None or sse < best[0]:
            best = (sse, tuple(full))
    return best[1] if best else (0.0, 0.0, 0.0)
