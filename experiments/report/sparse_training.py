"""BurstEngine's sparse training (docs/papers.md §3 "Sparse training", issue 37 item 5): training tokens/s
per GPU at 256K tokens on one node of 8 A800, dense causal against a sliding window of 4096 keys, and for
14B the window on the balanced, striped (the authors' own) and contiguous (mask-based, unbalanced) layouts.

One table modelled at the paper's size (``model_burstengine_sparse_train_*`` under results/modelled/), one
per measured run of its CPU mirror (``cpu_model_burstengine_sparse_train``), each row with the layout's
work max/mean over ranks under its mask. The paper's values are not transcribed (no source we can cite
gives them: docs/papers.md §3), so their column says so instead of a number.
"""
from __future__ import annotations

from typing import Callable

from .context import Context
from .doc import Heading, Link, Para, Table
from .evidence import Experiment, regime

MODELLED = ("model_burstengine_sparse_train_*",)
MEASURED = ("cpu_model_burstengine_sparse_train",)
NOT_TRANSCRIBED = "not transcribed"
# the paper's size and its rows, in its order (models by size, then causal before the window's layouts)
MODEL_ORDER = {"llama2_7b": 0, "llama2_13b": 1, "burstengine_14b": 2}
LAYOUT_ORDER = {"balanced": 0, "striped": 1, "contiguous": 2}
LAYOUT_NAMES = {"balanced": "balanced", "striped": "striped (the authors' balanced)",
                "contiguous": "contiguous (mask-based, unbalanced)"}


def _mask(r: dict) -> str:
    return r.get("mask") or "causal"


def _key(r: dict) -> tuple:
    return (MODEL_ORDER.get(r.get("model_config") or r.get("model"), 9), r.get("model_config") or r.get("model"),
            _mask(r) != "causal", LAYOUT_ORDER.get(r.get("layout"), 9), _mask(r))


def per_gpu(r: dict, t: float | None) -> float | None:
    """Tokens/s per GPU of a step of ``t`` seconds (the papers' quantity): B N / t / G."""
    return r["batch"] * r["seqlen"] / t / r["world_size"] if t else None


def _cell(v: float | None, lo: float | None = None, hi: float | None = None) -> str:
    if v is None:
        return "—"
    return f"{v:,.0f}" + (f" [{lo:,.0f}, {hi:,.0f}]" if lo is not None and hi is not None else "")


def _status(r: dict) -> str | None:
    return None if r.get("status") == "ok" else str(r.get("status", "?")).upper()


def _imbalance(r: dict) -> str:
    w = r.get("work_imbalance_rows")
    return "—" if w is None else f"{w:.3f}"


def modelled_table(records) -> Table:
    """Rows (model, mask, layout): modelled tokens/s per GPU, its ratio to causal on the balanced layout of the
    same model, MFU, the layout's work max/mean, and the paper's value (not transcribed)."""
    recs = sorted(records, key=_key)
    causal = {(r.get("model_config") or r.get("model")): r for r in recs
              if _mask(r) == "causal" and r.get("layout") == "balanced" and r.get("status") == "ok"}
    rows = []
    for r in recs:
        model = r.get("model_config") or r.get("model")
        v = per_gpu(r, r.get("time_median_s"))
        base = causal.get(model)
        ratio = v / per_gpu(base, base["time_median_s"]) if v and base is not None else None
        mfu = r.get("mfu")
        rows.append((model, _mask(r), LAYOUT_NAMES.get(r.get("layout"), r.get("layout")), _status(r) or _cell(v),
                     "—" if ratio is None else f"x{ratio:.2f}", "—" if mfu is None else f"{mfu:.0%}",
                     _imbalance(r), NOT_TRANSCRIBED))
    return Table(("model", "mask", "layout", "tokens/s per GPU (modelled)", "over causal, balanced", "MFU",
                  "work max/mean", "paper"), tuple(rows))


def measured_table(records) -> Table:
    """Rows (mask, layout) of a measured mirror: tokens/s per rank with the 95% interval of the median step
    (as tokens/s: the slow end of the step's interval is the low end), and the layout's work max/mean."""
    rows = []
    for r in sorted(records, key=_key):
        t, lo, hi = r.get("time_median_s"), r.get("time_ci_lo_s"), r.get("time_ci_hi_s")
        v = per_gpu(r, t)
        cell = _status(r) or _cell(v, per_gpu(r, hi), per_gpu(r, lo))
        layout = LAYOUT_NAMES.get(r.get("layout"), r.get("layout"))
        rows.append((r.get("model_config") or r.get("model"), _mask(r), layout, f"N={r['seqlen']}, G={r['world_size']}",
                     cell, "—" if t is None else f"{t:.3f}", _imbalance(r)))
    return Table(("model", "mask", "layout", "size", "tokens/s per rank [95%]", "step (s, median)", "work max/mean"),
                 tuple(rows))


def sparse_blocks(modelled: list[Experiment], measured: list[Experiment], href: Callable[[object], str]) -> list:
    """The section's blocks from the experiments found (``href``: a link from the page to a folder)."""
    out = [Para(("The paper's values: " + NOT_TRANSCRIBED + " (the setting is described in docs/papers.md §3; "
                 "no source we can cite gives its numbers, so nothing here is compared with them).",))]
    if modelled:
        recs = [r for e in modelled for r in e.records]
        links = tuple(x for e in modelled for x in (Link(e.rel, href(e.path)), f"({regime(e.records)})"))
        out += [Para(("Modelled at the paper's size (256K tokens, 8 A800, MODELLED, not measured):", *links)),
                modelled_table(recs)]
    else:
        out.append(Para((f"Modelled: no records of {', '.join(MODELLED)} under results/modelled/.",)))
    if not measured:
        out.append(Para((f"Measured: no records of {', '.join(MEASURED)} in any measured results folder.",)))
    for e in measured:
        out += [Para(("Measured (the CPU mirror):", Link(e.rel, href(e.path)), f"— regime: {regime(e.records)}.")),
                measured_table(e.records)]
    return out


def sparse_training_section(ctx: Context) -> list:
    return [Heading(2, "BurstEngine: sparse training (causal vs sliding window, 256K, 8 A800)", "sparse-training",
                    nav="sparse training"),
            *sparse_blocks(ctx.modelled(MODELLED), ctx.measured(MEASURED), ctx.href)]
