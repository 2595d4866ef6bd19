"""The chat format's tool calls read back (models.chat_format.parse_assistant): what the template
writes parses to the same call; anything malformed leaves the whole answer as prose. And what a
stream holds back until it knows whether a stop string or a call is starting."""

from __future__ import annotations

import pytest

from policyloop.models.chat_format import AssistantTurn, ToolCall, parse_assistant, render_tool_call
from policyloop.serving.openai_api import held_back

ADD = ToolCall("add", {"a": 47, "b": 38})


def test_a_rendered_call_parses_back_with_the_prose_around_it() -> None:
    assert parse_assistant(render_tool_call(ADD)) == AssistantTurn(content=None, tool_calls=(ADD,))
    two = f"Let me add.\n{render_tool_call(ADD)}\n{render_tool_call(ToolCall('add', {'a': 1, 'b': 2}))}"
    turn = parse_assistant(two)
    assert turn.content == "Let me add." and [c.arguments for c in turn.tool_calls] == [ADD.arguments, {"a": 1, "b": 2}]
    as_string = '<tool_call>{"name": "add", "arguments": "{\\"a\\": 47, \\"b\\": 38}"}</tool_call>'
    assert parse_assistant(as_string).tool_calls == (ADD,)  # arguments written as a JSON string
    assert ADD.arguments_json() == '{"a": 47, "b": 38}'


@pytest.mark.parametrize("text", [
    "85",
    "<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 47\n</tool_call>",  # truncated JSON
    "<tool_call>\n{\"arguments\": {}}\n</tool_call>",  # no name
    "<tool_call>\n{\"name\": \"\", \"arguments\": {}}\n</tool_call>",  # an empty name
    "<tool_call>\n{\"name\": \"add\", \"arguments\": [1, 2]}\n</tool_call>",  # arguments not an object
    "<tool_call>\n[\"add\"]\n</tool_call>",
    "<tool_call>\n{\"name\": \"add\", \"arguments\": {}}",  # never closed
    f"{render_tool_call(ADD)}<tool_call>oops</tool_call>",  # one good block, one bad: all prose
])
def test_a_malformed_call_leaves_the_answer_as_prose(text: str) -> None:
    assert parse_assistant(text) == AssistantTurn(content=text, tool_calls=())


@pytest.mark.parametrize(("text", "prefixes", "held"), [
    ("The answer is 8", ("\n\n",), 0),
    ("The answer is 8\n", ("\n\n",), 1),
    ("Let me call <tool", ("<tool_call>",), 5),
    ("Let me call <", ("<tool_call>", "END"), 1),
    ("done E", ("<tool_call>", "END"), 1),
    ("", ("END",), 0),
])
def test_a_stream_holds_back_what_may_begin_a_stop_or_a_call(text: str, prefixes: tuple[str, ...],
                                                            held: int) -> None:
    assert held_back(text, prefixes) == held
