"""What the OpenAI endpoint takes, validated before anything is rendered: sampling fields, the
conversation (system, developer, user, assistant with tool calls, tool results), function tools
and tool_choice. Every refusal names its field, in OpenAI's form (`messages[2].tool_call_id`).

A conversation is checked as a whole: an assistant's call arguments are a JSON object, a tool
result answers a call made earlier in the conversation, a named tool_choice names an offered tool,
and a tool's parameter schema is not nested past MAX_SCHEMA_DEPTH."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from policyloop.contracts.v1 import serving_pb2
from policyloop.serving.errors import ApiError

MAX_CHOICES = 8
MAX_STOP_STRINGS = 4  # as OpenAI
MAX_SCHEMA_DEPTH = 32
SESSION_METADATA_KEY = "session_id"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False


class FunctionDefinition(_Strict):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionTool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["auto", "none", "required"] | NamedToolChoice


class TextPart(_Strict):
    type: Literal["text"]
    text: str


Content = str | list[TextPart]


class CalledFunction(_Strict):
    name: str
    arguments: str


class AssistantToolCall(_Strict):
    id: Annotated[str, Field(min_length=1)]
    type: Literal["function"] = "function"
    function: CalledFunction


class SystemMessage(_Strict):
    role: Literal["system", "developer"]
    content: Content
    name: str | None = None


class UserMessage(_Strict):
    role: Literal["user"]
    content: Content
    name: str | None = None


class AssistantMessage(_Strict):
    role: Literal["assistant"]
    content: Content | None = None
    tool_calls: list[AssistantToolCall] | None = None
    name: str | None = None
    refusal: str | None = None


class ToolMessage(_Strict):
    role: Literal["tool"]
    content: Content
    tool_call_id: Annotated[str, Field(min_length=1)]


Message = Annotated[SystemMessage | UserMessage | AssistantMessage | ToolMessage, Field(discriminator="role")]


class SamplingRequest(_Strict):
    """The sampling fields both routes take (others OpenAI defines are refused by name)."""

    model: str
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    seed: int | None = Field(None, ge=0)
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    stop: Annotated[str, Field(min_length=1)] | Annotated[
        list[Annotated[str, Field(min_length=1)]], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None  # accepted for clients that send it: exchanges are traces here either way
    # vLLM's extension, as the verifiers library uses it: the exact prompt and completion ids.
    return_token_ids: bool = False

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class ChatRequest(SamplingRequest):
    messages: list[Message] = Field(min_length=1)
    tools: list[FunctionTool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=0, description="the engine gives the sampled token's only")


class CompletionRequest(SamplingRequest):
    prompt: str | list[int]
    logprobs: int | None = Field(None, ge=0, le=0)  # the sampled token's logprob only


_Request = TypeVar("_Request", bound=BaseModel)


def parse_request(model: type[_Request], body: Any) -> _Request:
    """`body` as `model`, or an ApiError naming the first field at fault."""
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        # A union's branch names (str, list[...], the message roles) are pydantic's, not the client's;
        # of the branches' errors, the one that went deepest into the value says what is wrong.
        located = [(e, [p for p in e["loc"] if not _is_branch(str(p))]) for e in exc.errors(include_url=False)]
        # and at equal depth, a branch of the right type whose value is refused beats a wrong type.
        error, loc = max(located, key=lambda pair: (len(pair[1]), not pair[0]["type"].endswith("_type")))
        param = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".") or None
        raise ApiError(f"{param}: {error['msg']}", param) from None


def _is_branch(part: str) -> bool:
    # OpenAI's field names are lower case; pydantic names a union's branches by type or class.
    return part in {"str", "int", "system", "developer", "user", "assistant", "tool"} or part[:1].isupper() \
        or part.startswith(("list[", "Literal[", "function-", "constrained-"))


def text_of(content: Content | None) -> str:
    if content is None:
        return ""
    return content if isinstance(content, str) else "".join(part.text for part in content)


@dataclass(frozen=True)
class Conversation:
    """A validated chat request's conversation: as the chat template takes it, as a trace records
    it, the tools to offer (None: none) and how the model is to use them."""
    template_messages: list[dict[str, Any]]
    recorded: list[serving_pb2.ChatMessage]
    tools: list[dict[str, Any]] | None
    tool_choice: str | None  # "auto", "required", a function's name; None: no tools are offered
    texts: list[tuple[str, str]]  # (param, text) of every text the client sent, for refusals


def conversation(request: ChatRequest) -> Conversation:
    """Checks the conversation as a whole and renders it for the template (call arguments decoded
    to objects, `developer` as `system`)."""
    choice = request.tool_choice if request.tool_choice is not None else ("auto" if request.tools else "none")
    names = [tool.function.name for tool in request.tools or []]
    if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
        raise ApiError(f"tool_choice.function.name: no tool named {choice.function.name!r} is offered",
                       "tool_choice.function.name")
    if choice == "required" and not names:
        raise ApiError("tool_choice: 'required' needs tools", "tool_choice")
    for i, tool in enumerate(request.tools or []):
        if _depth(tool.function.parameters) > MAX_SCHEMA_DEPTH:
            raise ApiError(f"tools[{i}].function.parameters: nested deeper than {MAX_SCHEMA_DEPTH} levels",
                           f"tools[{i}].function.parameters")
    called: set[str] = set()
    rendered: list[dict[str, Any]] = []
    recorded: list[serving_pb2.ChatMessage] = []
    texts: list[tuple[str, str]] = []
    for i, message in enumerate(request.messages):
        text = text_of(message.content)
        texts.append((f"messages[{i}].content", text))
        role = "system" if message.role == "developer" else message.role
        entry: dict[str, Any] = {"role": role, "content": text}
        record = serving_pb2.ChatMessage(role=message.role, content=text)
        if isinstance(message, AssistantMessage) and message.tool_calls:
            entry["tool_calls"] = []
            for j, call in enumerate(message.tool_calls):
                where = f"messages[{i}].tool_calls[{j}].function.arguments"
                arguments = _arguments(call.function.arguments, where)
                texts.append((where, call.function.arguments))
                entry["tool_calls"].append({"id": call.id, "type": "function",
                                            "function": {"name": call.function.name, "arguments": arguments}})
                record.tool_calls.append(serving_pb2.ToolCall(id=call.id, name=call.function.name,
                                                              arguments=call.function.arguments))
                called.add(call.id)
        if isinstance(message, ToolMessage):
            if message.tool_call_id not in called:
                raise ApiError(f"messages[{i}].tool_call_id: no earlier assistant message made a tool call with id "
                               f"{message.tool_call_id!r}", f"messages[{i}].tool_call_id")
            entry["tool_call_id"] = record.tool_call_id = message.tool_call_id
        rendered.append(entry)
        recorded.append(record)
    offered = None if choice == "none" else [tool.model_dump(exclude_none=True) for tool in request.tools or []]
    mode = None if offered is None else (choice.function.name if isinstance(choice, NamedToolChoice) else choice)
    return Conversation(rendered, recorded, offered or None, mode if offered else None, texts)


def _arguments(arguments: str, where: str) -> dict[str, Any]:
    try:
        value = json.loads(arguments)
    except ValueError as exc:
        raise ApiError(f"{where}: not JSON ({exc})", where) from None
    if not isinstance(value, dict):
        raise ApiError(f"{where}: a JSON object is expected, got {type(value).__name__}", where)
    return value


def _depth(value: Any, level: int = 0) -> int:
    """How deep a JSON value nests (iteratively bounded: stops counting past MAX_SCHEMA_DEPTH)."""
    if level > MAX_SCHEMA_DEPTH:
        return level
    if isinstance(value, dict):
        return max((_depth(v, level + 1) for v in value.values()), default=level + 1)
    if isinstance(value, list):
        return max((_depth(v, level + 1) for v in value), default=level + 1)
    return level
