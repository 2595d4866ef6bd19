"""Tools a multi-turn environment offers the policy, and how a call and its result look in text.

A model turn that ends with a tool's closing marker is a call: the text since that tool's
opening marker is its input. The rollout runs the call (the `python` tool: as a sandbox job)
and appends the result, between the result markers, as a tool turn; the model then goes on
from there. The markers are tokens of the model's vocabulary (the bootstrap tokenizer has them),
so a call ends on a stop token id with SGLang and with the embedded engine alike, and the
tool's tokens are exactly the ones the rollout inserted.

The `python` tool runs the code like a notebook cell: statements run, and the value of a final
expression is printed (`12+34` gives `46`), so a call can be as short as an expression.
"""

from __future__ import annotations

from dataclasses import dataclass

from policyloop.contracts.v1 import bus_pb2

PYTHON = "python"
TOOLS_PROMPT_TOKEN = "<tools>"  # opens a prompt whose task offers tools (the bootstrap model knows it)


@dataclass(frozen=True)
class ToolFormat:
    name: str
    call_open: str
    call_close: str
    result_open: str
    result_close: str

    @property
    def markers(self) -> tuple[str, str, str, str]:
        return self.call_open, self.call_close, self.result_open, self.result_close


TOOL_FORMATS: dict[str, ToolFormat] = {
    PYTHON: ToolFormat(PYTHON, "<python>", "</python>", "<output>", "</output>"),
}
MARKER_TOKENS: tuple[str, ...] = tuple(m for f in TOOL_FORMATS.values() for m in f.markers)


class UnknownTool(ValueError):
    """A tool name no environment can offer."""


def tool_formats(names: list[str] | tuple[str, ...]) -> list[ToolFormat]:
    unknown = [n for n in names if n not in TOOL_FORMATS]
    if unknown:
        raise UnknownTool(f"unknown tool(s) {unknown}; known: {sorted(TOOL_FORMATS)}")
    return [TOOL_FORMATS[n] for n in names]


@dataclass(frozen=True)
class ToolCall:
    tool: ToolFormat
    code: str       # the text between the markers
    complete: bool  # False: the closing marker came without its opening marker


def find_call(turn_text: str, formats: list[ToolFormat]) -> ToolCall | None:
    """The call a model turn ends with, or None when the turn ends otherwise (its answer)."""
    stripped = turn_text.rstrip()
    for fmt in formats:
        if stripped.endswith(fmt.call_close):
            body = stripped[: -len(fmt.call_close)]
            start = body.rfind(fmt.call_open)
            if start < 0:
                return ToolCall(fmt, body, complete=False)
            return ToolCall(fmt, body[start + len(fmt.call_open):], complete=True)
    return None


# Runs cell.py like a notebook cell: the value of a final expression statement is printed.
_CELL_RUNNER = r'''
import ast, sys
source = open("cell.py").read()
tree = ast.parse(source, "cell.py")
last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
namespace = {"__name__": "__main__"}
exec(compile(tree, "cell.py", "exec"), namespace)
if last is not None:
    value = eval(compile(ast.Expression(last.value), "cell.py", "eval"), namespace)
    if value is not None:
        print(repr(value))
'''


def python_job(code: str, *, job_id: str, run_id: str, timeout_s: float, max_output_bytes: int = 4096
               ) -> bus_pb2.SandboxJob:
    """The sandbox job that runs one `python` call."""
    limits = bus_pb2.SandboxLimits(wall_seconds=timeout_s, cpu_seconds=timeout_s, max_output_bytes=max_output_bytes)
    return bus_pb2.SandboxJob(
        job_id=job_id, run_id=run_id, files={"cell.py": code.encode(), "runner.py": _CELL_RUNNER.encode()},
        command=["python3", "-I", "runner.py"], limits=limits,
    )


def tool_job(call: ToolCall, *, job_id: str, run_id: str, timeout_s: float) -> bus_pb2.SandboxJob:
    """The sandbox job that runs `call` (every tool runs in the sandbox)."""
    if call.tool.name == PYTHON:
        return python_job(call.code, job_id=job_id, run_id=run_id, timeout_s=timeout_s)
    raise UnknownTool(f"no sandbox job for the {call.tool.name!r} tool")


def result_text(result: bus_pb2.SandboxResult, max_chars: int) -> tuple[str, str]:
    """(what the model sees, a status for the record) for a finished job.

    The model sees the job's stdout; when the job failed, the last line of stderr (the
    exception) or the limit that stopped it. Long output keeps its head and is marked cut."""
    stdout = result.stdout.decode(errors="replace")
    if result.error:
        text, status = f"error: {result.error}", "sandbox_error"
    elif result.limit_hit != bus_pb2.SANDBOX_LIMIT_NONE:
        limit = bus_pb2.SandboxLimit.Name(result.limit_hit).removeprefix("SANDBOX_LIMIT_").lower()
        text, status = stdout + f"stopped: {limit} limit", f"limit_{limit}"
    elif result.exit_code != 0:
        lines = result.stderr.decode(errors="replace").strip().splitlines()
        text, status = stdout + (lines[-1] if lines else f"exit code {result.exit_code}"), "error"
    else:
        text, status = stdout, "ok"
    text = text.strip()
    if len(text) > max_chars:
        text = text[:max_chars] + "…"
    return text, status


def wrap_result(fmt: ToolFormat, text: str) -> str:
    return f"{fmt.result_open}{text}{fmt.result_close}"
