"""The figure of a kernel sweep (``experiments/harness/kernel_sweep.py``): TFLOP/s vs sequence length,
one line per kernel, panels by mode x mask, the device in the title, the suite's provenance footer."""
from __future__ import annotations

import textwrap
from pathlib import Path

import pandas as pd

from burst_impl.kernels import BACKENDS

from .figstyle import PALETTE, legend_outside, save_figure  # first: it selects the Agg backend
from .figure_parts import footer
from .harness.axes import human
from .harness.kernel_sweep import MODES, SDPA_KERNELS
import matplotlib.pyplot as plt  # after figstyle


def draw(records: list[dict], out: Path, *, device_name: str, setup: str | None = None) -> Path | None:
    """TFLOP/s vs N, one line per kernel, panels by mode x mask; the title names the device.
    ``setup``: the problem's line of the title (default: B, Z, d and dtype of the first record)."""
    ok = [r for r in records if r["status"] == "ok"]
    if not ok:
        return None
    modes = [m for m in MODES if any(r["mode"] == m for r in ok)]
    masks = [c for c in (True, False) if any(r["causal"] == c for r in ok)]
    kernels = list(dict.fromkeys(r["method"] for r in records))
    palette = [*BACKENDS, *SDPA_KERNELS] + [k for k in kernels if k not in BACKENDS and k not in SDPA_KERNELS]
    fig, axes = plt.subplots(len(modes), len(masks), figsize=(6.0 * len(masks), 4.2 * len(modes) + 0.8),
                             squeeze=False)
    for ax, (mode, causal) in zip(axes.flat, [(m, c) for m in modes for c in masks]):
        for kernel in kernels:
            pts = sorted((r["seqlen"], r["tflops_total"], r["tflops_p10"], r["tflops_p90"]) for r in ok
                         if r["method"] == kernel and r["mode"] == mode and r["causal"] == causal)
            if not pts:
                continue
            x, y, lo, hi = zip(*pts)
            ax.errorbar(x, y, yerr=[[a - b for a, b in zip(y, lo)], [b - a for a, b in zip(y, hi)]], marker="o",
                        capsize=3, label=kernel, color=PALETTE[palette.index(kernel) % len(PALETTE)],
                        linestyle="--" if kernel in SDPA_KERNELS else "-")
        ax.set_xscale("log", base=2)
        ns = sorted({r["seqlen"] for r in ok})
        ax.set_xticks(ns)
        ax.set_xticklabels([human(n) for n in ns], fontsize=8)
        ax.minorticks_off()
        ax.set_ylim(bottom=0)
        ax.set_xlabel("sequence length N (tokens, one device)")
        ax.set_ylabel("TFLOP/s (median; bars p10-p90)")
        ax.set_title(f"{'forward' if mode == 'forward' else 'forward+backward'}, {'causal' if causal else 'full'}",
                     fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
    r0 = ok[0]
    failed = sorted({f"{r['method']} N={r['seqlen']} {r['status']}" for r in records
                     if r["status"] in ("oom", "failed")})
    skipped = sorted({f"{r['method']}: {r['reason'].split(';')[0][:110]}" for r in records if r["status"] == "skipped"})
    setup = setup or f"B={r0['batch']}, Z={r0['heads']}, d={r0['head_dim']}, {r0['dtype']}"
    fig.suptitle(f"Local attention kernels on {device_name}: TFLOP/s vs sequence length (measured "
                 f"{str(r0['timestamp'])[:10]})\n{setup}; "
                 "FLOPs 4BN²Zd, halved when causal, x3.5 forward+backward", fontsize=10)
    notes = [f"not run: {'; '.join(skipped)}"] if skipped else []
    notes += [f"OOM/failed: {', '.join(failed)}"] if failed else []
    # one legend for every panel (a kernel may be missing from some), beside the first row
    merged = {lab: h for ax in axes.flat for h, lab in zip(*ax.get_legend_handles_labels())}
    legend_outside(axes[0, -1], list(merged.values()), list(merged), title="kernel")
    fig.tight_layout()
    if notes:
        fig.text(0.5, 0.0, "\n".join(textwrap.fill(n, 170) for n in notes), ha="center", va="top", fontsize=7,
                 color="dimgray")
    footer(fig, pd.DataFrame(ok))
    return save_figure(fig, out)
