"""Read MagiAttention's distributed-benchmark bar charts (experiments/paper/magiattention_cp_h100_readings.yaml):
bar tops in pixels -> TFLOP/s per GPU. A transcription tool, run by hand on the figures fetched from their
repository; nothing imports it.

    git -C <MagiAttention> show 2c64135:assets/magi_attn/exp/distributed/h100/causal_mask/fwd/flops_report.png >c.png
    python experiments/paper/read_bar_chart.py c.png=100        # <figure>=<the y axis' tick step, read by eye>

Calibration: the grey grid lines (RGB 234) in a column between two groups are equally spaced at the tick step;
0 is the member of that progression nearest the bottom spine (drawn over it); a least-squares line maps a row to
a value. Bars: 32 runs of one colour wider than 150 px just above the axis, 8 per group (8, 16, 32, 64 GPUs) in
the legend's order. A bar's top is the highest row where more than half of its width (5%..95%) has its colour,
going up from the axis until 20 consecutive rows are white across it (lines crossing a bar are not white).
"""
from __future__ import annotations

import json
import sys

import numpy as np
from PIL import Image

METHODS = ("ulysses", "ring_p2p", "ring_allgather", "usp", "loongtrain", "hybrid_dcp", "magi_attn-a2av",
           "magi_attn-native")
GPUS = (8, 16, 32, 64)
GRID, FRAME, WHITE = 234, 204, 245


def _runs(line: np.ndarray, tol: int = 30) -> list[tuple[int, int, tuple[int, ...]]]:
    """(first x, last x, colour) of each run of one colour along a row."""
    out, start = [], 0
    for i in range(1, len(line) + 1):
        if i == len(line) or np.abs(line[i] - line[start]).sum() > tol:
            out.append((start, i - 1, tuple(int(c) for c in line[start])))
            start = i
    return out


def _centres(rows: list[int]) -> list[float]:
    """The centre row of each band of adjacent rows."""
    bands = [[rows[0]]]
    for y in rows[1:]:
        (bands[-1].append(y) if y - bands[-1][-1] <= 2 else bands.append([y]))
    return [sum(b) / len(b) for b in bands]


def _calibration(im: np.ndarray, step: float) -> tuple[float, float, float, float]:
    """(a, b, residual, axis row): value = a * row + b."""
    h = im.shape[0]
    col = im[:, 1000]
    spine = [y for y in range(h // 2, h) if np.abs(col[y] - FRAME).sum() < 20]
    y0 = (min(spine[-20:]) + max(spine)) / 2
    lines = sorted(_centres([y for y in range(200, int(y0) + 5) if np.abs(im[y, 3000] - GRID).max() <= 4]),
                   reverse=True)
    sp = float(np.median(np.diff(sorted(lines))))
    zero = lines[0] + round((y0 - lines[0]) / sp) * sp
    pts = [(y, round((zero - y) / sp) * step) for y in lines] + [(zero, 0.0)]
    a, b = np.polyfit([p[0] for p in pts], [p[1] for p in pts], 1)
    return a, b, max(abs(a * y + b - v) for y, v in pts), y0


def _top(im: np.ndarray, x0: int, x1: int, colour, start: int) -> int:
    band = im[:, x0 + (x1 - x0) // 20: x1 - (x1 - x0) // 20]
    frac = (np.abs(band - np.array(colour)).sum(axis=2) < 30).mean(axis=1)
    white = (band.min(axis=2) >= WHITE).mean(axis=1)
    top, blank = start, 0
    for y in range(start, 0, -1):
        if frac[y] > 0.5:
            top = y
        blank = blank + 1 if white[y] > 0.9 else 0
        if blank >= 20:
            break
    return top


def read(path: str, step: float) -> dict:
    """{method: {gpus: value}} of one figure, with the calibration's scale and residual."""
    im = np.asarray(Image.open(path).convert("RGB")).astype(int)
    a, b, resid, y0 = _calibration(im, step)
    start = int(y0) - 40
    bars = [r for r in _runs(im[start]) if r[1] - r[0] > 150 and r[2] != (255, 255, 255)]
    if len(bars) != len(METHODS) * len(GPUS):
        raise ValueError(f"{path}: found {len(bars)} bars, expected {len(METHODS) * len(GPUS)}")
    out: dict = {"px_per_unit": round(1 / abs(a), 3), "grid_fit_residual": round(resid, 3), "values": {}}
    for i, (x0, x1, colour) in enumerate(bars):
        val = a * _top(im, x0, x1, colour, start) + b
        out["values"].setdefault(METHODS[i % len(METHODS)], {})[GPUS[i // len(METHODS)]] = round(val, 1)
    return out


if __name__ == "__main__":
    print(json.dumps({arg.split("=")[0]: read(arg.split("=")[0], float(arg.split("=")[1])) for arg in sys.argv[1:]},
                     indent=1))
