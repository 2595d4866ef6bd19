"""docs/architecture.md's tables name real code: every library path in the trajectory's path and
in "Where to change what" exists, and every `Class.method` or `module.name` the path table names
is defined where it says."""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LIBRARY = REPO / "libs" / "policyloop"
DOC = (REPO / "docs" / "architecture.md").read_text()
PATH = re.compile(r"`([a-z_]+/[a-z_/]*(?:\.py)?)`")


def table(heading_row: str) -> list[str]:
    lines = DOC.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(heading_row))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append(line)
    return rows


def test_the_trajectorys_path_names_modules_that_exist() -> None:
    rows = table("| # | step | file |")
    assert [row.split("|")[1].strip() for row in rows] == [str(i) for i in range(1, len(rows) + 1)]
    for row in rows:
        paths = PATH.findall(row)
        assert paths, row
        for path in paths:
            assert (LIBRARY / path).exists(), f"{path} (step {row.split('|')[1].strip()}) is not in the library"


def test_the_names_the_path_gives_are_defined_there() -> None:
    """`Learner.step` in learner/learner.py: a class the step's module defines, with that method."""
    for row in table("| # | step | file |"):
        modules = [LIBRARY / p for p in PATH.findall(row) if p.endswith(".py")]
        for owner, member in re.findall(r"`([A-Z]\w+)\.(\w+)`", row):
            defined = [m for m in modules if _defines(m, owner, member)]
            assert defined, f"{owner}.{member} is not defined in {[str(m.relative_to(LIBRARY)) for m in modules]}"


def test_where_to_change_what_names_paths_that_exist() -> None:
    for row in table("| to add … | change | and |"):
        for path in PATH.findall(row):
            if path.startswith(("docs/", "tests/", "protos/")):
                assert (REPO / path).exists(), path
            elif not path.startswith("policyloop/"):
                assert (LIBRARY / path).exists() or (REPO / path).exists(), f"{path} in: {row[:60]}"


def _defines(module: Path, owner: str, member: str) -> bool:
    tree = ast.parse(module.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == owner:
            return any(isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and n.name == member for n in node.body)
    return False
