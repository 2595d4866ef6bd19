"""Static checks of the code an environment submits for its code scorer: code the sandbox's
harness could never run is refused at submission, naming the field, rather than scoring every
sample 0 later. Nothing here runs the code."""

from __future__ import annotations

import ast

from policyloop.contracts.code_scorer import REWARD_FUNCTION, test_functions
from policyloop.contracts.v1 import loop_pb2
from policyloop.gateway.errors import InvalidField

# What the parser raises besides SyntaxError: ValueError for null bytes (before 3.12),
# MemoryError and RecursionError for nesting deeper than its stack.
_PARSE_ERRORS = (SyntaxError, ValueError, MemoryError, RecursionError)
_NEW_SCOPES = (ast.Lambda, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)


def check_reward_code(source: str) -> None:
    """The harness runs the source and calls `reward(prompt, completion, metadata)`: code that does
    not parse, or binds no `reward` at the top level, or whose `def reward` cannot take those three
    arguments or is async, can never score a sample."""
    field = "environment.reward_code.source"
    if not source:
        raise InvalidField(field, "is empty")
    try:
        tree = ast.parse(source)
    except _PARSE_ERRORS as exc:
        raise _unparsable(field, exc) from exc
    if _binds_dynamically(tree, REWARD_FUNCTION):
        return
    bindings = _module_bindings(tree, REWARD_FUNCTION)
    if not bindings:
        raise InvalidField(field, f"defines no top-level `{REWARD_FUNCTION}`: the sandbox calls "
                                  f"{REWARD_FUNCTION}(prompt, completion, metadata)")
    for node in bindings:
        if isinstance(node, ast.AsyncFunctionDef):
            raise InvalidField(field, f"line {node.lineno}: `async def {REWARD_FUNCTION}` returns a coroutine, "
                                      "not a number; define it with `def`")
        if isinstance(node, ast.FunctionDef) and not node.decorator_list and not _takes_three(node.args):
            raise InvalidField(field, f"line {node.lineno}: `{REWARD_FUNCTION}` cannot be called as "
                                      f"{REWARD_FUNCTION}(prompt, completion, metadata)")


def check_unit_tests(env: loop_pb2.Environment) -> None:
    """Every task must have tests to run: top-level `def test_*` functions in the shared test_code
    or its own metadata.tests (tests may come with each task), in Python that parses."""

    def tests_in(source: str, field: str) -> list[str]:
        try:
            return test_functions(source)
        except _PARSE_ERRORS as exc:
            raise _unparsable(field, exc) from exc

    shared = tests_in(env.unit_tests.test_code, "environment.unit_tests.test_code")
    for i, task in enumerate(env.tasks):
        own = tests_in(task.metadata.get("tests", ""), f"environment.tasks[{i}].metadata.tests")
        if not shared and not own:
            raise InvalidField(f"environment.tasks[{i}].metadata.tests",
                               "no top-level `def test_*` here nor in environment.unit_tests.test_code: "
                               "no tests to run")


def _unparsable(field: str, exc: BaseException) -> InvalidField:
    if isinstance(exc, SyntaxError):
        where = f" (line {exc.lineno})" if exc.lineno else ""
        return InvalidField(field, f"does not parse: {exc.msg}{where}")
    return InvalidField(field, f"does not parse: {exc or 'nested too deeply'}")


def _binds_dynamically(tree: ast.Module, name: str) -> bool:
    """`global name` in a function or `from m import *` may bind it where the parse cannot see."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Global) and name in node.names:
            return True
        if isinstance(node, ast.ImportFrom) and any(alias.name == "*" for alias in node.names):
            return True
    return False


def _module_bindings(tree: ast.Module, name: str) -> list[ast.AST]:
    """The nodes that bind `name` in the module's namespace (not inside a function or class)."""
    found: list[ast.AST] = []
    pending: list[ast.AST] = [tree]
    while pending:
        for child in ast.iter_child_nodes(pending.pop()):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                if child.name == name:
                    found.append(child)
            elif isinstance(child, ast.Name) and isinstance(child.ctx, ast.Store) and child.id == name:
                found.append(child)
            elif isinstance(child, ast.alias) and (child.asname or child.name.split(".")[0]) == name:
                found.append(child)
            elif not isinstance(child, _NEW_SCOPES):
                pending.append(child)
    return found


def _takes_three(args: ast.arguments) -> bool:
    """Whether a function with these parameters can be called with three positional arguments."""
    positional = len(args.posonlyargs) + len(args.args)
    required = positional - len(args.defaults)
    return (required <= 3 and (positional >= 3 or args.vararg is not None)
            and all(default is not None for default in args.kw_defaults))
