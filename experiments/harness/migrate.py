"""Convert results written before schema 3 (flat records, config keys copied to the top) into the record type
of ``record.py``, once per results root: ``burst-bench migrate <root> [<root> ...]``.

What changes, and why nothing a table or figure reads does:
- the top-level copies of config keys (``batch``, ``seqlen``, ``mask``...) go; the row rebuilds them from
  ``config``. Where a copy differed from its config value, the copy is what every reader saw (the old
  readers preferred it), so it is written into the config;
- axes a record predates (``mask`` in early runs) get their default in the config (what they ran at);
- the level ``block`` becomes ``layer`` (the level's old name);
- a modelled record's ``model`` (the prediction's breakdown, memory, assumptions, notes) becomes
  ``prediction``; ``model`` is the model's name in every record.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from . import axes, record
from .record import FIELDS, Record

_OLD_LEVELS = {"block": "layer"}
RECORD_FILES = ("results.jsonl", "variants.jsonl")


def from_old(old: dict) -> Record:
    """A schema-3 record of a schema-1/2 flat record."""
    old = dict(old)
    config = dict(old.get("config") or {})
    for a in axes.AXES:
        if a not in axes.REQUIRED:
            config.setdefault(a, axes.default(a))
    if isinstance(old.get("model"), dict):
        old["prediction"] = old.pop("model")
        if isinstance(config.get("model"), str):
            old["model"] = config["model"]
    for d in (old, config):
        if d.get("level") in _OLD_LEVELS:
            d["level"] = _OLD_LEVELS[d["level"]]
    rec = Record(status=old["status"], reason=old.get("reason") or "")
    for k, v in old.items():
        if k in ("schema", "status", "reason", "config"):
            continue
        if k in FIELDS:
            rec[k] = v
        elif k in config:
            if config[k] != v:
                config[k] = v
        else:
            raise ValueError(f"record {old.get('case_id')}: key {k!r} is neither a record field nor a config key")
    rec["config"] = config
    return rec


def migrate_file(path: Path) -> int:
    """Rewrite ``path`` in schema 3 (atomically); returns how many records changed schema."""
    lines = [ln for ln in path.read_text(encoding="utf-8").splitlines() if ln.strip()]
    out, changed = [], 0
    for i, line in enumerate(lines, 1):
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            continue                       # a torn line stays out, as every reader skipped it
        if obj.get("schema") == record.SCHEMA_VERSION:
            out.append(record.dumps(Record.from_json(obj, f"{path} line {i}")))
        else:
            out.append(record.dumps(from_old(obj)))
            changed += 1
    tmp = path.with_name(path.name + ".migrating")
    tmp.write_text("".join(out), encoding="utf-8")
    tmp.replace(path)
    return changed


def migrate_root(root: Path | str) -> dict[str, int]:
    """Every record file under ``root`` (hidden folders apart); {file: records converted}."""
    root = Path(root)
    if not root.exists():
        raise ValueError(f"root={str(root)!r} does not exist")
    files = sorted(p for name in RECORD_FILES for p in root.glob(f"**/{name}")
                   if not any(part.startswith(".") for part in p.relative_to(root).parts))
    return {str(p): migrate_file(p) for p in files}


def main(argv: list[str] | None = None) -> int:
    from ..cli import prog  # noqa: PLC0415 - experiments.cli sits above the harness (acyclic siblings)

    ap = argparse.ArgumentParser(prog=prog("python -m experiments.harness.migrate"),
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("roots", nargs="+", help="results roots (e.g. results/reference results/modelled)")
    args = ap.parse_args(argv)
    for root in args.roots:
        done = migrate_root(root)
        print(f"{root}: {len(done)} file(s), {sum(done.values())} record(s) converted to schema "
              f"{record.SCHEMA_VERSION}")
    return 0


if __name__ == "__main__":
    from ..cli import run_cli

    raise SystemExit(run_cli(main))
