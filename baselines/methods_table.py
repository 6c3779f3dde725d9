"""The method catalogue's table, generated from the registry (``baselines.registry.METHODS``).

    python -m baselines.methods_table                          # print the Markdown table
    python -m baselines.methods_table --write docs/methods.md  # replace the table between the markers
    python -m baselines.methods_table --check docs/methods.md  # exit 1 if the file's table is out of date

The table sits in the file between ``<!-- methods-table:start -->`` and
``<!-- methods-table:end -->``; everything outside the markers is left as it is.
One row per registered method, in registry order: name, level, what travels
(``Method.travels``), layouts, whether it takes ``mask=``, its performance-model
schedule (``Method.schedule``), what sequence-level checkpointing does with it
(``Method.operator_backward``), the external peer it wraps or is checked
against, and its description.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from baselines.registry import METHODS

START = "<!-- methods-table:start -->"
END = "<!-- methods-table:end -->"
DEFAULT_PATH = Path(__file__).resolve().parent.parent / "docs" / "methods.md"
COLUMNS = ("method", "level", "what travels", "layouts", "masks", "perf model", "seq checkpoint", "external peer",
           "description")


def _schedule(m) -> str:
    if m.schedule is None:
        return "-"
    opts = {**m.schedule.options, **{k: v for k, v in m.options.items() if k in ("topology", "overlap")}}
    return m.schedule.family + (" (" + ", ".join(f"{k}={v}" for k, v in opts.items()) + ")" if opts else "")


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def render() -> str:
    """The Markdown table of every registered method (no trailing newline)."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for m in METHODS.values():
        name = f"`{m.name}`"
        if m.variant_of:
            name += f" (variant of `{m.variant_of}`)"
        if m.bytes_by_formula:
            name += " (bytes by formula)"
        row = (name, m.level, _cell(m.travels), ", ".join(f"`{x}`" for x in m.layouts),
               "yes" if m.masks else "no", _cell(_schedule(m)),
               f"caches O, lse ({m.operator_backward})" if m.operator_backward else
               "caches O, lse (own hook)" if m.cached_attention else "as full",
               _cell(m.external) if m.external else "-", _cell(m.description))
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def replace_table(text: str, table: str) -> str:
    """``text`` with the part between the markers replaced by ``table``; ValueError without both markers."""
    i, j = text.find(START), text.find(END)
    if i < 0 or j < 0 or j < i:
        raise ValueError(f"the file must contain {START!r} followed by {END!r}")
    return text[:i + len(START)] + "\n" + table + "\n" + text[j:]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m baselines.methods_table", description=__doc__.splitlines()[0])
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--write", nargs="?", const=str(DEFAULT_PATH), metavar="FILE",
                   help=f"replace the table between the markers of FILE (default {DEFAULT_PATH.name} in docs/)")
    g.add_argument("--check", nargs="?", const=str(DEFAULT_PATH), metavar="FILE",
                   help="exit 1 if FILE's table differs from the registry's")
    args = ap.parse_args(argv)
    table = render()
    if args.write is None and args.check is None:
        print(table)
        return 0
    path = Path(args.write or args.check)
    text = path.read_text()
    try:
        new = replace_table(text, table)
    except ValueError as e:
        print(f"{path}: {e}", file=sys.stderr)
        return 2
    if args.check:
        if new != text:
            print(f"{path}: the methods table is out of date; run python -m baselines.methods_table "
                  f"--write {path}", file=sys.stderr)
            return 1
        return 0
    if new != text:
        path.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
