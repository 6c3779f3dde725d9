"""The page as Markdown (``reports/index.md``): the same blocks as the HTML page."""
from __future__ import annotations

from .doc import Doc, Heading, Image, Link, Para, Table


def _cell(c) -> str:
    if isinstance(c, Link):
        return f"[{c.text}]({c.href})"
    if isinstance(c, tuple):
        return " ".join(_cell(x) for x in c)
    return str(c).replace("|", "\\|").replace("\n", " ")


def _block(b) -> str:
    if isinstance(b, Heading):
        return f'{"#" * b.level} {b.text} <a id="{b.anchor}"></a>'
    if isinstance(b, Para):
        return _cell(b.pieces)
    if isinstance(b, Table):
        lines = ["| " + " | ".join(b.header) + " |", "|" + "---|" * len(b.header)]
        lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in b.rows]
        return "\n".join(lines)
    if isinstance(b, Image):
        return f"![{b.alt}]({b.src})"
    raise TypeError(f"unknown block {b!r}")


def render_md(doc: Doc) -> str:
    return f"# {doc.title}\n\n" + "\n\n".join(_block(b) for b in doc.blocks) + "\n"
