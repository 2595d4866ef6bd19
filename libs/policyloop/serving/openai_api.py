"""`/v1/chat/completions`, `/v1/completions`, `/v1/models` and `/v1/feedback` over an engine.

The prompt is tokenized here (the chat template of the model directory for chat), sent to the
engine as token ids, and the engine's output ids are what the caller gets decoded and what the
trace records: nothing is re-tokenized. A trace is on TRACES before the answer leaves, under
the response's id, which is what `/v1/feedback` takes. Errors have OpenAI's shape, and every
limit the engine would enforce (the context, the vocabulary) is checked before it is asked, so a
refusal is a 400 that names the field, before any streamed answer begins (limits.py)."""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import nats.js.errors
from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from policyloop.bus import Bus
from policyloop.bus.topology import feedback_subject, trace_subject
from policyloop.contracts.v1 import serving_pb2
from policyloop.engines.protocol import GenerateRequest, GenerateResult, SamplingParams, WeightVersionSpan
from policyloop.engines.sglang_client import EngineError, EngineProtocolError, SGLangClient, StreamedTokens
from policyloop.rl.batching import ModelLimits
from policyloop.serving.errors import ApiError
from policyloop.serving.limits import check_vocabulary, limits_of, new_tokens, refuse_unknown_characters
from policyloop.telemetry.logging import get_logger

if TYPE_CHECKING:
    from policyloop.engines.adapters import AdapterLease

log = get_logger(__name__)

TRACES_STREAM = "TRACES"
_T = TypeVar("_T")


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False


class _Sampling(BaseModel):
    """The sampling fields both endpoints take (others OpenAI defines are refused by name)."""

    model_config = ConfigDict(extra="forbid")

    model: str
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    seed: int | None = Field(None, ge=0)
    n: Literal[1] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None


class ChatRequest(_Sampling):
    messages: list[dict[str, Any]] = Field(min_length=1)
    logprobs: bool = False


class CompletionRequest(_Sampling):
    prompt: str | list[int]
    logprobs: int | None = Field(None, ge=0, le=0)  # the sampled token's logprob only


def _parse(model: type[BaseModel], body: Any) -> Any:
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        error = exc.errors(include_url=False)[0]
        param = ".".join(str(p) for p in error["loc"]) or None
        hint = {"n": " (one choice per request)"}.get(param or "", "")
        raise ApiError(f"{param}: {error['msg']}{hint}", param) from None


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
        if self.limits.context_tokens is None:
            log.warning("openai_context_unknown", tokenizer=getattr(tokenizer, "name_or_path", None))

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._errors])
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/feedback", self._feedback)
        return app

    @web.middleware
    async def _errors(self, request: web.Request, handler: Any) -> web.StreamResponse:
        try:
            return await handler(request)
        except ApiError as exc:
            return exc.response()
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

    async def _body(self, request: web.Request) -> Any:
        try:
            return await request.json()
        except ValueError as exc:
            raise ApiError(f"body: not JSON ({exc})") from None

    async def _models(self, _: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": self.served_model, "object": "model", "created": 0, "owned_by": "policyloop"}]})

    def _check_model(self, name: str) -> None:
        if name != self.served_model:
            raise ApiError(f"model: this endpoint serves {self.served_model!r}, not {name!r}", "model", 404,
                           "not_found_error")

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        parsed: CompletionRequest = _parse(CompletionRequest, await self._body(request))
        self._check_model(parsed.model)
        if isinstance(parsed.prompt, str):
            prompt_ids = self._encode(parsed.prompt, [("prompt", parsed.prompt)])
        else:
            prompt_ids = list(parsed.prompt)
            check_vocabulary(self.limits, prompt_ids, "prompt")
        if parsed.stream:
            return await self._stream(request, parsed, prompt_ids, "completions", [])
        trace, result = await self._generate(parsed, prompt_ids, "completions", [])
        choice: dict[str, Any] = {"index": 0, "text": trace.response_text, "finish_reason": trace.finish_reason,
                                  "logprobs": None}
        if parsed.logprobs is not None:
            choice["logprobs"] = {"tokens": [self._piece(t) for t in trace.response_token_ids],
                                  "token_logprobs": list(result.output_logprobs or []), "top_logprobs": None,
                                  "text_offset": None}
        return web.json_response(self._answer(trace, "text_completion", choice))

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        parsed: ChatRequest = _parse(ChatRequest, await self._body(request))
        self._check_model(parsed.model)
        messages = []
        for i, message in enumerate(parsed.messages):
            role, content = message.get("role"), message.get("content")
            if not isinstance(role, str) or not isinstance(content, str):
                raise ApiError(f"messages[{i}]: a role and a text content are required", f"messages.{i}")
            messages.append(serving_pb2.ChatMessage(role=role, content=content))
        if not getattr(self.tokenizer, "chat_template", None):
            raise ApiError("messages: the model directory has no chat template (use /v1/completions)", "messages")
        prompt_text = self.tokenizer.apply_chat_template([{"role": m.role, "content": m.content} for m in messages],
                                                         add_generation_prompt=True, tokenize=False)
        contents = [(f"messages[{i}].content", m.content) for i, m in enumerate(messages)]
        prompt_ids = self._encode(prompt_text, [*contents, ("messages", prompt_text)])  # else: the template's text
        if parsed.stream:
            return await self._stream(request, parsed, prompt_ids, "chat.completions", messages)
        trace, result = await self._generate(parsed, prompt_ids, "chat.completions", messages)
        choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": trace.response_text},
                                  "finish_reason": trace.finish_reason, "logprobs": None}
        if parsed.logprobs:
            choice["logprobs"] = {"content": [
                {"token": self._piece(t), "logprob": lp, "bytes": None, "top_logprobs": []}
                for t, lp in zip(trace.response_token_ids, result.output_logprobs or [], strict=True)]}
        return web.json_response(self._answer(trace, "chat.completion", choice))

    def _encode(self, text: str, parts: list[tuple[str, str]]) -> list[int]:
        """text's token ids; refused when the tokenizer has no token for some of its characters,
        naming the first of `parts` (param, text) that holds them."""
        ids = list(self.tokenizer(text, add_special_tokens=False).input_ids)
        if self.tokenizer.decode(ids, skip_special_tokens=False) != text:  # else nothing was lost
            refuse_unknown_characters(self.tokenizer, parts)
        return ids

    def _piece(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _max_new_tokens(self, parsed: _Sampling, prompt_len: int, prompt_param: str) -> int | None:
        """The client's limit when it fits the context beside the prompt (newer clients send
        max_completion_tokens, older ones max_tokens), or the room the prompt leaves."""
        if parsed.max_completion_tokens is not None:
            requested: tuple[str, int] | None = ("max_completion_tokens", parsed.max_completion_tokens)
        elif parsed.max_tokens is not None:
            requested = ("max_tokens", parsed.max_tokens)
        else:
            requested = None
        return new_tokens(self.limits, prompt_len, prompt_param, requested)

    def _engine_request(self, parsed: _Sampling, prompt_ids: list[int], trace_id: str,
                        lease: AdapterLease | None) -> GenerateRequest:
        prompt_param = "messages" if isinstance(parsed, ChatRequest) else "prompt"
        if not prompt_ids:
            raise ApiError(f"{prompt_param}: empty", prompt_param)
        max_tokens = self._max_new_tokens(parsed, len(prompt_ids), prompt_param)
        params = SamplingParams(max_new_tokens=max_tokens, temperature=parsed.temperature, top_p=parsed.top_p)
        if parsed.seed is not None:
            params = params.model_copy(update={"sampling_seed": parsed.seed})
        return GenerateRequest(input_ids=prompt_ids, rid=trace_id, return_logprob=True, sampling_params=params,
                               lora_path=lease.name if lease is not None else None)

    async def _generate(self, parsed: _Sampling, prompt_ids: list[int], endpoint: str,
                        messages: list[serving_pb2.ChatMessage]) -> tuple[serving_pb2.Trace, GenerateResult]:
        trace_id = uuid.uuid4().hex
        async with self.adapter() as lease:
            result = await self.engine.generate(self._engine_request(parsed, prompt_ids, trace_id, lease))
        result = relabelled(result, lease)
        return await self._record(parsed, prompt_ids, endpoint, messages, trace_id, result), result

    async def _record(self, parsed: _Sampling, prompt_ids: list[int], endpoint: str,
                      messages: list[serving_pb2.ChatMessage], trace_id: str,
                      result: GenerateResult) -> serving_pb2.Trace:
        """The exchange as a Trace on TRACES (stored before the answer, or its last chunk, leaves)."""
        trace = serving_pb2.Trace(
            trace_id=trace_id, model=self.served_model, endpoint=endpoint, messages=messages,
            prompt_text=self.tokenizer.decode(prompt_ids, skip_special_tokens=False),
            prompt_token_ids=prompt_ids, response_token_ids=result.output_ids,
            response_logprobs=result.output_logprobs or [],
            response_text=self.tokenizer.decode(result.output_ids, skip_special_tokens=True),
            finish_reason="length" if result.finish_reason == "length" else "stop",
            weights_version=result.weight_version, created_unix_ms=int(time.time() * 1000),
            temperature=parsed.temperature,
            weights_spans=[serving_pb2.WeightsSpan(version=s.version, start=s.start, end=s.end)
                           for s in result.weight_versions or []])
        await self.bus.publish(trace_subject(self.served_model, trace_id), trace, f"trace-{trace_id}")
        return trace

    async def _stream(self, request: web.Request, parsed: _Sampling, prompt_ids: list[int], endpoint: str,
                      messages: list[serving_pb2.ChatMessage]) -> web.StreamResponse:
        """stream: server-sent events in OpenAI's chunk shapes, a chunk per engine step that
        completes text; the trace is stored before the last chunk, then [DONE]."""
        trace_id = uuid.uuid4().hex
        async with self.adapter() as lease:
            engine_request = self._engine_request(parsed, prompt_ids, trace_id, lease)
            async with contextlib.aclosing(self.engine.generate_stream(engine_request)) as events:
                # The engine's first event before the 200: a refusal by the engine is an HTTP error then.
                first = await anext(events, None)
                if first is None:
                    raise EngineProtocolError("POST /generate: the stream ended before the answer")
                return await self._stream_with(request, parsed, prompt_ids, endpoint, messages, trace_id, lease,
                                               _resumed(first, events))

    async def _stream_with(self, request: web.Request, parsed: _Sampling, prompt_ids: list[int], endpoint: str,
                           messages: list[serving_pb2.ChatMessage], trace_id: str, lease: AdapterLease | None,
                           events: AsyncIterator[StreamedTokens | GenerateResult]) -> web.StreamResponse:
        chat = endpoint == "chat.completions"
        asked = getattr(parsed, "logprobs", None)
        want_logprobs = asked is True if chat else asked is not None  # completions: logprobs 0
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        created = int(time.time())
        sent_text, sent_ids, version = "", 0, ""

        async def send(payload: dict[str, Any]) -> None:
            await response.write(b"data: " + json.dumps(payload).encode() + b"\n\n")

        def chunk(delta_text: str, ids: list[int], logprobs: list[float], finish: str | None) -> dict[str, Any]:
            choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": None}
            if chat:
                choice["delta"] = {"content": delta_text} | ({"role": "assistant"} if sent_ids == 0 else {})
                if want_logprobs:
                    choice["logprobs"] = {"content": [{"token": self._piece(t), "logprob": lp, "bytes": None,
                                                       "top_logprobs": []} for t, lp in zip(ids, logprobs,
                                                                                             strict=True)]}
            else:
                choice["text"] = delta_text
                if want_logprobs:
                    choice["logprobs"] = {"tokens": [self._piece(t) for t in ids], "token_logprobs": logprobs,
                                          "top_logprobs": None, "text_offset": None}
            return {"id": f"{'chatcmpl' if chat else 'cmpl'}-{trace_id}",
                    "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
                    "model": self.served_model, "system_fingerprint": f"weights-{version}", "choices": [choice]}

        try:
            async for event in events:
                version = str(lease.version) if lease is not None else event.weight_version
                final = None if isinstance(event, StreamedTokens) else relabelled(event, lease)
                text = self.tokenizer.decode(event.output_ids, skip_special_tokens=True)
                if final is None and (text.endswith("\ufffd") or not text.startswith(sent_text)):
                    continue  # a character cut in two: wait for the rest of its bytes
                new_ids = event.output_ids[sent_ids:]
                new_logprobs = list((event.output_logprobs or [])[sent_ids:])
                if final is not None:
                    trace = await self._record(parsed, prompt_ids, endpoint, messages, trace_id, final)
                    delta = trace.response_text[len(sent_text):] if trace.response_text.startswith(sent_text) \
                        else trace.response_text
                    await send(chunk(delta, new_ids, new_logprobs, trace.finish_reason))
                    options = parsed.stream_options
                    if options is not None and options.include_usage:
                        usage = self._answer(trace, "chat.completion" if chat else "text_completion", {})["usage"]
                        await send(chunk("", [], [], None) | {"choices": [], "usage": usage})
                    break
                if text == sent_text:
                    continue  # no new text yet (a special token): its ids go with the next chunk
                await send(chunk(text[len(sent_text):], new_ids, new_logprobs, None))
                sent_text, sent_ids = text, len(event.output_ids)
        except EngineError as exc:
            await send({"error": {"message": f"the engine failed: {exc}", "type": "server_error", "param": None,
                                  "code": None}})
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    def _answer(self, trace: serving_pb2.Trace, kind: str, choice: dict[str, Any]) -> dict[str, Any]:
        prefix = "chatcmpl" if kind == "chat.completion" else "cmpl"
        return {"id": f"{prefix}-{trace.trace_id}", "object": kind, "created": trace.created_unix_ms // 1000,
                "model": trace.model, "choices": [choice], "system_fingerprint": f"weights-{trace.weights_version}",
                "usage": {"prompt_tokens": len(trace.prompt_token_ids),
                          "completion_tokens": len(trace.response_token_ids),
                          "total_tokens": len(trace.prompt_token_ids) + len(trace.response_token_ids)}}

    async def _feedback(self, request: web.Request) -> web.Response:
        """{"id": <a response id>, "reward"?: number, "label"?: str, "correction"?: str}."""
        body = await self._body(request)
        if not isinstance(body, dict) or not isinstance(body.get("id"), str):
            raise ApiError("id: the id of a response this endpoint gave is required", "id")
        trace_id = body["id"].removeprefix("chatcmpl-").removeprefix("cmpl-")
        try:
            await self.bus.js.get_last_msg(TRACES_STREAM, trace_subject(self.served_model, trace_id))
        except (nats.js.errors.NotFoundError, ValueError):  # no such trace, or an id that is no subject token
            raise ApiError(f"id: no trace {body['id']!r}", "id", 404, "not_found_error") from None
        feedback = serving_pb2.TraceFeedback(trace_id=trace_id, feedback_id=uuid.uuid4().hex,
                                             created_unix_ms=int(time.time() * 1000))
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
        await self.bus.publish(feedback_subject(self.served_model, trace_id), feedback,
                               f"feedback-{feedback.feedback_id}")
        return web.json_response({"id": feedback.feedback_id, "trace_id": trace_id, "object": "feedback"})
