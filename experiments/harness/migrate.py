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

Two provenance texts written before their code changed are brought up to date, in every schema (no number
is touched, and a file whose records need nothing is rewritten byte for byte):
- ``spec.resolved.yaml``'s ``path``: results measured before e63a65f name the spec by the measuring
  checkout's absolute path; it becomes the repository path (the longest tail of it that is a file of this
  repository; left as it is where none is);
- a modelled record's assumptions that name ``CostModel.host_s`` (removed; the hardware cost model has no
  host term) say so in the model's present words (``_REWORDED``).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path, PurePosixPath

import yaml

from . import axes, env, record
from .record import FIELDS, Record

_OLD_LEVELS = {"block": "layer"}
RECORD_FILES = ("results.jsonl", "variants.jsonl")
RESOLVED_FILE = "spec.resolved.yaml"
# Words of a modelled record's assumptions that named code since removed -> the model's words for the same
# thing now (experiments/perfmodel/model.py ASSUMPTIONS; tests/test_record.py checks they are there).
_REWORDED = {"CostModel.host_s = 0": "no host term in the hardware cost model"}


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


def reword(rec: Record) -> bool:
    """Bring a modelled record's assumptions to the model's present words (``_REWORDED``); True if changed."""
    pred = rec["prediction"]
    texts = (pred or {}).get("assumptions")
    if not texts:
        return False
    new = list(texts)
    for old_words, words in _REWORDED.items():
        new = [t.replace(old_words, words) for t in new]
    if new == list(texts):
        return False
    rec["prediction"] = {**pred, "assumptions": new}
    return True


def migrate_file(path: Path) -> int:
    """Rewrite ``path`` in schema 3 (atomically); returns how many records changed (schema or wording)."""
    lines = [ln for ln in path.read_text(encoding="utf-8").splitlines() if ln.strip()]
    out, changed = [], 0
    for i, line in enumerate(lines, 1):
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            continue                       # a torn line stays out, as every reader skipped it
        old = obj.get("schema") != record.SCHEMA_VERSION
        rec = from_old(obj) if old else Record.from_json(obj, f"{path} line {i}")
        changed += int(reword(rec) or old)
        out.append(record.dumps(rec))
    tmp = path.with_name(path.name + ".migrating")
    tmp.write_text("".join(out), encoding="utf-8")
    tmp.replace(path)
    return changed


def repo_path(path: str) -> str:
    """A spec path as the repository names it: an absolute one (a checkout's, written before e63a65f) becomes
    its longest tail that is a file of this repository; anything else is returned as it is."""
    p = PurePosixPath(path)
    if not p.is_absolute():
        return path
    for i in range(1, len(p.parts)):
        tail = PurePosixPath(*p.parts[i:])
        if (env.REPO / tail).is_file():
            return str(tail)
    return path


def migrate_resolved(path: Path) -> int:
    """``spec.resolved.yaml`` with its ``path`` in the repository's words (1 if rewritten, else 0)."""
    spec = yaml.safe_load(path.read_text(encoding="utf-8"))
    if not isinstance(spec, dict) or not isinstance(spec.get("path"), str) or repo_path(spec["path"]) == spec["path"]:
        return 0
    spec["path"] = repo_path(spec["path"])
    tmp = path.with_name(path.name + ".migrating")
    tmp.write_text(yaml.safe_dump(spec, sort_keys=False), encoding="utf-8")
    tmp.replace(path)
    return 1


def migrate_root(root: Path | str) -> dict[str, int]:
    """Every record file and resolved spec under ``root`` (hidden folders apart); {file: records or specs
    changed}."""
    root = Path(root)
    if not root.exists():
        raise ValueError(f"root={str(root)!r} does not exist")
    files = sorted(p for name in (*RECORD_FILES, RESOLVED_FILE) for p in root.glob(f"**/{name}")
                   if not any(part.startswith(".") for part in p.relative_to(root).parts))
    return {str(p): (migrate_resolved(p) if p.name == RESOLVED_FILE else migrate_file(p)) for p in files}


def main(argv: list[str] | None = None) -> int:
    from ..cli import prog  # noqa: PLC0415 - experiments.cli sits above the harness (acyclic siblings)

    ap = argparse.ArgumentParser(prog=prog("python -m experiments.harness.migrate"),
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("roots", nargs="+", help="results roots (e.g. results/reference results/modelled)")
    args = ap.parse_args(argv)
    for root in args.roots:
        done = migrate_root(root)
        print(f"{root}: {len(done)} file(s), {sum(done.values())} record(s) or resolved spec(s) brought to "
              f"schema {record.SCHEMA_VERSION} and today's provenance words")
    return 0


if __name__ == "__main__":
    from ..cli import run_cli

    raise SystemExit(run_cli(main))
