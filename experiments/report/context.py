"""Everything the page is built from, loaded once: the papers' tables and claims, the results folders
that exist, and where the page lives (every link is made relative to it)."""
from __future__ import annotations

import fnmatch
import os
from dataclasses import dataclass
from pathlib import Path

from ..harness import results as R
from ..harness.env import REPO
from .claims import Claim, Rules, load_claims, load_rules
from .evidence import Experiment, Root, experiments, find_roots
from .paper import PAPER_DIR, MethodMap, PaperTable, load_methods, load_tables

REPORT_DIR = REPO / "reports"


@dataclass(frozen=True)
class Context:
    tables: dict[str, PaperTable]
    methods: dict[str, MethodMap]
    claims: list[Claim]
    roots: list[Root]
    page_dir: Path
    rules: Rules        # how a claim's verdict chain makes its headline (experiments/paper/verdict_rules.yaml)

    @property
    def measured_roots(self) -> list[Root]:
        return [r for r in self.roots if r.kind != "modelled"]

    @property
    def modelled_roots(self) -> list[Root]:
        return [r for r in self.roots if r.kind == "modelled"]

    def measured(self, patterns) -> list[Experiment]:
        return experiments(self.measured_roots, tuple(patterns))

    def modelled(self, patterns) -> list[Experiment]:
        return experiments(self.modelled_roots, tuple(patterns))

    def href(self, repo_path: str | Path) -> str:
        """A link from the page to a path (of the repository, or absolute), relative: it opens from disk
        and from an artifact."""
        return Path(os.path.relpath(REPO / repo_path, self.page_dir)).as_posix()

    def figures(self, exp: Experiment, globs) -> list[str]:
        """Repository paths of the figures drawn from ``exp`` (plots/<same path as results/>) matching ``globs``."""
        rel = Path(exp.rel)
        folder = REPO / "plots" / rel.relative_to(rel.parts[0])
        if not folder.is_dir():
            return []
        names = sorted(p.name for p in folder.glob("*.png"))
        picked = [n for g in globs for n in names if fnmatch.fnmatchcase(n, g)]
        return [f"{(folder / n).relative_to(REPO).as_posix()}" for n in dict.fromkeys(picked)]


def load_context(results_base: Path = R.RESULTS_BASE, machine: str | None = None,
                 page_dir: Path = REPORT_DIR, paper_dir: Path = PAPER_DIR) -> Context:
    tables = {t.id: t for t in load_tables(paper_dir)}
    return Context(tables, load_methods(paper_dir), load_claims(set(tables), paper_dir),
                   find_roots(Path(results_base), machine), Path(page_dir).resolve(), load_rules(paper_dir))
