"""`POST /v1/responses`, the Responses API (what the OpenAI Agents SDK calls by default), as far
as a stateless server can: the request's input items (messages, `function_call`,
`function_call_output`) and instructions become a chat conversation, sampled and recorded like a
chat exchange (endpoint "responses"); the answer's text and tool calls come back as output items.
Nothing is stored to be referred to later: `previous_response_id`, `conversation` and `prompt`
are refused naming the field, as are output formats other than text. `stream: true` answers the
Responses API's events (`response.created` … `response.output_text.delta` …
`response.function_call_arguments.done` … `response.completed`), written from the chat route's
streamed chunks: text as it completes, a tool call once the turn has ended."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Annotated, Any, Literal

from aiohttp import web
from pydantic import Field

from policyloop.serving.chat_request import (
    ChatRequest,
    FunctionDefinition,
    FunctionTool,
    NamedFunction,
    NamedToolChoice,
    _Strict,
    parse_request,
)
from policyloop.serving.errors import ApiError
from policyloop.serving.openai_api import StreamFormat
from policyloop.serving.sessions import session_of

if TYPE_CHECKING:
    from policyloop.serving.openai_api import Choice, OpenAIApi

ENDPOINT = "responses"


class TextContent(_Strict):
    type: Literal["input_text", "output_text", "text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class MessageItem(_Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[TextContent]
    id: str | None = None
    status: str | None = None


class FunctionCallItem(_Strict):
    type: Literal["function_call"]
    call_id: Annotated[str, Field(min_length=1)]
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(_Strict):
    type: Literal["function_call_output"]
    call_id: Annotated[str, Field(min_length=1)]
    output: str | list[TextContent]
    id: str | None = None
    status: str | None = None


InputItem = Annotated[MessageItem | FunctionCallItem | FunctionCallOutputItem, Field(union_mode="left_to_right")]


class ResponsesFunctionTool(_Strict):
    type: Literal["function"]
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ResponsesToolChoice(_Strict):
    type: Literal["function"]
    name: str


class TextFormat(_Strict):
    type: Literal["text"]


class TextSettings(_Strict):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ResponsesRequest(_Strict):
    model: str
    input: str | list[InputItem]
    instructions: str | None = None
    tools: list[ResponsesFunctionTool] | None = None
    tool_choice: Literal["auto", "none", "required"] | ResponsesToolChoice | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    metadata: dict[str, str] | None = None
    store: bool | None = None  # nothing is kept to be referred to: the flag changes nothing
    include: list[Literal["message.output_text.logprobs"]] | None = None
    text: TextSettings | None = None
    truncation: Literal["disabled"] | None = None
    user: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    stream: bool | None = None
    previous_response_id: None = None
    conversation: None = None
    prompt: None = None
    reasoning: None = None
    return_token_ids: bool = False


# What a stateless server cannot give, and why.
REFUSED = {
    "previous_response_id": "nothing is stored here: send the whole conversation as input",
    "conversation": "nothing is stored here: send the whole conversation as input",
    "prompt": "there are no stored prompts here: send instructions and input",
    "reasoning": "the model has no reasoning settings",
}


def refuse_unusable(body: Any) -> None:
    if isinstance(body, dict):
        for name, why in REFUSED.items():
            if body.get(name) not in (None, False):
                raise ApiError(f"{name}: {why}", name)


def chat_request(request: ResponsesRequest) -> ChatRequest:
    """The Responses request as the chat request it amounts to."""
    messages: list[dict[str, Any]] = []
    if request.instructions:
        messages.append({"role": "system", "content": request.instructions})
    items = [MessageItem(role="user", content=request.input)] if isinstance(request.input, str) else request.input
    for item in items:
        if isinstance(item, MessageItem):
            messages.append({"role": item.role, "content": _text(item.content)})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":  # one assistant turn: its text and its calls
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output)})
    tools = [FunctionTool(type="function", function=FunctionDefinition(
        name=t.name, description=t.description, parameters=t.parameters, strict=t.strict)) for t in request.tools or []]
    choice = request.tool_choice
    named = NamedToolChoice(type="function", function=NamedFunction(name=choice.name)) \
        if isinstance(choice, ResponsesToolChoice) else choice
    fields: dict[str, Any] = {"model": request.model, "messages": messages, "tools": tools or None,
                              "tool_choice": named, "max_completion_tokens": request.max_output_tokens,
                              "metadata": request.metadata, "user": request.user,
                              "return_token_ids": request.return_token_ids,
                              "logprobs": bool(request.include)}
    for name in ("temperature", "top_p", "parallel_tool_calls", "stream"):
        if getattr(request, name) is not None:
            fields[name] = getattr(request, name)
    return parse_request(ChatRequest, fields)


def _text(content: str | list[TextContent]) -> str:
    return content if isinstance(content, str) else "".join(part.text for part in content)


class ResponsesApi:
    def __init__(self, api: OpenAIApi) -> None:
        self.api = api

    async def handle(self, request: web.Request) -> web.Response:
        body = await self.api.body(request)
        refuse_unusable(body)
        parsed = parse_request(ResponsesRequest, body)
        self.api.check_model(parsed.model)
        chat = chat_request(parsed)
        prompt = self.api.chat_prompt(chat, session_of(request, chat), endpoint=ENDPOINT)
        if parsed.stream:
            return await self.api._stream(request, chat, prompt, ResponseEvents(self, parsed, len(prompt.ids)))
        [choice] = await self.api.sample(chat, prompt)
        return web.json_response(self.response(parsed, choice, len(prompt.ids)))

    def response(self, parsed: ResponsesRequest, choice: Choice, prompt_tokens: int) -> dict[str, Any]:
        trace = choice.trace
        output: list[dict[str, Any]] = []
        prose = choice.turn.content if choice.turn is not None and trace.response_tool_calls else trace.response_text
        if prose:
            part: dict[str, Any] = {"type": "output_text", "text": prose, "annotations": []}
            if parsed.include:
                part["logprobs"] = [{"token": self.api._piece(t), "logprob": lp, "bytes": [], "top_logprobs": []}
                                    for t, lp in zip(trace.response_token_ids, trace.response_logprobs, strict=True)]
            output.append({"type": "message", "id": message_id(trace.response_id), "role": "assistant",
                           "status": "completed", "content": [part]})
        for call in trace.response_tool_calls:
            output.append({"type": "function_call", "id": function_call_id(call.id), "call_id": call.id,
                           "name": call.name, "arguments": call.arguments, "status": "completed"})
        incomplete = trace.finish_reason == "length"
        completion = len(trace.response_token_ids)
        body = response_object(parsed, trace.response_id, "incomplete" if incomplete else "completed",
                               trace.created_unix_ms // 1000) | {
            "output": output, "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "usage": {"input_tokens": prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
                      "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": 0},
                      "total_tokens": prompt_tokens + completion},
            "system_fingerprint": f"weights-{trace.weights_version}", "completed_at": int(time.time()),
        }
        if parsed.return_token_ids:
            body["prompt_token_ids"] = list(trace.prompt_token_ids)
            body["token_ids"] = list(trace.response_token_ids)
        return body


def message_id(response_id: str) -> str:
    return f"msg_{response_id}"


def function_call_id(call_id: str) -> str:
    return f"fc_{call_id.removeprefix('call_')}"


def response_object(parsed: ResponsesRequest, response_id: str, status: str, created_at: int) -> dict[str, Any]:
    """The response object's fields that do not depend on the answer (what the request set)."""
    return {
        "id": f"resp_{response_id}", "object": "response", "created_at": created_at, "status": status,
        "model": parsed.model, "output": [], "incomplete_details": None, "error": None,
        "instructions": parsed.instructions, "metadata": parsed.metadata or {},
        "parallel_tool_calls": parsed.parallel_tool_calls is not False,
        "temperature": parsed.temperature, "top_p": parsed.top_p, "max_output_tokens": parsed.max_output_tokens,
        "tool_choice": parsed.tool_choice.model_dump() if isinstance(parsed.tool_choice, ResponsesToolChoice)
        else parsed.tool_choice or "auto",
        "tools": [t.model_dump(exclude_none=True) for t in parsed.tools or []],
        "text": {"format": {"type": "text"}}, "truncation": "disabled", "store": False, "usage": None,
    }


Event = tuple[str | None, dict[str, Any]]


class ResponseEvents(StreamFormat):
    """The Responses API's streamed events, from the chat chunks of the request's one choice: the
    response created and in progress; a message item whose text arrives as output_text deltas;
    each tool call a function_call item (its arguments in one delta, once the turn has ended); the
    whole response last, as the non-streamed route answers it (the same item ids)."""

    done_marker = False

    def __init__(self, api: ResponsesApi, parsed: ResponsesRequest, prompt_tokens: int) -> None:
        self.api, self.parsed, self.prompt_tokens = api, parsed, prompt_tokens
        self.response_id = ""
        self.sequence = 0
        self.items = 0          # output items opened
        self.text = ""          # the message item's text so far
        self.message: int | None = None  # the message item's output index while it is open

    def event(self, kind: str, **fields: Any) -> Event:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return kind, payload

    def opening(self, response_id: str) -> list[Event]:
        self.response_id = response_id
        created = response_object(self.parsed, response_id, "in_progress", int(time.time()))
        return [self.event("response.created", response=created), self.event("response.in_progress", response=created)]

    def chunk(self, chunk: dict[str, Any]) -> list[Event]:
        events: list[Event] = []
        for choice in chunk["choices"]:
            delta = choice["delta"]
            if delta.get("content"):
                events += self._open_message()
                self.text += delta["content"]
                events.append(self.event("response.output_text.delta", item_id=message_id(self.response_id),
                                         output_index=self.message, content_index=0, delta=delta["content"],
                                         logprobs=[]))
            if delta.get("tool_calls") or choice["finish_reason"] is not None:
                events += self._close_message()
            for call in delta.get("tool_calls") or ():
                events += self._function_call(call)
        return events

    def closing(self, choices: list[Choice]) -> list[Event]:
        [choice] = choices
        body = self.api.response(self.parsed, choice, self.prompt_tokens)
        kind = "response.incomplete" if body["status"] == "incomplete" else "response.completed"
        return [self.event(kind, response=body)]

    def error(self, message: str) -> list[Event]:
        return [self.event("error", code="server_error", message=message, param=None)]

    def _open_message(self) -> list[Event]:
        if self.message is not None:
            return []
        self.message, self.items = self.items, self.items + 1
        item = {"type": "message", "id": message_id(self.response_id), "role": "assistant",
                "status": "in_progress", "content": []}
        return [self.event("response.output_item.added", output_index=self.message, item=item),
                self.event("response.content_part.added", item_id=item["id"], output_index=self.message,
                           content_index=0, part={"type": "output_text", "text": "", "annotations": []})]

    def _close_message(self) -> list[Event]:
        if self.message is None:
            return []
        index, self.message = self.message, None
        item_id = message_id(self.response_id)
        part = {"type": "output_text", "text": self.text, "annotations": []}
        return [self.event("response.output_text.done", item_id=item_id, output_index=index, content_index=0,
                           text=self.text, logprobs=[]),
                self.event("response.content_part.done", item_id=item_id, output_index=index, content_index=0,
                           part=part),
                self.event("response.output_item.done", output_index=index, item={
                    "type": "message", "id": item_id, "role": "assistant", "status": "completed", "content": [part]})]

    def _function_call(self, call: dict[str, Any]) -> list[Event]:
        index, self.items = self.items, self.items + 1
        function = call["function"]
        item = {"type": "function_call", "id": function_call_id(call["id"]), "call_id": call["id"],
                "name": function["name"], "arguments": "", "status": "in_progress"}
        return [self.event("response.output_item.added", output_index=index, item=item),
                self.event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                           delta=function["arguments"]),
                self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                           name=function["name"], arguments=function["arguments"]),
                self.event("response.output_item.done", output_index=index,
                           item=item | {"arguments": function["arguments"], "status": "completed"})]
