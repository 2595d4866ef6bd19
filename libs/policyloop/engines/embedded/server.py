"""The embedded engine's HTTP server: SGLang's routes, each parsed with `policyloop.engines.protocol`
and handed to the scheduler, the weight loaders or the broadcast receiver."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from pathlib import Path
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from policyloop.engines.embedded.model import ServedModel, sent_tensors
from policyloop.engines.embedded.receiver import WeightReceiver
from policyloop.engines.embedded.sampling import request_generator
from policyloop.engines.embedded.scheduler import EngineRequest, Scheduler
from policyloop.engines.embedded.weight_loading import (
    activate_staged,
    load_from_disk,
    load_sent,
    stage_from_disk,
    stage_sent,
)
from policyloop.engines.protocol import (
    DEFAULT_WEIGHT_VERSION,
    SCHEMA,
    AbortRequest,
    ActivateStagedWeightsRequest,
    BeginWeightUpdateRequest,
    ClassifyRequest,
    ClassifyResult,
    ControlResult,
    DestroyWeightsUpdateGroupRequest,
    FinishReason,
    GenerateRequest,
    GenerateResult,
    InitWeightsUpdateGroupRequest,
    LoadLoraAdapterFromTensorsRequest,
    LoadLoraAdapterRequest,
    LoraUpdateResult,
    RequestError,
    StageWeightsFromDiskRequest,
    StageWeightsFromTensorRequest,
    StageWeightsResult,
    UnloadLoraAdapterRequest,
    UpdateWeightsFromDiskRequest,
    UpdateWeightsFromDistributedRequest,
    UpdateWeightsFromTensorRequest,
    UpdateWeightVersionRequest,
    WeightVersionSpan,
    error_body,
    is_generate_batch,
    parse_continue,
    parse_end_weight_update,
    parse_pause,
    split_generate_batch,
)
from policyloop.telemetry.logging import get_logger

log = get_logger("policyloop.engines.embedded")

_FLUSH_ANSWER = ("Cache flushed.\nPlease check backend logs for more details. (When there are running or waiting "
                 "requests, the operation will not be performed.)\n")


class _EngineMetrics(Collector):
    """The engine's figures, read from its state at each scrape (no bookkeeping of their own)."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler

    def collect(self):  # type: ignore[no-untyped-def]
        scheduler = self.scheduler
        requests = list(scheduler.requests.values())
        running = sum(r.state == "running" for r in requests)
        yield GaugeMetricFamily("sglang:num_running_reqs", "Requests being decoded (paused ones included).",
                                value=running)
        yield GaugeMetricFamily("sglang:num_queue_reqs", "Requests waiting for a wave (held while paused included).",
                                value=len(scheduler.waiting) + len(scheduler.held))
        yield CounterMetricFamily("sglang:prompt_tokens", "Prompt tokens of the requests admitted.",
                                  value=scheduler.prompt_tokens)
        yield CounterMetricFamily("sglang:generation_tokens", "Tokens decoded.", value=scheduler.generated_tokens)
        yield GaugeMetricFamily("sglang:num_used_tokens", "Token positions held in the KV cache.",
                                value=scheduler.kv_tokens)
        capacity = scheduler.kv_capacity
        if capacity:
            yield GaugeMetricFamily("sglang:token_usage", "KV cache positions in use, as a fraction of max_batch "
                                                          "rows of the model's context.",
                                    value=scheduler.kv_tokens / capacity)
        yield GaugeMetricFamily("policyloop_engine_classify_in_flight",
                                "/classify requests being scored or waiting for the compute thread.",
                                value=scheduler.classifying)
        yield CounterMetricFamily("policyloop_engine_classified_prompts", "Prompts scored on /classify.",
                                  value=scheduler.classified_prompts)
        staged = scheduler.served.staged
        yield GaugeMetricFamily("policyloop_engine_staged_weight_bytes",
                                "Bytes of a version staged beside the served weights, waiting to be activated.",
                                value=0 if staged is None else staged.bytes)
        yield CounterMetricFamily("policyloop_engine_weight_activations", "Staged versions swapped in.",
                                  value=scheduler.activations)
        yield CounterMetricFamily("policyloop_engine_activation_pause_seconds",
                                  "Time decoding stood still for the swaps of staged versions.",
                                  value=scheduler.activation_pause_s)
        yield GaugeMetricFamily("policyloop_engine_in_flight_output_tokens",
                                "Tokens decoded so far by the requests not yet done.",
                                value=sum(len(r.output_ids) for r in requests if r.state != "done"))


def _refusal(error: str | RequestError, status: int = 400) -> web.Response:
    """SGLang's answer to a refused request (a RequestError carries its kind and field)."""
    if isinstance(error, RequestError):
        text = error.message if error.status == SCHEMA else str(error)  # 422 says where apart
        return web.json_response(error_body(text, error.status, error.field), status=error.status)
    return web.json_response(error_body(error, status), status=status)


def _control(result: ControlResult) -> web.Response:
    return web.json_response(result.to_json(), status=200 if result.success else 400)


async def _json_body(request: web.Request, *, empty_ok: bool) -> Any:
    raw = await request.read()
    if not raw.strip():
        if empty_ok:
            return {}
        raise RequestError("body", "a JSON object is required", SCHEMA)
    try:
        return json.loads(raw)
    except ValueError as exc:
        raise RequestError("body", f"invalid JSON ({exc})", SCHEMA) from None


class EmbeddedEngine:
    """The engine and its HTTP server. `await start()` loads the model and listens (port 0 picks a
    free port: read `port` / `base_url` afterwards); `await stop()` aborts what is in flight and
    closes. Usable in-process (tests, perf) or through `python -m policyloop.engines.embedded`."""

    def __init__(self, model_path: str | Path, *, host: str = "127.0.0.1", port: int = 0, max_batch: int = 64,
                 threads: int = 1, weight_version: str = DEFAULT_WEIGHT_VERSION, batch_window_s: float = 0.005,
                 weights_group_timeout_s: float = 600.0, device: str = "cpu") -> None:
        """`device`: where the model computes (cpu, cuda, auto: CUDA when this torch sees a GPU);
        sampling stays on the CPU either way, with each request's own generator."""
        self.host = host
        self.port = port
        self.served = ServedModel(model_path, threads=threads, weight_version=weight_version, device=device)
        self.scheduler = Scheduler(self.served, max_batch=max_batch, batch_window_s=batch_window_s)
        self.receiver = WeightReceiver(self.served, self.scheduler, group_timeout_s=weights_group_timeout_s)
        self._metrics = CollectorRegistry(auto_describe=False)
        self._metrics.register(_EngineMetrics(self.scheduler))
        self._runner: web.AppRunner | None = None
        self.app = self._build_app()

    # -- lifecycle ------------------------------------------------------------------------------

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def weight_version(self) -> str:
        return self.served.weight_version

    @property
    def vocab_size(self) -> int:
        return self.served.vocab_size

    def progress(self, rid: str) -> int | None:
        """How many output tokens request `rid` has so far (None when it is not in flight)."""
        req = self.scheduler.requests.get(rid)
        return None if req is None else len(req.output_ids)

    def in_flight(self) -> dict[str, int]:
        """Output tokens so far of every request the engine holds, by rid."""
        return {rid: len(req.output_ids) for rid, req in self.scheduler.requests.items()}

    async def start(self) -> None:
        await self.scheduler.compute(self.served.load)
        self.scheduler.start()
        # handler_cancellation: a client that disconnects cancels its handler, which aborts the
        # request (as SGLang does) instead of decoding for no one.
        self._runner = web.AppRunner(self.app, access_log=None, handle_signals=False, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = int(self._runner.addresses[0][1])
        log.info("engine_listening", url=self.base_url, model_path=self.served.model_path,
                 weight_version=self.served.weight_version, max_batch=self.scheduler.max_batch,
                 threads=self.served.threads)

    async def stop(self) -> None:
        await self.scheduler.stop()
        if self._runner is not None:
            await self._runner.cleanup()
        self.receiver.close()
        self.scheduler.close_compute()

    async def __aenter__(self) -> EmbeddedEngine:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def _build_app(self) -> web.Application:
        app = web.Application(client_max_size=256 * 1024 * 1024)
        routes = [
            ("POST", "/generate", self._generate), ("PUT", "/generate", self._generate),
            ("POST", "/classify", self._classify), ("PUT", "/classify", self._classify),
            ("GET", "/model_info", self._model_info), ("GET", "/get_model_info", self._model_info),
            ("GET", "/health", self._health), ("GET", "/health_generate", self._health),
            ("POST", "/update_weights_from_disk", self._update_from_disk),
            ("POST", "/update_weights_from_tensor", self._update_from_tensor),
            ("POST", "/update_weight_version", self._update_weight_version),
            ("POST", "/stage_weights_from_disk", self._stage_from_disk),
            ("POST", "/stage_weights_from_tensor", self._stage_from_tensor),
            ("POST", "/activate_staged_weights", self._activate_staged),
            ("POST", "/pause_generation", self._pause), ("POST", "/continue_generation", self._continue),
            ("GET", "/flush_cache", self._flush_cache), ("POST", "/flush_cache", self._flush_cache),
            ("POST", "/abort_request", self._abort),
            ("POST", "/init_weights_update_group", self._init_weights_group),
            ("POST", "/begin_weight_update", self._begin_weight_update),
            ("POST", "/update_weights_from_distributed", self._update_from_distributed),
            ("POST", "/end_weight_update", self._end_weight_update),
            ("POST", "/destroy_weights_update_group", self._destroy_weights_group),
            ("GET", "/metrics", self._metrics_page),
            ("POST", "/load_lora_adapter", self._load_lora_adapter),
            ("POST", "/load_lora_adapter_from_tensors", self._load_lora_adapter_from_tensors),
            ("POST", "/unload_lora_adapter", self._unload_lora_adapter),
        ]
        for method, path, handler in routes:
            if method == "GET":
                app.router.add_get(path, handler)  # and HEAD, as aiohttp's add_get does
            else:
                app.router.add_route(method, path, handler)
        return app

    # -- generation -----------------------------------------------------------------------------

    async def _generate(self, request: web.Request) -> web.Response:
        if self.scheduler.closing:
            return _refusal("the engine is stopping", 503)
        if not self.served.is_generation:
            return _refusal(f"this engine serves a reward model ({self.served.model_path}, is_generation false): "
                            f"score with /classify")
        started = time.perf_counter()
        try:
            body = await _json_body(request, empty_ok=False)
            batch = is_generate_batch(body)
            parsed = split_generate_batch(body) if batch else [GenerateRequest.from_json(body)]
            reqs = [self._engine_request(p, started) for p in parsed]
        except RequestError as exc:
            return _refusal(exc)
        in_flight = [r.rid for r in reqs if r.rid in self.scheduler.requests]
        if in_flight:
            return _refusal(f"rid: a request with id {in_flight[0]!r} is already in flight")
        if not batch and parsed[0].stream:
            return await self._generate_stream(request, reqs[0], started)
        try:
            for req in reqs:
                self.scheduler.admit(req)
            # A batch's prompts are decoded like separate requests; the answer waits for all of them.
            await asyncio.shield(asyncio.gather(*(r.future for r in reqs)))
        except asyncio.CancelledError:  # the client went away: stop spending compute on it
            for req in reqs:
                self.scheduler.abort(req, "client disconnected")
            raise
        finally:
            for req in reqs:
                self.scheduler.requests.pop(req.rid, None)
        failed = next((r for r in reqs if r.error is not None), None)
        if failed is not None:
            return _refusal(f"generation failed: {failed.error!r}", 500)
        answers = [self._response(r, time.perf_counter() - started) for r in reqs]
        return web.json_response(answers if batch else answers[0])

    async def _classify(self, request: web.Request) -> web.Response:
        """A reward model's scores of each prompt, computed on the compute thread (between the
        generation waves of an engine that also generates: a classifier has none)."""
        if self.scheduler.closing:
            return _refusal("the engine is stopping", 503)
        started = time.perf_counter()
        try:
            parsed = ClassifyRequest.from_json(await _json_body(request, empty_ok=False))
            if self.served.is_generation:
                raise RequestError("body", f"this engine serves a generative model ({self.served.model_path}): "
                                           f"/classify needs a sequence-classification (reward) model")
            rows = self.served.classified_ids(parsed.prompts)
        except RequestError as exc:
            return _refusal(exc)
        self.scheduler.classifying += 1
        try:
            scores = await self.scheduler.compute(self.served.classify, rows, self.scheduler.max_batch)
        finally:
            self.scheduler.classifying -= 1
        self.scheduler.classified_prompts += len(rows)
        self.scheduler.prompt_tokens += sum(len(r) for r in rows)
        latency = time.perf_counter() - started
        answers = [ClassifyResult(embedding=score, rid=rid or uuid.uuid4().hex, prompt_tokens=len(row)).to_json(latency)
                   for score, rid, row in zip(scores, parsed.rids, rows, strict=True)]
        return web.json_response(answers if parsed.is_batch else answers[0])

    async def _generate_stream(self, request: web.Request, req: EngineRequest, started: float) -> web.StreamResponse:
        """Server-sent events: everything so far after each step that added tokens, the full
        answer last, then [DONE]. A client that leaves aborts the request."""
        req.progress = asyncio.Event()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        sent = 0
        try:
            self.scheduler.admit(req)
            while not req.future.done():
                waiter = asyncio.ensure_future(req.progress.wait())
                await asyncio.wait({waiter, req.future}, return_when=asyncio.FIRST_COMPLETED)
                waiter.cancel()
                req.progress.clear()
                if len(req.output_ids) > sent and not req.future.done():
                    sent = len(req.output_ids)
                    chunk = self._response(req, time.perf_counter() - started)
                    chunk["meta_info"]["finish_reason"] = None
                    await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            if req.error is not None:
                body = error_body(f"generation failed: {req.error!r}", 500)
            else:
                body = self._response(req, time.perf_counter() - started)
            await response.write(b"data: " + json.dumps(body).encode() + b"\n\ndata: [DONE]\n\n")
        except (asyncio.CancelledError, ConnectionResetError):  # the client went away
            self.scheduler.abort(req, "client disconnected")
            raise
        finally:
            self.scheduler.requests.pop(req.rid, None)
        await response.write_eof()
        return response

    def _engine_request(self, parsed: GenerateRequest, started: float) -> EngineRequest:
        if parsed.lora_path is not None and parsed.lora_path not in self.served.adapters:
            raise RequestError("lora_path", f"no adapter named {parsed.lora_path!r} is loaded (loaded: "
                                            f"{sorted(self.served.adapters)}): load it with /load_lora_adapter")
        prompt = self.served.prompt_ids(parsed)
        if parsed.logprob_start_len >= len(prompt):
            raise RequestError("logprob_start_len", f"{parsed.logprob_start_len} is not a position of the "
                                                    f"{len(prompt)}-token prompt")
        return EngineRequest(rid=parsed.rid or uuid.uuid4().hex, input_ids=prompt, params=parsed.sampling_params,
                             adapter=parsed.lora_path,
                             logprob_start_len=parsed.logprob_start_len if parsed.return_logprob else -1,
                             max_new_tokens=self.served.max_new_tokens(parsed.sampling_params, len(prompt)),
                             return_logprob=parsed.return_logprob,
                             return_text_in_logprobs=parsed.return_text_in_logprobs,
                             future=asyncio.get_running_loop().create_future(),
                             generator=request_generator(parsed.sampling_params), received=started)

    def _response(self, req: EngineRequest, latency: float) -> dict[str, Any]:
        spans = [WeightVersionSpan(version=v, start=s, end=e) for v, s, e in req.spans] or [
            WeightVersionSpan(version=self.served.weight_version, start=0, end=0)]
        finish = req.finish or FinishReason(type="abort", message="unfinished")
        text_ids = req.output_ids
        if finish.type == "stop" and isinstance(finish.matched, int) and text_ids:
            text_ids = text_ids[:-1]  # SGLang trims the matched stop token from the text
        text = self.served.decode(text_ids, skip_special_tokens=req.params.skip_special_tokens)
        if finish.type == "stop" and isinstance(finish.matched, str):  # and a stop string, with what follows it
            text = text[:text.find(finish.matched)] if finish.matched in text else text
        token_texts = None
        if req.return_logprob and req.return_text_in_logprobs and self.served.tokenizer is not None:
            token_texts = [self.served.decode([t], skip_special_tokens=False) for t in req.output_ids]
        result = GenerateResult(
            rid=req.rid, output_ids=req.output_ids, output_logprobs=req.logprobs if req.return_logprob else None,
            finish_reason=finish.type, finish_detail=finish, weight_version=spans[-1].version,
            prompt_tokens=len(req.input_ids), completion_tokens=len(req.output_ids), weight_versions=spans,
            text=text, input_logprobs=req.input_logprobs, cached_tokens=req.cached_tokens)
        return result.to_json(token_texts=token_texts, e2e_latency=latency, prompt_ids=req.input_ids)

    async def _pause(self, request: web.Request) -> web.Response:
        try:
            mode = parse_pause(await _json_body(request, empty_ok=True))
        except RequestError as exc:
            return _refusal(exc)
        await self.scheduler.pause(mode)
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def _continue(self, request: web.Request) -> web.Response:
        try:
            parse_continue(await _json_body(request, empty_ok=True))
        except RequestError as exc:
            return _refusal(exc)
        self.scheduler.resume()
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def _abort(self, request: web.Request) -> web.Response:
        try:
            parsed = AbortRequest.from_json(await _json_body(request, empty_ok=True))
        except RequestError as exc:
            return _refusal(exc)
        message = parsed.abort_message or "aborted by /abort_request"
        if parsed.abort_all:
            self.scheduler.abort_all(message)
        elif parsed.rid is not None and parsed.rid in self.scheduler.requests:
            self.scheduler.abort(self.scheduler.requests[parsed.rid], message)
        return web.Response(status=200)

    async def _flush_cache(self, _: web.Request) -> web.Response:
        # There is no prefix cache to drop here, but the answer follows SGLang's rule: refused
        # (400) while any request is queued or running, paused ones included.
        return web.Response(status=400 if self.scheduler.pending() else 200, text=_FLUSH_ANSWER)

    # -- information ----------------------------------------------------------------------------

    async def _model_info(self, _: web.Request) -> web.Response:
        return web.json_response(self.served.info().to_json())

    async def _health(self, _: web.Request) -> web.Response:
        return web.Response(status=200 if self.scheduler.alive else 503)

    async def _metrics_page(self, _: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self._metrics), content_type="text/plain", charset="utf-8")

    # -- LoRA adapters ----------------------------------------------------------------------------

    async def _load_lora_adapter(self, request: web.Request) -> web.Response:
        try:
            parsed = LoadLoraAdapterRequest.from_json(await _json_body(request, empty_ok=False))
            self._not_in_use(parsed.lora_name, "lora_name")
            async with self.scheduler.load_lock:
                await self.scheduler.compute(self.served.load_adapter, parsed.lora_name, parsed.lora_path)
        except RequestError as exc:
            return self._lora_answer(exc)
        log.info("engine_lora_loaded", lora_name=parsed.lora_name, lora_path=parsed.lora_path)
        return self._lora_answer()

    async def _load_lora_adapter_from_tensors(self, request: web.Request) -> web.Response:
        try:
            parsed = LoadLoraAdapterFromTensorsRequest.from_json(await _json_body(request, empty_ok=False))
            self._not_in_use(parsed.lora_name, "lora_name")
            tensors = await asyncio.to_thread(sent_tensors, parsed.serialized_named_tensors,
                                              parsed.expected_checksums)
            async with self.scheduler.load_lock:
                await self.scheduler.compute(self.served.load_adapter_tensors, parsed.lora_name,
                                             parsed.config_dict, tensors)
        except RequestError as exc:
            return self._lora_answer(exc)
        log.info("engine_lora_loaded", lora_name=parsed.lora_name, tensors=len(tensors))
        return self._lora_answer()

    async def _unload_lora_adapter(self, request: web.Request) -> web.Response:
        try:
            parsed = UnloadLoraAdapterRequest.from_json(await _json_body(request, empty_ok=False))
            self._not_in_use(parsed.lora_name, "lora_name")
            async with self.scheduler.load_lock:
                await self.scheduler.compute(self.served.unload_adapter, parsed.lora_name)
        except RequestError as exc:
            return self._lora_answer(exc)
        log.info("engine_lora_unloaded", lora_name=parsed.lora_name)
        return self._lora_answer()

    def _not_in_use(self, name: str, field_name: str) -> None:
        """An adapter that held, queued or running requests sample with is neither replaced nor freed."""
        using = sum(r.adapter == name and r.state != "done" for r in self.scheduler.requests.values())
        if using:
            raise RequestError(field_name, f"adapter {name!r} is in use by {using} requests: unload it once they "
                                           f"finish (or abort them)")

    def _lora_answer(self, refused: RequestError | None = None) -> web.Response:
        result = LoraUpdateResult(success=refused is None, loaded_adapters=dict(self.served.adapters),
                                  error_message=None if refused is None else f"{refused.field}: {refused.message}")
        return web.json_response(result.to_json(), status=200 if refused is None else refused.status)

    # -- weights --------------------------------------------------------------------------------

    async def _update_from_disk(self, request: web.Request) -> web.Response:
        try:
            parsed = UpdateWeightsFromDiskRequest.from_json(await _json_body(request, empty_ok=False))
        except RequestError as exc:
            return _refusal(exc)
        async with self.scheduler.load_lock, self.scheduler.weight_update(parsed.abort_all_requests):
            if parsed.flush_cache and self.scheduler.pending():
                return _refusal(self.scheduler.flush_refusal("flush_cache"))
            result = await self.scheduler.compute(load_from_disk, self.served, parsed)
        log.info("engine_weights_update", model_path=parsed.model_path, success=result.success,
                 message=result.message, weight_version=self.served.weight_version)
        return web.json_response(result.to_json(), status=200 if result.success else 400)

    async def _update_from_tensor(self, request: web.Request) -> web.Response:
        try:
            parsed = UpdateWeightsFromTensorRequest.from_json(await _json_body(request, empty_ok=False))
            tensors = await asyncio.to_thread(sent_tensors, parsed.serialized_named_tensors)
        except RequestError as exc:
            return _refusal(exc)
        async with self.scheduler.load_lock, self.scheduler.weight_update(parsed.abort_all_requests):
            if parsed.flush_cache and self.scheduler.pending():
                return _refusal(self.scheduler.flush_refusal("flush_cache"))
            result = await self.scheduler.compute(load_sent, self.served, tensors, parsed)
        log.info("engine_weights_update", source="tensors", tensors=len(tensors), success=result.success,
                 message=result.message, weight_version=self.served.weight_version)
        return web.json_response(result.to_json(), status=200 if result.success else 400)

    # -- a version staged beside the served one, swapped in at a step boundary (this engine's own) --

    async def _stage_from_disk(self, request: web.Request) -> web.Response:
        try:
            parsed = StageWeightsFromDiskRequest.from_json(await _json_body(request, empty_ok=False))
        except RequestError as exc:
            return _refusal(exc)
        async with self.scheduler.load_lock:  # generation goes on: staging runs beside the compute thread
            result = await asyncio.to_thread(stage_from_disk, self.served, parsed)
        return self._staged_answer(result, source=parsed.model_path)

    async def _stage_from_tensor(self, request: web.Request) -> web.Response:
        started = time.perf_counter()
        try:
            parsed = StageWeightsFromTensorRequest.from_json(await _json_body(request, empty_ok=False))
            tensors = await asyncio.to_thread(sent_tensors, parsed.serialized_named_tensors)
        except RequestError as exc:
            return _refusal(exc)
        async with self.scheduler.load_lock:
            result = await asyncio.to_thread(stage_sent, self.served, tensors, parsed, started)
        return self._staged_answer(result, source="tensors")

    def _staged_answer(self, result: StageWeightsResult, *, source: str) -> web.Response:
        log.info("engine_weights_staged", source=source, success=result.success, message=result.message,
                 staged_version=result.weight_version, bytes=result.bytes, prepare_s=round(result.prepare_s, 4))
        return web.json_response(result.to_json(), status=200 if result.success else 400)

    async def _activate_staged(self, request: web.Request) -> web.Response:
        try:
            parsed = ActivateStagedWeightsRequest.from_json(await _json_body(request, empty_ok=False))
        except RequestError as exc:
            return _refusal(exc)
        async with self.scheduler.load_lock:
            # On the compute thread: after the step it is computing, before the next.
            result, retired = await self.scheduler.compute(activate_staged, self.served, parsed.weight_version)
        await asyncio.to_thread(retired.clear)  # the old weights freed beside the compute thread
        if result.success:
            self.scheduler.activations += 1
            self.scheduler.activation_pause_s += result.pause_s
        log.info("engine_weights_activated", success=result.success, message=result.message,
                 weight_version=self.served.weight_version, pause_ms=round(result.pause_s * 1000, 3))
        return web.json_response(result.to_json(), status=200 if result.success else 400)

    async def _update_weight_version(self, request: web.Request) -> web.Response:
        try:
            parsed = UpdateWeightVersionRequest.from_json(await _json_body(request, empty_ok=False))
        except RequestError as exc:
            return _refusal(exc)
        if parsed.abort_all_requests:
            self.scheduler.abort_all(f"aborted by /update_weight_version to {parsed.new_version}")
        self.served.weight_version = parsed.new_version
        return web.json_response({"success": True, "message": f"Weight version updated to {parsed.new_version}",
                                  "new_version": parsed.new_version})

    async def _init_weights_group(self, request: web.Request) -> web.Response:
        try:
            parsed = InitWeightsUpdateGroupRequest.from_json(await _json_body(request, empty_ok=False))
        except RequestError as exc:
            return _refusal(exc)
        result = await self.receiver.join(parsed)
        log.info("engine_weights_group_init", group=parsed.group_name, backend=parsed.backend,
                 rank=parsed.rank_offset, world_size=parsed.world_size, success=result.success,
                 message=result.message)
        return _control(result)

    async def _begin_weight_update(self, request: web.Request) -> web.Response:
        try:
            BeginWeightUpdateRequest.from_json(await _json_body(request, empty_ok=True))
        except RequestError as exc:
            return _refusal(exc)
        return _control(self.receiver.begin())

    async def _end_weight_update(self, request: web.Request) -> web.Response:
        try:
            parse_end_weight_update(await _json_body(request, empty_ok=True))
        except RequestError as exc:
            return _refusal(exc)
        return _control(self.receiver.end())

    async def _update_from_distributed(self, request: web.Request) -> web.Response:
        try:
            parsed = UpdateWeightsFromDistributedRequest.from_json(await _json_body(request, empty_ok=False))
            specs = self.receiver.specs(parsed)
        except RequestError as exc:
            return _refusal(exc)
        result = await self.receiver.update(parsed, specs)
        log.info("engine_weights_distributed", group=parsed.group_name, tensors=len(specs), success=result.success,
                 message=result.message, weight_version=self.served.weight_version)
        return _control(result)

    async def _destroy_weights_group(self, request: web.Request) -> web.Response:
        try:
            parsed = DestroyWeightsUpdateGroupRequest.from_json(await _json_body(request, empty_ok=True))
        except RequestError as exc:
            return _refusal(exc)
        result = await self.receiver.destroy(parsed.group_name)
        log.info("engine_weights_group_destroy", group=parsed.group_name, existed=result.success)
        return _control(result)


async def start_engine(model_path: str | Path, *, host: str = "127.0.0.1", port: int = 0, max_batch: int = 64,
                       threads: int = 1, weight_version: str = DEFAULT_WEIGHT_VERSION, batch_window_s: float = 0.005,
                       weights_group_timeout_s: float = 600.0, device: str = "cpu") -> EmbeddedEngine:
    """Loads the model, starts the server and returns the running engine (stop it with `stop()`)."""
    engine = EmbeddedEngine(model_path, host=host, port=port, max_batch=max_batch, threads=threads,
                            weight_version=weight_version, batch_window_s=batch_window_s,
                            weights_group_timeout_s=weights_group_timeout_s, device=device)
    await engine.start()
    return engine
