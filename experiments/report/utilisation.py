"""The paper's implied utilisation next to the model's, cell by cell, for tables of whole-model times
(issue 35: where the gap between a paper's time and the model's lies).

    utilisation(t) = FLOPs / (t x GPUs x peak)

with the model's FLOPs of the cell (the record's ``flops``: ``burst_impl.model.flops``, the suite's one
formula, causal attention halved) and the peak of the record's accelerator for its dtype, so the paper's
and the model's share one numerator and one denominator: their ratio is the time ratio, and each says
where its time sits against the GPUs' peak. Beside them, the share of the model's time that is
communication on its critical path (``prediction.breakdown.critical_comm_s``; compute hidden behind it
is not on the path). Where the model is mostly compute, a paper cell below the model's utilisation
points at the kernels; where it is mostly communication, at the transport; a gap neither sourced
constant explains is something the paper's setup did that the model does not know.
"""
from __future__ import annotations

from dataclasses import dataclass

from .doc import Para, Table
from .model_error import Cell
from .paper import PaperTable
from .quantities import QUANTITIES


@dataclass(frozen=True)
class Utilisation:
    paper: float | None           # the paper's time's utilisation
    model: float | None           # the model's
    comm_share: float | None      # the model's critical-path communication / its time

    def text(self) -> str:
        if self.paper is None and self.model is None:
            return "—"
        tail = "" if self.comm_share is None else f" (comm {self.comm_share:.0%})"
        return f"paper {_pct(self.paper)} · model {_pct(self.model)}{tail}"


def _pct(v: float | None) -> str:
    return "—" if v is None else f"{v:.1%}"


def _peak(rec: dict) -> float | None:
    acc = (rec.get("hardware") or {}).get("accelerator") or {}
    tf = (acc.get("peak_tflops") or {}).get(rec.get("dtype"))
    return tf * 1e12 if tf else None


def utilisation(cell: Cell) -> Utilisation:
    """The paper's and the model's utilisation of one cell (None where either side has no time)."""
    rec = cell.record
    if rec is None or not rec.get("flops") or not rec.get("world_size") or _peak(rec) is None:
        return Utilisation(None, None, None)
    denom = rec["world_size"] * _peak(rec)

    def util(t):
        return rec["flops"] / (t * denom) if isinstance(t, (int, float)) and t > 0 else None

    paper = cell.paper.value if isinstance(cell.paper.value, (int, float)) else None
    t = rec.get("time_median_s") if rec.get("status") == "ok" else None
    comm = ((rec.get("prediction") or {}).get("breakdown") or {}).get("critical_comm_s")
    share = comm / t if t and comm is not None else None
    return Utilisation(util(paper), util(t), share)


def utilisation_blocks(t: PaperTable, cs: list[Cell]) -> list:
    """A paragraph and a table (rows x columns of the paper's table) of ``utilisation`` per cell; nothing for a
    table whose quantity is not a whole step's time."""
    if QUANTITIES[t.quantity].timing != "time" or not any(c.record for c in cs):
        return []
    ncol = len(t.columns)
    rows = tuple((r.label, *[utilisation(cs[i * ncol + j]).text() for j in range(ncol)])
                 for i, r in enumerate(t.rows))
    return [Para(("Implied utilisation, FLOPs / (time x GPUs x peak), the paper's time next to the model's (the "
                  "model's FLOPs of the cell, burst_impl.model.flops, causal halved; the record's accelerator's "
                  "peak), with the share of the model's time that is communication on its critical path (comm). "
                  "Where the model is mostly compute, a paper cell below the model's utilisation points at the "
                  "kernels; where it is mostly communication, at the transport (docs/hardware_burstattention.md: "
                  "which sourced constant covers which):",)),
            Table(("row", *[c.label for c in t.columns]), rows)]
