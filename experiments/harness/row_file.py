"""A JSON file of rows that several measurements fill: ``{<header>, "rows": [...]}``.

A probe run at one world size adds its rows to the file the runs at other world sizes wrote (``call_cpu.json``,
``lockstep_probe.json``); a row of the same key (the same call, case and world size) is replaced, the others kept.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable


def merge_rows(path, rows: list[dict], key: Callable[[dict], tuple], **header) -> None:
    """Write ``rows`` into ``path``'s rows, replacing those whose ``key`` a new row has; ``header`` goes beside
    ``rows`` at the top of the file."""
    path = Path(path)
    old = json.loads(path.read_text())["rows"] if path.exists() else []
    keys = {key(r) for r in rows}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**header, "rows": [r for r in old if key(r) not in keys] + list(rows)}, indent=1))
