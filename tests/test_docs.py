"""The documentation: a short README, links that resolve, the method table generated from the registry."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from baselines import methods_table

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
# [text](target) and ![alt](target); the target ends at whitespace or ")"
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def _without_code(text: str) -> str:
    """The text outside fenced code blocks and inline code (links there are not links)."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`]+`", "", text)


def _relative_links(path: Path) -> list[str]:
    out = []
    for target in LINK.findall(_without_code(path.read_text())):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue            # a URL (http:, mailto:) or an anchor in the same page
        out.append(target.split("#", 1)[0])
    return out


def test_readme_is_short_and_names_the_two_commands():
    text = README.read_text()
    assert len(text.splitlines()) <= 200, f"README.md has {len(text.splitlines())} lines (at most 200)"
    assert "make test" in text and "make reproduce" in text


def test_the_docs_pages_exist():
    names = {p.name for p in DOCS}
    for page in ("operator", "methods", "masks", "engine", "experiments", "emulator", "perfmodel",
                 "gpu_check", "testing", "findings"):
        assert f"{page}.md" in names


@pytest.mark.parametrize("path", [README, *DOCS], ids=lambda p: str(p.relative_to(ROOT)))
def test_code_fences_are_closed(path):
    fences = [line for line in path.read_text().splitlines() if line.lstrip().startswith("```")]
    assert len(fences) % 2 == 0, f"{path.relative_to(ROOT)}: an unclosed code fence"


@pytest.mark.parametrize("path", [README, *DOCS], ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path):
    missing = []
    for target in _relative_links(path):
        resolved = (path.parent / target).resolve()
        if not resolved.is_relative_to(ROOT):
            continue            # outside the repository: tests/test_repo_links.py rejects it
        if not resolved.exists():
            missing.append(target)
    assert not missing, f"{path.relative_to(ROOT)}: links to missing files: {missing}"


def test_readme_links_every_docs_page():
    linked = {(README.parent / t).resolve() for t in _relative_links(README)}
    assert not [p.name for p in DOCS if p.resolve() not in linked]


def test_methods_table_is_current():
    assert methods_table.main(["--check", str(ROOT / "docs" / "methods.md")]) == 0, (
        "docs/methods.md's table is out of date: python -m baselines.methods_table --write docs/methods.md")


def test_methods_table_check_detects_a_stale_table(tmp_path):
    page = tmp_path / "methods.md"
    page.write_text(f"intro\n{methods_table.START}\n| stale |\n{methods_table.END}\nafter\n")
    assert methods_table.main(["--check", str(page)]) == 1
    assert methods_table.main(["--write", str(page)]) == 0
    text = page.read_text()
    assert methods_table.main(["--check", str(page)]) == 0
    assert text.startswith("intro\n") and text.endswith("after\n")
    assert all(f"`{name}`" in text for name in methods_table.METHODS)


def test_methods_table_needs_its_markers(tmp_path):
    page = tmp_path / "methods.md"
    page.write_text("no markers\n")
    assert methods_table.main(["--check", str(page)]) == 2
