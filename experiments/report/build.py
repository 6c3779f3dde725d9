"""Assemble the page from the context and write its two twins, ``index.html`` and ``index.md``."""
from __future__ import annotations

import datetime
from pathlib import Path

from ..harness.env import git_info
from .claims_section import claims_section
from .context import Context
from .doc import Doc, Link, Para, Table
from .inference_section import inference_section
from .intervals import intervals_section
from .model_section import model_section
from .render_html import render_html
from .render_md import render_md
from .sparse_training import sparse_training_section
from .table_section import table_section
from .varlen_section import varlen_section

TITLE = "Reproduction report: BurstAttention and BurstEngine, claims next to this suite's evidence"


def _provenance(ctx: Context) -> list:
    g = git_info()
    commit = (g.get("commit") or "?")[:10] + ("+dirty" if g.get("dirty") else "")
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    rows = tuple((Link(r.rel, ctx.href(r.path)), r.kind) for r in ctx.roots)
    return [Para((f"Built at commit {commit}, {date}, from the results folders below; it measured nothing. "
                  "Papers: docs/papers.md; their numbers: experiments/paper/.",)),
            Table(("results folder", "kind"), rows)]


def build_doc(ctx: Context) -> Doc:
    doc = Doc(TITLE)
    doc.add(*_provenance(ctx), *claims_section(ctx))
    for t in ctx.tables.values():
        doc.add(*table_section(ctx, t))
    doc.add(*varlen_section(ctx))                   # issue 37: the field's masks; published values read off figures
    doc.add(*sparse_training_section(ctx))          # no paper table: its values are not transcribed
    doc.add(*inference_section(ctx))                # issue 36: beyond the papers, no paper table
    doc.add(*model_section(ctx), *intervals_section(ctx))
    return doc


def write(ctx: Context) -> tuple[Path, Path]:
    doc = build_doc(ctx)
    ctx.page_dir.mkdir(parents=True, exist_ok=True)
    html_path, md_path = ctx.page_dir / "index.html", ctx.page_dir / "index.md"
    html_path.write_text(render_html(doc), encoding="utf-8")
    md_path.write_text(render_md(doc), encoding="utf-8")
    return html_path, md_path
