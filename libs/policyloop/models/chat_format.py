"""The chat format of policyloop's chat models: Qwen2.5's (ChatML turns, tools offered in the
system turn, calls as `<tool_call>` JSON blocks, results as `<tool_response>` blocks in a user
turn). The template is what a Qwen2.5 directory carries, so a real Qwen2.5 model and the chat
model built here render and parse the same way; the parser reads back what the template writes.

The template takes messages the way transformers' `apply_chat_template` does: an assistant
message's `tool_calls[*].function.arguments` is a mapping (OpenAI's JSON string is decoded by the
caller first), and a `tool` message's `content` is the tool's output as text.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

IM_START, IM_END, END_OF_TEXT = "<|im_start|>", "<|im_end|>", "<|endoftext|>"
SPECIAL_TOKENS: tuple[str, ...] = (END_OF_TEXT, IM_START, IM_END)
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
TOOL_RESPONSE_OPEN, TOOL_RESPONSE_CLOSE = "<tool_response>", "</tool_response>"
# Added tokens that are not special: they decode as themselves with skip_special_tokens, so the
# parser sees them in the text the endpoint decodes.
MARKUP_TOKENS: tuple[str, ...] = (TOOL_CALL_OPEN, TOOL_CALL_CLOSE, TOOL_RESPONSE_OPEN, TOOL_RESPONSE_CLOSE)

TOOLS_PREAMBLE = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
                  "You are provided with function signatures within <tools></tools> XML tags:\n<tools>")
TOOLS_POSTAMBLE = ("\n</tools>\n\nFor each function call, return a json object with function name and arguments "
                   "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
                   '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')

# Qwen2.5's template, less its default system prompt naming Qwen: a conversation without a system
# message and without tools has no system turn.
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- " + json.dumps(TOOLS_PREAMBLE) + " }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- " + json.dumps(TOOLS_POSTAMBLE) + " }}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first)"
    " or (message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>' + message.role }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' }}{{- tool_call.name }}{{- '\", \"arguments\": ' }}"
    "{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != 'tool') %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}"
    "{%- if loop.last or (messages[loop.index0 + 1].role != 'tool') %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

_CALL_BLOCK = re.compile(re.escape(TOOL_CALL_OPEN) + r"(.*?)" + re.escape(TOOL_CALL_CLOSE), re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]

    def arguments_json(self) -> str:
        return json.dumps(self.arguments, ensure_ascii=False)


@dataclass(frozen=True)
class AssistantTurn:
    """What an assistant's text says: its prose (`content`, None when there is none) and its calls."""
    content: str | None
    tool_calls: tuple[ToolCall, ...]


def parse_tool_call(block: str) -> ToolCall | None:
    """The call one `<tool_call>` block holds, or None when it is not {"name": str, "arguments": {...}}."""
    try:
        value = json.loads(block)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    arguments = value.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(name=value["name"], arguments=arguments)


def parse_assistant(text: str) -> AssistantTurn:
    """The calls in `text` and the prose around them. Only when every block parses are they calls:
    a malformed block leaves the whole text as prose, as the model wrote it (never an error)."""
    blocks = list(_CALL_BLOCK.finditer(text))
    calls = [parse_tool_call(b.group(1).strip()) for b in blocks]
    if not blocks or any(c is None for c in calls):
        return AssistantTurn(content=text, tool_calls=())
    prose = _CALL_BLOCK.sub("", text).strip()
    return AssistantTurn(content=prose or None, tool_calls=tuple(c for c in calls if c is not None))


def render_tool_call(call: ToolCall) -> str:
    """A call as the template writes it (what the model learns to write)."""
    return f'{TOOL_CALL_OPEN}\n{{"name": "{call.name}", "arguments": {json.dumps(call.arguments)}}}\n{TOOL_CALL_CLOSE}'


def function_tool(name: str, description: str, parameters: Mapping[str, Any]) -> dict[str, Any]:
    """An OpenAI function tool (the `tools` entry both the endpoint and the template take)."""
    return {"type": "function", "function": {"name": name, "description": description, "parameters": dict(parameters)}}
