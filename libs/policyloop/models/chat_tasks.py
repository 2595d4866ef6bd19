"""The chat model's warm-up tasks: arithmetic questions posed in chat, answered in text or through
a function tool, as conversations in the OpenAI / transformers message format (chat_format).

Two kinds of conversation, both on "a op b" problems with one- or two-digit operands and + or -:

- text: a user asks ("What is 47 + 38?", "Calculate 47 + 38.", a few phrasings) and the assistant
  answers "47 + 38 = 85.";
- tool: the same question with tools offered (`add`/`subtract`, `calculator`, sometimes an
  unrelated tool beside them; the schemas rendered as a client would send them: with or without
  descriptions, OpenAI Agents SDK style with `"strict": true` and `"additionalProperties": false`),
  with or without a system prompt (plain, or agent instructions); the assistant calls the right
  tool with the right arguments, the tool answers (the number, or {"result": n}), and the
  assistant says "The answer is 85.".

The phrasings keep what the model has to read at a fixed distance from where it writes: the
expression always ends the question, the text answer starts by restating it, and the answer after
a tool copies the number the tool returned. A model of a million parameters learns such copies in
a few hundred steps, where a varied layout takes thousands (measured: docs/engine.md).

Problems are split by prompt hash as envs/arithmetic splits them (`is_heldout` of the problem's
"a+b=" prompt), so held-out questions are never trained on whatever their phrasing.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from policyloop.envs.arithmetic import Problem, is_heldout
from policyloop.models.chat_format import CHAT_TEMPLATE, AssistantTurn, ToolCall, parse_assistant

ONE_DIGIT, TWO_DIGITS = range(10), range(10, 100)
ONE_DIGIT_SHARE = 0.7
"""Odds that an operand has one digit: half the problems are single-digit ones, which a small
model learns first (the digit table it also uses for the units of the rest)."""

# The expression always ends the question (then one punctuation mark), so it sits at the same
# distance from the answer whatever the phrasing: a small model learns to read it in a few
# hundred steps instead of thousands.
QUESTIONS: tuple[str, ...] = (
    "What is {e}?",
    "what is {e}?",
    "What's {e}?",
    "How much is {e}?",
    "Compute {e}.",
    "Calculate {e}.",
    "Please calculate {e}.",
    "Can you work out {e}?",
)
ANSWER = "{a} {op} {b} = {r}."
"""A text answer: the expression as the question wrote it (a copy at a fixed distance), then the number."""
ANSWER_AFTER_TOOL = "The answer is {r}."
"""The answer after the tool's result: the number it returned."""
SYSTEM_PROMPTS: tuple[str | None, ...] = (
    None,
    None,
    "You are a helpful assistant.",
    "You are a math assistant. Use the tools you are given to compute exact results.",
    "You are an agent that answers arithmetic questions. Call a tool when one can do the work, "
    "then reply with the result.",
)

_INTEGER = {"type": "integer"}
_NUMBER = {"type": "number"}


@dataclass(frozen=True)
class ToolSpec:
    """A function tool the warm-up offers: its name, description and JSON-schema parameters."""
    name: str
    description: str
    properties: dict[str, Any]

    def schema(self, style: str) -> dict[str, Any]:
        """The `tools` entry a client sends: "plain" (with description), "bare" (no description),
        or "strict" (as the OpenAI Agents SDK sends it)."""
        parameters: dict[str, Any] = {"type": "object", "properties": self.properties,
                                      "required": list(self.properties)}
        function: dict[str, Any] = {"name": self.name}
        if style != "bare":
            function["description"] = self.description
        if style == "strict":
            parameters = {"properties": self.properties, "required": list(self.properties),
                          "title": f"{self.name}_args", "type": "object", "additionalProperties": False}
        function["parameters"] = parameters
        if style == "strict":
            function["strict"] = True
        return {"type": "function", "function": function}


ADD = ToolSpec("add", "Add two numbers and return their sum.", {"a": _INTEGER, "b": _INTEGER})
SUBTRACT = ToolSpec("subtract", "Subtract b from a and return the difference.", {"a": _INTEGER, "b": _INTEGER})
CALCULATOR = ToolSpec("calculator", "Evaluate an arithmetic expression such as '12 + 7' and return the result.",
                      {"expression": {"type": "string", "description": "The expression to evaluate."}})
DISTRACTORS: tuple[ToolSpec, ...] = (
    ToolSpec("get_weather", "Get the current weather for a city.",
             {"city": {"type": "string", "description": "The city name."}}),
    ToolSpec("search_web", "Search the web and return the top results.", {"query": {"type": "string"}}),
    ToolSpec("multiply", "Multiply two numbers.", {"x": _NUMBER, "y": _NUMBER}),
)
# The tool sets offered (the arithmetic tool first or not) and the schema styles.
TOOLSETS: tuple[tuple[ToolSpec, ...], ...] = (
    (CALCULATOR,), (ADD, SUBTRACT), (CALCULATOR, DISTRACTORS[0]), (DISTRACTORS[1], ADD, SUBTRACT),
    (ADD, SUBTRACT, DISTRACTORS[2]), (DISTRACTORS[0], CALCULATOR),
)
SCHEMA_STYLES: tuple[str, ...] = ("plain", "bare", "strict")

_EXPRESSION = re.compile(r"\s*(-?\d+)\s*([+-])\s*(-?\d+)\s*")
_LAST_INTEGER = re.compile(r"-?\d+")


@dataclass(frozen=True)
class ChatTask:
    """One problem posed in chat: the messages up to the assistant's first turn and what it should say."""
    problem: Problem
    messages: tuple[dict[str, Any], ...]
    """The conversation before the assistant's first turn (system? + user)."""
    tools: tuple[dict[str, Any], ...] | None
    """The `tools` offered (None: a text question)."""
    call: ToolCall | None
    """The call a right answer makes (None for a text question)."""
    tool_output: str | None
    answer: str
    """The assistant's final text."""

    def conversation(self) -> list[dict[str, Any]]:
        """The whole conversation: a text answer, or the call, the tool's answer, then the text."""
        messages = [dict(m) for m in self.messages]
        if self.call is not None:
            messages.append({"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": {"name": self.call.name, "arguments": self.call.arguments}}]})
            messages.append({"role": "tool", "content": self.tool_output})
        messages.append({"role": "assistant", "content": self.answer})
        return messages

    def after_tool(self) -> list[dict[str, Any]]:
        """The conversation up to the tool's answer (the assistant's next turn states the result)."""
        return self.conversation()[:-1]


def render(messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None = None, *,
           add_generation_prompt: bool = False) -> str:
    """The conversation as chat_format.CHAT_TEMPLATE renders it through transformers (what
    `apply_chat_template(..., tokenize=False)` gives), without loading a tokenizer."""
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, _ = render_jinja_template([list(messages)], tools=list(tools) if tools else None,
                                        chat_template=CHAT_TEMPLATE, add_generation_prompt=add_generation_prompt)
    return rendered[0]


def problems(count: int, seed: int, *, heldout: bool, ops: Sequence[str] = ("+", "-"),
             heldout_fraction: float = 0.2) -> list[Problem]:
    """`count` problems of one split, drawn with replacement (so that a measure on the held-out
    split weighs problems as training does); the same for the same seed.

    Each operand has one digit (0-9) with odds ONE_DIGIT_SHARE, else two (10-99): the model
    learns the single-digit problems first and RL has the rest to gain. A subtraction never goes
    below zero (a >= b)."""
    rng = random.Random(seed)
    out: list[Problem] = []
    while len(out) < count:
        a, b = (rng.choice(ONE_DIGIT if rng.random() < ONE_DIGIT_SHARE else TWO_DIGITS) for _ in range(2))
        op = rng.choice(tuple(ops))
        problem = Problem(max(a, b), op, min(a, b)) if op == "-" else Problem(a, op, b)
        if is_heldout(problem, heldout_fraction) == heldout:
            out.append(problem)
    return out


def _fill(template: str, problem: Problem) -> str:
    return template.format(a=problem.a, op=problem.op, b=problem.b, r=problem.answer)


def _question(problem: Problem, rng: random.Random) -> str:
    return rng.choice(QUESTIONS).format(e=f"{problem.a} {problem.op} {problem.b}")


def _call(problem: Problem, tools: Sequence[ToolSpec]) -> ToolCall:
    names = {t.name for t in tools}
    if "calculator" in names:  # the expression as the question wrote it
        return ToolCall("calculator", {"expression": f"{problem.a} {problem.op} {problem.b}"})
    return ToolCall("add" if problem.op == "+" else "subtract", {"a": problem.a, "b": problem.b})


def text_task(problem: Problem, rng: random.Random) -> ChatTask:
    messages = [{"role": "user", "content": _question(problem, rng)}]
    return ChatTask(problem, tuple(messages), None, None, None, _fill(ANSWER, problem))


def tool_task(problem: Problem, rng: random.Random) -> ChatTask:
    return tool_session([problem], rng)[0]


def tool_session(chosen: Sequence[Problem], rng: random.Random) -> list[ChatTask]:
    """Tool tasks on one tool set, schema style and system prompt: what `session_conversation`
    makes one conversation of, a question after another."""
    specs = rng.choice(TOOLSETS)
    style = rng.choice(SCHEMA_STYLES)
    system = rng.choice(SYSTEM_PROMPTS)
    schemas = tuple(s.schema(style) for s in specs)
    session = []
    for problem in chosen:
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": _question(problem, rng)}]
        output = problem.answer if rng.random() < 0.7 else json.dumps({"result": int(problem.answer)})
        session.append(ChatTask(problem, tuple(messages), schemas, _call(problem, specs), output,
                                _fill(ANSWER_AFTER_TOOL, problem)))
    return session


def session_conversation(session: Sequence[ChatTask]) -> list[dict[str, Any]]:
    """One conversation of a tool session's questions: the first task's whole conversation, then
    each next one from its user turn on (the system turn and the tools are the first's)."""
    messages = session[0].conversation()
    for task in session[1:]:
        messages += task.conversation()[len(task.messages) - 1:]
    return messages


def tasks(count: int, seed: int, *, heldout: bool, tool_fraction: float, ops: Sequence[str] = ("+", "-")
          ) -> list[ChatTask]:
    """`count` tasks of one split, a `tool_fraction` share of them with tools; the same for the same seed."""
    rng = random.Random(seed)
    return [tool_task(p, rng) if rng.random() < tool_fraction else text_task(p, rng)
            for p in problems(count, seed, heldout=heldout, ops=ops)]


def text_correct(text: str, finished_by_stop: bool, problem: Problem) -> bool:
    """A text answer is right when the turn ended and its last integer is the result."""
    numbers = _LAST_INTEGER.findall(text)
    return finished_by_stop and bool(numbers) and numbers[-1] == problem.answer and "<tool_call>" not in text


def calculate(expression: str) -> int:
    """The `calculator` tool: the value of "a + b" or "a - b" (integers); ValueError for anything else."""
    match = _EXPRESSION.fullmatch(expression)
    if match is None:
        raise ValueError(f"not an expression 'a + b' or 'a - b' of integers: {expression!r}")
    a, op, b = int(match[1]), match[2], int(match[3])
    return a + b if op == "+" else a - b


def calculator_call_correct(expression: object, problem: Problem) -> bool:
    """The calculator's expression is the problem's (spaces aside)."""
    match = _EXPRESSION.fullmatch(str(expression))
    return match is not None and (int(match[1]), match[2], int(match[3])) == (problem.a, problem.op, problem.b)


def call_correct(turn: AssistantTurn, task: ChatTask) -> bool:
    """The turn makes exactly one call, to an offered tool, whose arguments compute the problem."""
    offered = {t["function"]["name"] for t in task.tools or ()}
    if len(turn.tool_calls) != 1 or turn.tool_calls[0].name not in offered:
        return False
    call, problem = turn.tool_calls[0], task.problem
    if call.name == "calculator":
        return set(call.arguments) == {"expression"} and calculator_call_correct(call.arguments["expression"], problem)
    wanted = "add" if problem.op == "+" else "subtract"
    return call.name == wanted and call.arguments == {"a": problem.a, "b": problem.b}


def tool_call_valid(text: str, finished_by_stop: bool, task: ChatTask) -> bool:
    """The generated turn parses (chat_format.parse_assistant) into the right call."""
    return finished_by_stop and call_correct(parse_assistant(text), task)
