"""The repository stands alone: its links and the paths its files name stay inside it.

A clone holds the tracked files and nothing else, so a Markdown link, a docstring or a comment that sends
the reader to a sibling folder (``../shared``), to an absolute path of one machine or to a document the
repository does not hold is a dead end for whoever reads it there.
"""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from tests.test_docs import _relative_links

ROOT = Path(__file__).resolve().parent.parent
TEXT_SUFFIXES = (".py", ".md", ".yaml", ".yml", ".toml", ".cfg", ".sh")
# Written by runs, not by hand: a record keeps the path its spec was read from on the machine that ran it
# (provenance, not a reference for a reader), and nothing here may edit results/ or plots/.
RUN_OUTPUTS = ("results/", "plots/")
# A sibling of the checkout, or an absolute path of the machine it was written on.
OUTSIDE = re.compile(r"\.\./shared\b|\.\./\.library\b|(?<![\w.~-])/work/")
# A document named in capitals (README.md, CHANGELOG.md), the way top-level documents are named.
DOCUMENT = re.compile(r"(?<![\w-])([A-Z][A-Z0-9_]*\.md)\b")


def _tracked() -> list[str]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True)
    if out.returncode != 0:
        pytest.skip(f"not a git checkout: {out.stderr.strip()}")
    return [p for p in out.stdout.split("\0") if p and (ROOT / p).is_file()]


def _text_files(tracked: list[str]) -> list[str]:
    """Hand-written text: sources, docs and configuration, without the run outputs and this file
    (which names the patterns it forbids)."""
    me = Path(__file__).resolve().relative_to(ROOT).as_posix()
    return [p for p in tracked
            if (p.endswith(TEXT_SUFFIXES) or Path(p).name == "Makefile")
            and not p.startswith(RUN_OUTPUTS) and p != me]


def _hits(pattern: re.Pattern, text: str) -> list[tuple[int, str]]:
    """(line number, match) for every match of ``pattern`` in ``text``."""
    return [(n, m.group(0)) for n, line in enumerate(text.splitlines(), 1) for m in pattern.finditer(line)]


def _inside(target: Path, tracked: set[str], folders: set[str]) -> bool:
    """Whether ``target`` is a tracked file or a folder holding one, inside the repository."""
    if not target.is_relative_to(ROOT):
        return False
    rel = target.relative_to(ROOT).as_posix()
    return rel in tracked or rel in folders


def test_the_scanners_see_what_they_forbid():
    # the rules below pass vacuously if their patterns never match; pin them on known bad lines
    text = "see ../shared/PAPER.md\nor /work/main/x.py and ../.library/search\nfine: docs/papers.md, a/work/b"
    assert [h for h, _ in _hits(OUTSIDE, text)] == [1, 2, 2]
    assert [m for _, m in _hits(DOCUMENT, "PAPER.md, README.md, docs/papers.md, MY_NOTES.md")] == [
        "PAPER.md", "README.md", "MY_NOTES.md"]


def test_markdown_links_resolve_inside_the_repository():
    tracked = _tracked()
    files = set(tracked)
    folders = {p.as_posix() for f in tracked for p in Path(f).parents if p != Path(".")}
    bad = []
    for md in (p for p in tracked if p.endswith(".md")):
        for target in _relative_links(ROOT / md):
            if target and not _inside(((ROOT / md).parent / target).resolve(), files, folders):
                bad.append(f"{md}: {target}")
    assert not bad, "Markdown links that leave the repository or name an untracked file:\n" + "\n".join(bad)


def test_no_file_names_a_path_outside_the_repository():
    bad = [f"{p}:{n}: {m}" for p in _text_files(_tracked())
           for n, m in _hits(OUTSIDE, (ROOT / p).read_text(errors="replace"))]
    assert not bad, ("paths outside the repository (the papers are docs/papers.md, their numbers "
                     "experiments/paper/):\n" + "\n".join(bad))


def test_named_documents_are_in_the_repository():
    tracked = _tracked()
    names = {Path(p).name for p in tracked}
    bad = [f"{p}:{n}: {m}" for p in _text_files(tracked)
           for n, m in _hits(DOCUMENT, (ROOT / p).read_text(errors="replace")) if m not in names]
    assert not bad, "documents the repository does not hold:\n" + "\n".join(bad)
