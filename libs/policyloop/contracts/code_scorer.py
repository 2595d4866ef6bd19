"""What a code scorer's source must provide, shared by the gateway (which checks submitted code)
and the reward service (whose sandbox harness runs it)."""

from __future__ import annotations

import ast

REWARD_FUNCTION = "reward"  # what reward code defines; the harness calls it


def test_functions(source: str) -> list[str]:
    """The tests the harness runs from `source`: top-level `def test_*` (not async), each once.
    Raises SyntaxError for code that does not parse."""
    return sorted({node.name for node in ast.parse(source).body
                   if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")})
