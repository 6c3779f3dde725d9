"""The page as plain blocks (headings, paragraphs, tables, images), rendered twice: Markdown
(``render_md``) and static HTML (``render_html``), so the two twins cannot say different things."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Union


@dataclass(frozen=True)
class Link:
    text: str
    href: str          # relative to the page's folder


Cell = Union[str, Link, tuple]       # a tuple: several pieces in one cell, joined by a space


@dataclass(frozen=True)
class Heading:
    level: int
    text: str
    anchor: str
    nav: str = ""        # the short name in the page's table of contents (default: the text)


@dataclass(frozen=True)
class Para:
    pieces: tuple        # str and Link pieces


@dataclass(frozen=True)
class Table:
    header: tuple[str, ...]
    rows: tuple[tuple[Cell, ...], ...]
    css: str = ""


@dataclass(frozen=True)
class Image:
    src: str             # relative to the page's folder
    alt: str


@dataclass
class Doc:
    title: str
    blocks: list = field(default_factory=list)

    def add(self, *blocks) -> "Doc":
        self.blocks.extend(blocks)
        return self

    def sections(self) -> list[Heading]:
        return [b for b in self.blocks if isinstance(b, Heading) and b.level == 2]
