"""`/v1/chat/completions`, `/v1/completions`, `/v1/responses`, `/v1/models` and `/v1/feedback`
over an engine.

The prompt is tokenized here (the model directory's chat template for chat, tools rendered into
it), sent to the engine as token ids, and the engine's output ids are what the caller gets decoded
and what the trace records: nothing is re-tokenized. A response's `<tool_call>` blocks become
`message.tool_calls` (a block that does not parse, or names a tool not offered, stays text);
`tool_choice` "required" or a named function starts the assistant's turn with the call's opening
(what is forced is prompt, not response). `n` choices are one batch on the engine; `stop` strings
end a choice there. Each choice is a trace on TRACES before the answer leaves, under the response's
id (`<id>-<i>` for choice i > 0), which is what `/v1/feedback` takes; an agent session (header
X-Session-Id or metadata.session_id) groups a run's exchanges and keeps their tokens continuous
(sessions.py). Errors have OpenAI's shape, and every limit the engine would enforce is checked
before it is asked, so a refusal is a 4xx that names the field, before any streamed answer begins."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import nats.js.errors
from aiohttp import web

from policyloop.bus import Bus
from policyloop.bus.topology import feedback_subject, trace_subject
from policyloop.contracts.v1 import serving_pb2
from policyloop.engines.embedded.sampling import first_stop
from policyloop.engines.protocol import GenerateRequest, GenerateResult, SamplingParams, WeightVersionSpan
from policyloop.engines.sglang_client import EngineError, EngineProtocolError, SGLangClient, StreamedTokens
from policyloop.models.chat_format import TOOL_CALL_OPEN, AssistantTurn, parse_assistant
from policyloop.rl.batching import ModelLimits
from policyloop.serving.chat_request import (
    ChatRequest,
    CompletionRequest,
    Conversation,
    SamplingRequest,
    conversation,
    parse_request,
)
from policyloop.serving.errors import ApiError
from policyloop.serving.limits import check_vocabulary, limits_of, new_tokens, refuse_unknown_characters
from policyloop.serving.sessions import SessionTokens, session_of
from policyloop.telemetry.logging import get_logger

if TYPE_CHECKING:
    from policyloop.engines.adapters import AdapterLease

log = get_logger(__name__)

TRACES_STREAM = "TRACES"
MAX_BODY_BYTES = 8 * 1024 * 1024
CHAT, COMPLETIONS = "chat.completions", "completions"
_T = TypeVar("_T")


async def _resumed(first: _T, rest: AsyncIterator[_T]) -> AsyncIterator[_T]:
    """`first`, already taken from `rest`, then the rest."""
    yield first
    async for item in rest:
        yield item


def relabelled(result: GenerateResult, lease: AdapterLease | None) -> GenerateResult:
    """An answer sampled with a LoRA run's adapter carries the adapter's version (the engine
    reports the base's), over every token."""
    if lease is None:
        return result
    version = str(lease.version)
    return result.model_copy(update={"weight_version": version, "weight_versions": [
        WeightVersionSpan(version=version, start=0, end=len(result.output_ids))]})


def choice_trace_id(response_id: str, index: int) -> str:
    return response_id if index == 0 else f"{response_id}-{index}"


def forced_opening(tool_choice: str | None) -> str:
    """What the assistant's turn starts with when a call is required: the call's opening, and its
    function's name when one is named ("" when the model may answer in text)."""
    if tool_choice in (None, "auto"):
        return ""
    if tool_choice == "required":
        return f"{TOOL_CALL_OPEN}\n"
    return f'{TOOL_CALL_OPEN}\n{{"name": {json.dumps(tool_choice)}, "arguments": '


@dataclass
class Prompt:
    """A request's prompt: the ids the engine reads, and for chat what it takes to read the answer."""
    ids: list[int]
    endpoint: str
    session: str = ""
    conversation: Conversation | None = None
    opening: str = ""  # forced start of the assistant's turn (part of the prompt)

    @property
    def tool_names(self) -> frozenset[str]:
        tools = self.conversation.tools if self.conversation is not None else None
        return frozenset(t["function"]["name"] for t in tools or [])


@dataclass
class Choice:
    index: int
    trace: serving_pb2.Trace
    result: GenerateResult
    turn: AssistantTurn | None  # chat: the answer read for tool calls


class OpenAIApi:
    """`adapter`: for a LoRA run, the adapter to sample each request with, held while it runs
    (yields None while the run serves its base); None: the engine's own weights serve.
    `limits`: the model's context and vocabulary; None: read from the config.json beside the
    tokenizer (the model directory it was loaded from)."""

    def __init__(self, engine: SGLangClient, tokenizer: Any, bus: Bus, served_model: str,
                 adapter: Callable[[], AbstractAsyncContextManager[AdapterLease | None]] | None = None,
                 limits: ModelLimits | None = None) -> None:
        self.engine, self.tokenizer, self.bus, self.served_model = engine, tokenizer, bus, served_model
        self.adapter = adapter or (lambda: contextlib.nullcontext(None))
        self.limits = limits if limits is not None else limits_of(getattr(tokenizer, "name_or_path", "") or ".")
        self.sessions = SessionTokens()
        if self.limits.context_tokens is None:
            log.warning("openai_context_unknown", tokenizer=getattr(tokenizer, "name_or_path", None))

    def app(self) -> web.Application:
        from policyloop.serving.responses_api import ResponsesApi

        app = web.Application(middlewares=[self._errors], client_max_size=MAX_BODY_BYTES)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/responses", ResponsesApi(self).handle)
        app.router.add_post("/v1/feedback", self._feedback)
        return app

    @web.middleware
    async def _errors(self, request: web.Request, handler: Any) -> web.StreamResponse:
        try:
            return await handler(request)
        except ApiError as exc:
            return exc.response()
        except web.HTTPRequestEntityTooLarge:
            return ApiError(f"body: larger than {MAX_BODY_BYTES} bytes", "body", 413).response()
        except EngineError as exc:
            # The engine's 400 is a refusal of what the client sent (a limit the endpoint could not
            # check up front); anything else is the engine failing.
            if exc.status == 400:
                return ApiError(f"the engine refused the request: {exc}").response()
            return ApiError(f"the engine refused the request: {exc}", status=502, kind="server_error").response()
        except web.HTTPException:
            raise
        except Exception as exc:  # noqa: BLE001 - a template that fails to render, the bus: OpenAI's shape still
            log.exception("openai_request_failed", path=request.path)
            return ApiError(f"the request failed: {exc!r}", status=500, kind="server_error").response()

    async def body(self, request: web.Request) -> Any:
        try:
            return await request.json()
        except (ValueError, RecursionError) as exc:
            raise ApiError(f"body: not JSON ({str(exc)[:200] or type(exc).__name__})", "body") from None

    async def _models(self, _: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": self.served_model, "object": "model", "created": 0, "owned_by": "policyloop"}]})

    def check_model(self, name: str) -> None:
        if name != self.served_model:
            raise ApiError(f"model: this endpoint serves {self.served_model!r}, not {name!r}", "model", 404,
                           "not_found_error")

    # -- the routes -----------------------------------------------------------------------------

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        parsed = parse_request(CompletionRequest, await self.body(request))
        self.check_model(parsed.model)
        if isinstance(parsed.prompt, str):
            ids = self._encode(parsed.prompt, [("prompt", parsed.prompt)])
        else:
            ids = list(parsed.prompt)
            check_vocabulary(self.limits, ids, "prompt")
        prompt = Prompt(ids, COMPLETIONS, session_of(request, parsed))
        if parsed.stream:
            return await self._stream(request, parsed, prompt)
        choices = await self.sample(parsed, prompt)
        body = []
        for choice in choices:
            entry: dict[str, Any] = {"index": choice.index, "text": choice.trace.response_text,
                                     "finish_reason": choice.trace.finish_reason, "logprobs": None}
            if parsed.logprobs is not None:
                entry["logprobs"] = {"tokens": [self._piece(t) for t in choice.trace.response_token_ids],
                                     "token_logprobs": list(choice.result.output_logprobs or []),
                                     "top_logprobs": None, "text_offset": None}
            body.append(self._with_token_ids(parsed, entry, choice))
        return web.json_response(self._answer(parsed, prompt, choices, "text_completion", body))

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        parsed = parse_request(ChatRequest, await self.body(request))
        self.check_model(parsed.model)
        prompt = self.chat_prompt(parsed, session_of(request, parsed))
        if parsed.stream:
            return await self._stream(request, parsed, prompt)
        choices = await self.sample(parsed, prompt)
        body = []
        for choice in choices:
            entry: dict[str, Any] = {"index": choice.index, "message": self._message(choice),
                                     "finish_reason": choice.trace.finish_reason, "logprobs": None}
            if parsed.logprobs:
                entry["logprobs"] = {"content": [
                    {"token": self._piece(t), "logprob": lp, "bytes": None, "top_logprobs": []}
                    for t, lp in zip(choice.trace.response_token_ids, choice.result.output_logprobs or [],
                                     strict=True)]}
            body.append(self._with_token_ids(parsed, entry, choice))
        return web.json_response(self._answer(parsed, prompt, choices, "chat.completion", body))

    # -- prompts --------------------------------------------------------------------------------

    def chat_prompt(self, parsed: ChatRequest, session: str, endpoint: str = CHAT) -> Prompt:
        """The conversation through the chat template (tools in it), as ids continuing the session's."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise ApiError("messages: the model directory has no chat template (use /v1/completions)", "messages")
        conv = conversation(parsed)
        opening = forced_opening(conv.tool_choice)
        text = self.tokenizer.apply_chat_template(conv.template_messages, tools=conv.tools,
                                                  add_generation_prompt=True, tokenize=False) + opening
        ids = self.sessions.prompt_ids(session, text,
                                       lambda rest: self._encode(rest, [*conv.texts, ("messages", rest)]))
        return Prompt(ids, endpoint, session, conv, opening)

    def _encode(self, text: str, parts: list[tuple[str, str]]) -> list[int]:
        """text's token ids; refused when the tokenizer has no token for some of its characters,
        naming the first of `parts` (param, text) that holds them."""
        ids = list(self.tokenizer(text, add_special_tokens=False).input_ids)
        if self.tokenizer.decode(ids, skip_special_tokens=False) != text:  # else nothing was lost
            refuse_unknown_characters(self.tokenizer, parts)
        return ids

    def _piece(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    # -- sampling -------------------------------------------------------------------------------

    def _engine_requests(self, parsed: SamplingRequest, prompt: Prompt, response_id: str,
                         lease: AdapterLease | None) -> list[GenerateRequest]:
        param = "messages" if prompt.conversation is not None else "prompt"
        if not prompt.ids:
            raise ApiError(f"{param}: empty", param)
        if parsed.max_completion_tokens is not None:
            requested: tuple[str, int] | None = ("max_completion_tokens", parsed.max_completion_tokens)
        elif parsed.max_tokens is not None:
            requested = ("max_tokens", parsed.max_tokens)
        else:
            requested = None
        params = SamplingParams(max_new_tokens=new_tokens(self.limits, len(prompt.ids), param, requested),
                                temperature=parsed.temperature, top_p=parsed.top_p, stop=parsed.stop_strings())
        requests = []
        for i in range(parsed.n):
            seeded = params if parsed.seed is None else params.model_copy(update={"sampling_seed": parsed.seed + i})
            requests.append(GenerateRequest(input_ids=prompt.ids, rid=choice_trace_id(response_id, i),
                                            return_logprob=True, sampling_params=seeded,
                                            lora_path=lease.name if lease is not None else None))
        return requests

    async def sample(self, parsed: SamplingRequest, prompt: Prompt) -> list[Choice]:
        """The request's n choices, sampled together on the engine, each recorded."""
        response_id = uuid.uuid4().hex
        async with self.adapter() as lease:
            requests = self._engine_requests(parsed, prompt, response_id, lease)
            results = [await self.engine.generate(requests[0])] if len(requests) == 1 else \
                await self.engine.generate_batch(requests)
        return [await self._record(parsed, prompt, response_id, i, relabelled(result, lease))
                for i, result in enumerate(results)]

    def _response_text(self, result: GenerateResult) -> str:
        text = self.tokenizer.decode(result.output_ids, skip_special_tokens=True)
        matched = result.finish_detail.matched if result.finish_detail is not None else None
        if isinstance(matched, str) and matched in text:
            text = text[:text.find(matched)]
        return text

    def _read_turn(self, prompt: Prompt, text: str) -> AssistantTurn | None:
        """The answer's tool calls, when tools were offered and every call names one of them."""
        if prompt.conversation is None or prompt.conversation.tool_choice is None:
            return None
        turn = parse_assistant(prompt.opening + text)
        if any(call.name not in prompt.tool_names for call in turn.tool_calls):
            return AssistantTurn(content=prompt.opening + text, tool_calls=())
        return turn

    async def _record(self, parsed: SamplingRequest, prompt: Prompt, response_id: str, index: int,
                      result: GenerateResult) -> Choice:
        """The choice as a Trace on TRACES (stored before the answer, or its last chunk, leaves)."""
        text = self._response_text(result)
        turn = self._read_turn(prompt, text)
        calls = turn.tool_calls if turn is not None else ()
        finish = "length" if result.finish_reason == "length" else "tool_calls" if calls else "stop"
        matched = result.finish_detail.matched if result.finish_detail is not None else None
        conv = prompt.conversation
        trace = serving_pb2.Trace(
            trace_id=choice_trace_id(response_id, index), response_id=response_id, choice_index=index,
            model=self.served_model, endpoint=prompt.endpoint, session_id=prompt.session,
            messages=conv.recorded if conv is not None else [],
            tools_json=json.dumps(conv.tools) if conv is not None and conv.tools else "",
            prompt_text=self.tokenizer.decode(prompt.ids, skip_special_tokens=False),
            prompt_token_ids=prompt.ids, response_token_ids=result.output_ids,
            response_logprobs=result.output_logprobs or [], response_text=text, finish_reason=finish,
            stop_matched=matched if isinstance(matched, str) else "",
            response_tool_calls=[serving_pb2.ToolCall(id=f"call_{uuid.uuid4().hex[:24]}", name=c.name,
                                                      arguments=c.arguments_json()) for c in calls],
            weights_version=result.weight_version, created_unix_ms=int(time.time() * 1000),
            temperature=parsed.temperature,
            weights_spans=[serving_pb2.WeightsSpan(version=s.version, start=s.start, end=s.end)
                           for s in result.weight_versions or []])
        await self.bus.publish(trace_subject(self.served_model, trace.trace_id), trace, f"trace-{trace.trace_id}")
        if index == 0:
            full = [*prompt.ids, *result.output_ids]
            self.sessions.remember(prompt.session, full, self.tokenizer.decode(full, skip_special_tokens=False))
        return Choice(index, trace, result, turn)

    # -- answers --------------------------------------------------------------------------------

    @staticmethod
    def _message(choice: Choice) -> dict[str, Any]:
        trace = choice.trace
        if not trace.response_tool_calls:
            return {"role": "assistant", "content": trace.response_text}
        content = choice.turn.content if choice.turn is not None else None
        return {"role": "assistant", "content": content, "tool_calls": [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in trace.response_tool_calls]}

    @staticmethod
    def _with_token_ids(parsed: SamplingRequest, entry: dict[str, Any], choice: Choice) -> dict[str, Any]:
        if parsed.return_token_ids:
            entry["token_ids"] = list(choice.trace.response_token_ids)
        return entry

    def _answer(self, parsed: SamplingRequest, prompt: Prompt, choices: list[Choice], kind: str,
                body: list[dict[str, Any]]) -> dict[str, Any]:
        first = choices[0].trace
        prefix = "chatcmpl" if kind.startswith("chat") else "cmpl"
        answer = {"id": f"{prefix}-{first.response_id}", "object": kind, "created": first.created_unix_ms // 1000,
                  "model": first.model, "choices": body, "system_fingerprint": f"weights-{first.weights_version}",
                  "usage": usage(prompt, choices)}
        if parsed.return_token_ids:
            answer["prompt_token_ids"] = list(prompt.ids)
        return answer

    # -- streaming ------------------------------------------------------------------------------

    async def _stream(self, request: web.Request, parsed: SamplingRequest, prompt: Prompt,
                      form: StreamFormat | None = None) -> web.StreamResponse:
        """stream: server-sent events in OpenAI's chunk shapes, a chunk per engine step that
        completes text, choices interleaved; each choice's trace is stored before its last chunk,
        then [DONE]. `form` writes the chunks as another API's events (the Responses API's)."""
        form = form or StreamFormat()
        response_id = uuid.uuid4().hex
        async with self.adapter() as lease, contextlib.AsyncExitStack() as stack:
            streams = []
            for engine_request in self._engine_requests(parsed, prompt, response_id, lease):
                events = await stack.enter_async_context(
                    contextlib.aclosing(self.engine.generate_stream(engine_request)))
                # Each choice's first event before the 200: a refusal by the engine is an HTTP error then.
                first = await anext(events, None)
                if first is None:
                    raise EngineProtocolError("POST /generate: the stream ended before the answer")
                streams.append(_resumed(first, events))
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
            await response.prepare(request)
            lock = asyncio.Lock()

            async def write(events: list[tuple[str | None, dict[str, Any]]]) -> None:
                async with lock:
                    for name, payload in events:
                        await response.write((f"event: {name}\n" if name else "").encode() + b"data: "
                                             + json.dumps(payload).encode() + b"\n\n")

            async def send(chunk: dict[str, Any]) -> None:
                await write(form.chunk(chunk))

            await write(form.opening(response_id))
            writer = _ChunkWriter(self, parsed, prompt, response_id, send)
            try:
                choices = await asyncio.gather(*(writer.choice(i, events, lease) for i, events in enumerate(streams)))
                await writer.usage(list(choices))
                await write(form.closing(list(choices)))
            except EngineError as exc:
                await write(form.error(f"the engine failed: {exc}"))
            if form.done_marker:
                await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
            return response

    async def _feedback(self, request: web.Request) -> web.Response:
        """{"id": <a response id> | "session_id": <a session>, "choice"?: int, "reward"?: number,
        "label"?: str, "correction"?: str}."""
        body = await self.body(request)
        if not isinstance(body, dict):
            raise ApiError("body: a JSON object is expected", "body")
        feedback = serving_pb2.TraceFeedback(feedback_id=uuid.uuid4().hex, created_unix_ms=int(time.time() * 1000))
        if isinstance(body.get("session_id"), str) and "id" not in body:
            feedback.session_id = body["session_id"]
            subject = feedback_subject(self.served_model, f"session-{feedback.session_id}")
        else:
            if not isinstance(body.get("id"), str):
                raise ApiError("id: the id of a response this endpoint gave (or a session_id) is required", "id")
            choice = body.get("choice", 0)
            if not isinstance(choice, int) or isinstance(choice, bool) or choice < 0:
                raise ApiError(f"choice: a choice's index, got {choice!r}", "choice")
            response_id = body["id"].removeprefix("chatcmpl-").removeprefix("cmpl-").removeprefix("resp_")
            feedback.trace_id = choice_trace_id(response_id, choice)
            try:
                await self.bus.js.get_last_msg(TRACES_STREAM, trace_subject(self.served_model, feedback.trace_id))
            except (nats.js.errors.NotFoundError, ValueError):  # no such trace, or an id that is no subject token
                raise ApiError(f"id: no trace {body['id']!r}" + (f" with choice {choice}" if choice else ""), "id",
                               404, "not_found_error") from None
            subject = feedback_subject(self.served_model, feedback.trace_id)
        reward = body.get("reward")
        if reward is not None:
            if not isinstance(reward, int | float) or isinstance(reward, bool):
                raise ApiError(f"reward: a number, got {reward!r}", "reward")
            feedback.reward = float(reward)
        for name in ("label", "correction"):
            value = body.get(name)
            if value is not None and not isinstance(value, str):
                raise ApiError(f"{name}: a string, got {value!r}", name)
            setattr(feedback, name, value or "")
        if reward is None and not feedback.label and not feedback.correction:
            raise ApiError("give a reward, a label or a correction")
        await self.bus.publish(subject, feedback, f"feedback-{feedback.feedback_id}")
        return web.json_response({"id": feedback.feedback_id, "trace_id": feedback.trace_id,
                                  "session_id": feedback.session_id, "object": "feedback"})


def usage(prompt: Prompt, choices: list[Choice]) -> dict[str, int]:
    completion = sum(len(c.trace.response_token_ids) for c in choices)
    return {"prompt_tokens": len(prompt.ids), "completion_tokens": completion,
            "total_tokens": len(prompt.ids) + completion}


def held_back(text: str, prefixes: tuple[str, ...]) -> int:
    """How many characters at the end of `text` could begin one of `prefixes` (not to be sent yet)."""
    longest = 0
    for prefix in prefixes:
        for size in range(min(len(prefix), len(text)), longest, -1):
            if prefix.startswith(text[-size:]):
                longest = size
                break
    return longest


class StreamFormat:
    """How a streamed answer's chat chunks go out: as they are (chat and text completions), or, in
    a subclass, as another API's events. Each method returns (SSE event name or None, payload)s."""

    done_marker = True  # a last `data: [DONE]`

    def opening(self, response_id: str) -> list[tuple[str | None, dict[str, Any]]]:
        return []

    def chunk(self, chunk: dict[str, Any]) -> list[tuple[str | None, dict[str, Any]]]:
        return [(None, chunk)]

    def closing(self, choices: list[Choice]) -> list[tuple[str | None, dict[str, Any]]]:
        return []

    def error(self, message: str) -> list[tuple[str | None, dict[str, Any]]]:
        return [(None, {"error": {"message": message, "type": "server_error", "param": None, "code": None}})]


class _ChunkWriter:
    """Writes each choice's chunks: text as it completes, except what may yet be a stop string or
    a tool call's opening (held back until it is known); a choice's tool calls as
    `delta.tool_calls` once it ends."""

    def __init__(self, api: OpenAIApi, parsed: SamplingRequest, prompt: Prompt, response_id: str,
                 send: Callable[[dict[str, Any]], Awaitable[None]]) -> None:
        self.api, self.parsed, self.prompt, self.response_id, self.send = api, parsed, prompt, response_id, send
        self.chat = prompt.endpoint != COMPLETIONS
        asked = getattr(parsed, "logprobs", None)
        self.want_logprobs = asked is True if self.chat else asked is not None  # completions: logprobs 0
        self.created = int(time.time())
        self.version = ""
        self.tools = prompt.conversation is not None and prompt.conversation.tool_choice is not None
        self.stops = parsed.stop_strings()

    def chunk(self, index: int, delta: dict[str, Any] | str, ids: list[int], logprobs: list[float],
              finish: str | None) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": index, "finish_reason": finish, "logprobs": None}
        if self.chat:
            choice["delta"] = delta
            if self.want_logprobs:
                choice["logprobs"] = {"content": [{"token": self.api._piece(t), "logprob": lp, "bytes": None,
                                                   "top_logprobs": []} for t, lp in zip(ids, logprobs, strict=True)]}
        else:
            choice["text"] = delta
            if self.want_logprobs:
                choice["logprobs"] = {"tokens": [self.api._piece(t) for t in ids], "token_logprobs": logprobs,
                                      "top_logprobs": None, "text_offset": None}
        if self.parsed.return_token_ids:
            choice["token_ids"] = ids
        chunk = {"id": f"{'chatcmpl' if self.chat else 'cmpl'}-{self.response_id}",
                 "object": "chat.completion.chunk" if self.chat else "text_completion", "created": self.created,
                 "model": self.api.served_model, "system_fingerprint": f"weights-{self.version}", "choices": [choice]}
        if self.parsed.return_token_ids and not ids and finish is None:
            chunk["prompt_token_ids"] = list(self.prompt.ids)
        return chunk

    def visible(self, text: str) -> str:
        """The part of `text` that can be sent now."""
        if self.prompt.opening:
            return ""  # a forced call: nothing is prose until it has been read
        found = first_stop(text, self.stops) if self.stops else None
        if found is not None:
            text = text[:found[0]]
        if self.tools and TOOL_CALL_OPEN in text:
            text = text[:text.find(TOOL_CALL_OPEN)]
        holds = (*self.stops, *((TOOL_CALL_OPEN,) if self.tools else ()))
        return text[:len(text) - held_back(text, holds)] if holds else text

    async def choice(self, index: int, events: AsyncIterator[StreamedTokens | GenerateResult],
                     lease: AdapterLease | None) -> Choice:
        sent_text, sent_ids = "", 0
        if self.chat:  # the role first, as OpenAI does (with the prompt's ids when asked for)
            await self.send(self.chunk(index, {"role": "assistant", "content": ""}, [], [], None))
        async for event in events:
            self.version = str(lease.version) if lease is not None else event.weight_version
            if isinstance(event, GenerateResult):
                return await self._last(index, relabelled(event, lease), sent_text, sent_ids)
            text = self.api.tokenizer.decode(event.output_ids, skip_special_tokens=True)
            if text.endswith("\ufffd"):
                continue  # a character cut in two: wait for the rest of its bytes
            shown = self.visible(text)
            if not shown.startswith(sent_text) or shown == sent_text:
                continue  # nothing new to show yet: its ids go with the next chunk
            new_ids = event.output_ids[sent_ids:]
            new_logprobs = list((event.output_logprobs or [])[sent_ids:])
            delta = shown[len(sent_text):]
            await self.send(self.chunk(index, {"content": delta} if self.chat else delta, new_ids, new_logprobs, None))
            sent_text, sent_ids = shown, len(event.output_ids)
        raise EngineProtocolError("POST /generate: the stream ended before the answer")

    async def _last(self, index: int, final: GenerateResult, sent_text: str, sent_ids: int) -> Choice:
        choice = await self.api._record(self.parsed, self.prompt, self.response_id, index, final)
        trace = choice.trace
        new_ids = list(final.output_ids[sent_ids:])
        new_logprobs = list((final.output_logprobs or [])[sent_ids:])
        if trace.response_tool_calls:
            calls = [{"index": i, "id": c.id, "type": "function",
                      "function": {"name": c.name, "arguments": c.arguments}}
                     for i, c in enumerate(trace.response_tool_calls)]
            await self.send(self.chunk(index, {"tool_calls": calls}, new_ids, new_logprobs, trace.finish_reason))
            return choice
        text = (self.prompt.opening + trace.response_text) if self.prompt.opening else trace.response_text
        rest = text[len(sent_text):] if text.startswith(sent_text) else text
        await self.send(self.chunk(index, {"content": rest} if self.chat else rest, new_ids, new_logprobs,
                                   trace.finish_reason))
        return choice

    async def usage(self, choices: list[Choice]) -> None:
        options = self.parsed.stream_options
        if options is not None and options.include_usage:
            last = self.chunk(0, "", [], [], None) | {"choices": [], "usage": usage(self.prompt, choices)}
            last.pop("prompt_token_ids", None)
            await self.send(last)
