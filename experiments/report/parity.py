"""A measured section's loss parity: each timed training row's losses against the unsharded model's.

Records of a spec with ``model.loss_parity: true`` (``experiments/harness/model_parity.py``) carry
the single-process model's losses over the same steps, the largest relative difference, the
tolerance with its reason and the verdict; this is the table of them, one line per record.
"""
from __future__ import annotations

from .doc import Para, Table


def _row_name(r: dict) -> str:
    name = r.get("variant_label") or r.get("method", "?")
    return name + (" + ZeRO-3 (FSDP2)" if r.get("zero") else "")


def parity_blocks(records) -> list:
    """[Para, Table] of the records that checked their losses, or [] when none did."""
    checked = [r for r in records if r.get("status") == "ok" and r.get("loss_equal") is not None]
    if not checked:
        return []
    rows = tuple((_row_name(r), f"N={r.get('seqlen')}, G={r.get('world_size')}", str(len(r.get("losses") or [])),
                  f"{r['loss_rel_diff']:.2g}", f"{r['loss_rtol']:.2g}", "equal" if r["loss_equal"] else "DIFFERS")
                 for r in sorted(checked, key=lambda r: (r.get("seqlen") or 0, _row_name(r))))
    why = checked[0].get("loss_rtol_reason") or ""
    return [Para(("Loss parity: every step's loss against the single-process unsharded model's (same config, "
                  "seed, batch, optimizer and steps; largest relative difference over the steps). Tolerance: "
                  + why + ".",)),
            Table(("row", "shape", "steps", "max rel. difference", "tolerance", "loss"), rows)]
