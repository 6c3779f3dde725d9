"""Code hygiene that ruff does not check: no library function longer than MAX_FUNCTION_LINES.

Parses every module of the library packages with ``ast`` (nothing is imported) and names each function,
method or nested function whose definition (decorators excluded, docstring included) spans more lines.
"""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LIBRARY = ("burst_impl", "baselines", "experiments")
MAX_FUNCTION_LINES = 80


def _functions(tree: ast.AST, prefix: str = ""):
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield f"{prefix}{node.name}", node
            yield from _functions(node, f"{prefix}{node.name}.")
        elif isinstance(node, ast.ClassDef):
            yield from _functions(node, f"{prefix}{node.name}.")
        else:
            yield from _functions(node, prefix)


def long_functions(root: Path = REPO, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """``path:line name (n lines)`` of every library function over ``limit`` lines."""
    out = []
    for pkg in LIBRARY:
        for path in sorted((root / pkg).rglob("*.py")):
            tree = ast.parse(path.read_text(), filename=str(path))
            for name, node in _functions(tree):
                n = node.end_lineno - node.lineno + 1
                if n > limit:
                    out.append(f"{path.relative_to(root)}:{node.lineno} {name} ({n} lines)")
    return out


def test_library_modules_are_found():
    assert all(any((REPO / pkg).rglob("*.py")) for pkg in LIBRARY)


def test_no_library_function_over_80_lines():
    long = long_functions()
    assert not long, (f"{len(long)} library function(s) over {MAX_FUNCTION_LINES} lines; split them into "
                      "named steps:\n  " + "\n  ".join(long))


def test_the_check_names_a_long_function(tmp_path):
    pkg = tmp_path / "burst_impl"
    pkg.mkdir()
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    (pkg / "m.py").write_text(f"class C:\n    def short(self):\n        pass\n\n\ndef long():\n{body}\n")
    for other in LIBRARY[1:]:
        (tmp_path / other).mkdir()
    assert long_functions(tmp_path) == [f"burst_impl/m.py:6 long ({MAX_FUNCTION_LINES + 1} lines)"]
