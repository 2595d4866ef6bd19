"""The embedded engine: policyloop's own inference server for CPU machines and CI.

It serves the subset of SGLang's native HTTP API that the rollout service uses, with SGLang's
field names and shapes (see `policyloop.engines.protocol`), on any Hugging Face causal LM
directory loaded with transformers in float32. One client (`SGLangClient`) talks to it and to a
real SGLang server alike.

    python -m policyloop.engines.embedded --model-path DIR --host 127.0.0.1 --port 30000 \
        [--max-batch 64] [--threads 1] [--weight-version 0]

Routes: POST/PUT /generate, GET /model_info and /get_model_info, GET /health (and
/health_generate), POST /update_weights_from_disk, POST /pause_generation, POST
/continue_generation, GET/POST /flush_cache, POST /abort_request, and for the colocated weight
sync POST /init_weights_update_group, /begin_weight_update, /update_weights_from_distributed,
/end_weight_update, /destroy_weights_update_group; GET /metrics in Prometheus' text format, with
SGLang's names for what both engines count (`sglang:num_running_reqs`, `sglang:num_queue_reqs`,
`sglang:prompt_tokens_total`, `sglang:generation_tokens_total`) and
`policyloop_engine_in_flight_output_tokens` (tokens decoded so far by the requests not yet done:
above 0 while paused, some request will straddle a weight update).

Batching (static batching per wave). A scheduler task waits a few milliseconds
(`batch_window_s`) after the first waiting request to gather concurrent ones, takes up to
`max_batch` of them, left-pads their prompts and runs one prefill and then one decode step at a
time over the wave with the KV cache (2D attention mask + explicit position ids, so every row
sees exactly what it would see alone). Rows that finish (stop token / EOS, max_new_tokens,
abort) leave the cache at once; requests that arrive meanwhile wait for the next wave. The cost:
a long request keeps a wave going while newcomers wait (no continuous batching), and padding
to the longest prompt of a wave is computed. Each prefill and each decode step runs on a single
compute thread, so the HTTP server stays responsive and control actions (weight loads, pauses,
aborts) happen between two steps, never inside one.

Sampling. temperature 0 is greedy (argmax); otherwise logits are divided by the temperature,
then top-k and top-p truncate, and one uniform number from the request's own
`torch.Generator` (seeded with `sampling_seed`, or at random) picks the token by inverse CDF, so
a seeded request gives the same tokens whatever else shares its wave. The logprob returned for
each token is `log_softmax(logits / temperature)` (`log_softmax(logits)` when greedy) taken
BEFORE top-k/top-p truncation — as SGLang reports it by default; at temperature 1 it is the
model's plain log-probability, equal to a teacher-forced forward pass over prompt + response.

Weights. `/update_weights_from_disk` copies the safetensors tensors of a directory into the
served model in place after checking that every name and shape matches (same architecture);
any failure leaves the old weights and version serving and answers success=false. As in SGLang,
an update while generation runs takes the model's writer lock: new requests wait and the update
waits until the requests in flight have finished (`abort_all_requests` ends them first, with
finish_reason abort). An update while generation is paused applies at once: requests paused
in place continue with the new weights (their `weight_versions` spans say which tokens came from
which version; the KV cache of earlier tokens is kept), retracted ones recompute their cache
with them. `flush_cache` follows SGLang's rule: the cache cannot be flushed while any request is
queued or running (paused ones included) — SGLang's update then fails its flush assertion, so
this engine refuses the update (400 naming flush_cache), and /flush_cache answers 400.

Distributed weights (the colocated path, `policyloop.weights.distributed`). The engine joins a
weight-update group as rank `rank_offset` (it is one TP rank), over gloo (nccl only where CUDA
is: the model itself stays on the CPU). Each /update_weights_from_distributed, inside a
/begin_weight_update … /end_weight_update session as SGLang 0.5.23 requires, receives its tensors
(one flattened uint8 buffer for load_format "flattened_bucket", else one broadcast per tensor) on
a daemon thread, then checks every name, shape and dtype against the served parameters and
copies them in place on the compute thread, between two decode steps. A request that fails
those checks still receives its tensors (the sender's broadcast must complete, and the group
stays in step for the next bucket) and answers success=false naming the tensor: the whole bucket
is dropped and the old weights keep serving. Requests refused before receiving (malformed, no
session, unknown group) leave the sender's broadcast waiting, as SGLang's do.

Pause. mode abort ends every request (running or waiting) with finish_reason abort and the
tokens so far; mode in_place stops between two steps and keeps the wave until
/continue_generation; mode retract also stops between two steps and, on continue, recomputes the
wave's cache from prompt + tokens so far (SGLang frees the KV cache of retracted requests). In
every mode new requests are held until /continue_generation, as SGLang holds them at its
tokenizer manager. /pause_generation answers once the engine is actually between steps, so a
weight update that follows cannot race a step.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import secrets
import signal
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from policyloop.engines.protocol import (
    DEFAULT_WEIGHT_VERSION,
    SCHEMA,
    AbortRequest,
    BeginWeightUpdateRequest,
    ControlResult,
    DestroyWeightsUpdateGroupRequest,
    FinishReason,
    GenerateRequest,
    GenerateResult,
    InitWeightsUpdateGroupRequest,
    ModelInfo,
    RequestError,
    SamplingParams,
    UpdateWeightsFromDiskRequest,
    UpdateWeightsFromDistributedRequest,
    UpdateWeightsResult,
    UpdateWeightVersionRequest,
    WeightVersionSpan,
    error_body,
    parse_continue,
    parse_end_weight_update,
    parse_pause,
)
from policyloop.telemetry.logging import get_logger
from policyloop.weights.distributed import (
    FLATTENED_BUCKET,
    Bucket,
    TensorSpec,
    WeightGroupError,
    WeightUpdateGroup,
    check_backend,
    in_daemon_thread,
    join_weight_update_group,
    parse_dtype,
    receive_named_tensors,
)

log = get_logger("policyloop.engines.embedded")


@dataclass(eq=False)
class _Request:
    rid: str
    input_ids: list[int]
    params: SamplingParams
    max_new_tokens: int
    return_logprob: bool
    return_text_in_logprobs: bool
    future: asyncio.Future[None]
    generator: torch.Generator | None
    received: float
    state: str = "waiting"  # waiting → running → done
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    spans: list[list[Any]] = field(default_factory=list)  # [version, start, end)
    finish: FinishReason | None = None
    abort_message: str | None = None  # set on the event loop; the scheduler ends the row
    error: BaseException | None = None

    def add_token(self, token: int, logprob: float, version: str) -> None:
        self.output_ids.append(token)
        self.logprobs.append(logprob)
        n = len(self.output_ids)
        if self.spans and self.spans[-1][0] == version:
            self.spans[-1][2] = n
        else:
            self.spans.append([version, n - 1, n])


class _Wave:
    """The requests being decoded together and their tensors (touched by the compute thread)."""

    def __init__(self, requests: list[_Request], cache: Any, mask: torch.Tensor, positions: torch.Tensor,
                 next_logits: torch.Tensor, version: str) -> None:
        self.requests = requests
        self.cache = cache
        self.mask = mask            # [B, T] 1 on real tokens (left padding is 0)
        self.positions = positions  # [B, 1] position of each row's last token
        self.next_logits = next_logits  # [B, V] logits of each row's next token
        self.version = version      # weights that computed next_logits

    def keep(self, rows: list[int]) -> None:
        index = torch.tensor(rows, dtype=torch.long)
        self.cache.batch_select_indices(index)
        self.mask = self.mask[index]
        self.positions = self.positions[index]
        self.next_logits = self.next_logits[index]
        self.requests = [self.requests[i] for i in rows]


class _EngineMetrics(Collector):
    """The engine's figures, read from its state at each scrape (no bookkeeping of their own)."""

    def __init__(self, engine: EmbeddedEngine) -> None:
        self.engine = engine

    def collect(self):  # type: ignore[no-untyped-def]
        engine = self.engine
        requests = list(engine._requests.values())
        running = sum(r.state == "running" for r in requests)
        yield GaugeMetricFamily("sglang:num_running_reqs", "Requests being decoded (paused ones included).",
                                value=running)
        yield GaugeMetricFamily("sglang:num_queue_reqs", "Requests waiting for a wave (held while paused included).",
                                value=len(engine._waiting) + len(engine._held))
        yield CounterMetricFamily("sglang:prompt_tokens", "Prompt tokens of the requests admitted.",
                                  value=engine.prompt_tokens)
        yield CounterMetricFamily("sglang:generation_tokens", "Tokens decoded.", value=engine.generated_tokens)
        yield GaugeMetricFamily("policyloop_engine_in_flight_output_tokens",
                                "Tokens decoded so far by the requests not yet done.",
                                value=sum(len(r.output_ids) for r in requests if r.state != "done"))


class EmbeddedEngine:
    """The engine and its HTTP server. `await start()` loads the model and listens (port 0 picks a
    free port: read `port` / `base_url` afterwards); `await stop()` aborts what is in flight and
    closes. Usable in-process (tests, perf) or through `python -m policyloop.engines.embedded`."""

    def __init__(self, model_path: str | Path, *, host: str = "127.0.0.1", port: int = 0, max_batch: int = 64,
                 threads: int = 1, weight_version: str = DEFAULT_WEIGHT_VERSION, batch_window_s: float = 0.005,
                 weights_group_timeout_s: float = 600.0) -> None:
        if max_batch < 1:
            raise ValueError("max_batch must be >= 1")
        self.model_path = str(model_path)
        self.host = host
        self.port = port
        self.max_batch = max_batch
        self.threads = threads
        self.batch_window_s = batch_window_s
        self._weight_version = str(weight_version)
        self._model: Any = None
        self._tokenizer: Any = None
        self._eos_ids: frozenset[int] = frozenset()
        self._pad_id = 0
        self._vocab_size = 0
        self._max_context: int | None = None
        self._waiting: deque[_Request] = deque()   # admitted to the scheduler, not yet running
        self._held: deque[_Request] = deque()      # arrived while paused or while an update waits
        self._requests: dict[str, _Request] = {}
        self._paused = False
        self._pause_mode = ""
        self._retractions = 0   # bumped by each pause in mode retract: waves recompute their cache
        self._writers = 0       # weight updates waiting for the requests in flight (SGLang's writer lock)
        self._closing = False
        self.prompt_tokens = 0      # counters of /metrics
        self.generated_tokens = 0
        self._metrics = CollectorRegistry(auto_describe=False)
        self._metrics.register(_EngineMetrics(self))
        self._kick = asyncio.Event()
        self._parked = asyncio.Event()
        self._update_lock = asyncio.Lock()
        # The colocated weight sync: joined groups by name, the lock that keeps their collectives
        # (join, receive, destroy) in request order, and whether a weight-update session is open.
        self.weights_group_timeout_s = weights_group_timeout_s
        self._weight_groups: dict[str, WeightUpdateGroup] = {}
        self._group_lock = asyncio.Lock()
        self._weight_session = False
        self._executor: ThreadPoolExecutor | None = None
        self._scheduler: asyncio.Task[None] | None = None
        self._runner: web.AppRunner | None = None
        self.app = self._build_app()

    # -- lifecycle ------------------------------------------------------------------------------

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def weight_version(self) -> str:
        return self._weight_version

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def progress(self, rid: str) -> int | None:
        """How many output tokens request `rid` has so far (None when it is not in flight)."""
        req = self._requests.get(rid)
        return None if req is None else len(req.output_ids)

    def in_flight(self) -> dict[str, int]:
        """Output tokens so far of every request the engine holds, by rid."""
        return {rid: len(req.output_ids) for rid, req in self._requests.items()}

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="engine-compute")
        await loop.run_in_executor(self._executor, self._load_model)
        self._scheduler = asyncio.create_task(self._run(), name="engine-scheduler")
        # handler_cancellation: a client that disconnects cancels its handler, which aborts the
        # request (as SGLang does) instead of decoding for no one.
        self._runner = web.AppRunner(self.app, access_log=None, handle_signals=False, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = int(self._runner.addresses[0][1])
        log.info("engine_listening", url=self.base_url, model_path=self.model_path,
                 weight_version=self._weight_version, max_batch=self.max_batch, threads=self.threads)

    async def stop(self) -> None:
        self._closing = True
        self._abort_all("engine stopping")
        self._kick.set()
        if self._scheduler is not None:
            try:
                await asyncio.wait_for(self._scheduler, 30)
            except (TimeoutError, asyncio.CancelledError):
                self._scheduler.cancel()
        if self._runner is not None:
            await self._runner.cleanup()
        for group in self._weight_groups.values():
            group.close()
        self._weight_groups.clear()
        if self._executor is not None:
            self._executor.shutdown(wait=True)

    async def __aenter__(self) -> EmbeddedEngine:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def _load_model(self) -> None:
        import transformers
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.set_num_threads(self.threads)
        transformers.utils.logging.disable_progress_bar()
        dtype_kw = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
        model = AutoModelForCausalLM.from_pretrained(self.model_path, local_files_only=True,
                                                     **{dtype_kw: torch.float32})
        model.eval()
        model.requires_grad_(False)
        self._model = model
        try:
            self._tokenizer = AutoTokenizer.from_pretrained(self.model_path, local_files_only=True)
        except Exception as exc:  # ids in, ids out still works; `text` prompts do not
            log.warning("engine_no_tokenizer", model_path=self.model_path, error=str(exc))
            self._tokenizer = None
        eos: set[int] = set()
        for source in (model.config, getattr(model, "generation_config", None), self._tokenizer):
            value = getattr(source, "eos_token_id", None) if source is not None else None
            if isinstance(value, int):
                eos.add(value)
            elif isinstance(value, list | tuple):
                eos.update(int(v) for v in value)
        self._eos_ids = frozenset(eos)
        pad = getattr(self._tokenizer, "pad_token_id", None) or getattr(model.config, "pad_token_id", None)
        self._pad_id = int(pad) if isinstance(pad, int) else 0
        self._vocab_size = int(model.get_input_embeddings().weight.shape[0])
        self._max_context = getattr(model.config, "max_position_embeddings", None)

    # -- HTTP -----------------------------------------------------------------------------------

    def _build_app(self) -> web.Application:
        app = web.Application(client_max_size=256 * 1024 * 1024)
        app.router.add_post("/generate", self._handle_generate)
        app.router.add_put("/generate", self._handle_generate)
        app.router.add_get("/model_info", self._handle_model_info)
        app.router.add_get("/get_model_info", self._handle_model_info)
        app.router.add_get("/health", self._handle_health)
        app.router.add_get("/health_generate", self._handle_health)
        app.router.add_post("/update_weights_from_disk", self._handle_update_weights)
        app.router.add_post("/update_weight_version", self._handle_update_weight_version)
        app.router.add_post("/pause_generation", self._handle_pause)
        app.router.add_post("/continue_generation", self._handle_continue)
        app.router.add_get("/flush_cache", self._handle_flush_cache)
        app.router.add_post("/flush_cache", self._handle_flush_cache)
        app.router.add_post("/abort_request", self._handle_abort)
        app.router.add_post("/init_weights_update_group", self._handle_init_weights_group)
        app.router.add_post("/begin_weight_update", self._handle_begin_weight_update)
        app.router.add_post("/update_weights_from_distributed", self._handle_update_distributed)
        app.router.add_post("/end_weight_update", self._handle_end_weight_update)
        app.router.add_post("/destroy_weights_update_group", self._handle_destroy_weights_group)
        app.router.add_get("/metrics", self._handle_metrics)
        return app

    async def _handle_metrics(self, _: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self._metrics), content_type="text/plain", charset="utf-8")

    @staticmethod
    def _error(message: str | RequestError, status: int = 400) -> web.Response:
        """SGLang's answer to a refused request (a RequestError carries its kind and field)."""
        if isinstance(message, RequestError):
            text = message.message if message.status == SCHEMA else str(message)  # 422 says where apart
            return web.json_response(error_body(text, message.status, message.field), status=message.status)
        return web.json_response(error_body(message, status), status=status)

    @staticmethod
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

    async def _handle_generate(self, request: web.Request) -> web.Response:
        if self._closing:
            return self._error("the engine is stopping", 503)
        started = time.perf_counter()
        try:
            parsed = GenerateRequest.from_json(await self._json_body(request, empty_ok=False))
            prompt = self._prompt_ids(parsed)
            max_new_tokens = self._max_new_tokens(parsed.sampling_params, len(prompt))
        except RequestError as exc:
            return self._error(exc)
        rid = parsed.rid or uuid.uuid4().hex
        if rid in self._requests:
            return self._error(f"rid: a request with id {rid!r} is already in flight")
        seed = parsed.sampling_params.sampling_seed
        generator = None
        if parsed.sampling_params.temperature > 0:
            generator = torch.Generator().manual_seed(
                (seed if seed is not None else secrets.randbits(63)) % (1 << 64))
        req = _Request(rid=rid, input_ids=prompt, params=parsed.sampling_params, max_new_tokens=max_new_tokens,
                       return_logprob=parsed.return_logprob, return_text_in_logprobs=parsed.return_text_in_logprobs,
                       future=asyncio.get_running_loop().create_future(), generator=generator,
                       received=started)
        self._requests[rid] = req
        self.prompt_tokens += len(prompt)
        try:
            if max_new_tokens == 0:  # nothing to decode: SGLang answers after prefill alone
                req.finish = FinishReason("length", length=0)
                self._complete(req)
            elif self._paused or self._writers:
                # SGLang holds a request at its tokenizer manager while paused or while a weight
                # update waits for the requests in flight; it reaches the scheduler afterwards.
                self._held.append(req)
            else:
                self._waiting.append(req)
                self._kick.set()
            await asyncio.shield(req.future)
        except asyncio.CancelledError:  # the client went away: stop spending compute on it
            self._abort(req, "client disconnected")
            raise
        finally:
            self._requests.pop(rid, None)
        if req.error is not None:
            return self._error(f"generation failed: {req.error!r}", 500)
        return web.json_response(self._response(req, time.perf_counter() - started))

    def _prompt_ids(self, parsed: GenerateRequest) -> list[int]:
        if parsed.text is not None:
            if self._tokenizer is None:
                raise RequestError("text", "this engine has no tokenizer: send input_ids")
            ids = list(self._tokenizer(parsed.text)["input_ids"])
            if not ids:
                raise RequestError("text", "the prompt is empty")
            return ids
        ids = list(parsed.input_ids or [])
        bad = [t for t in ids if not 0 <= t < self._vocab_size]
        if bad:
            raise RequestError("input_ids", f"token ids {bad[:5]} are outside the vocabulary [0, {self._vocab_size})")
        return ids

    def _max_new_tokens(self, params: SamplingParams, prompt_len: int) -> int:
        room = None if self._max_context is None else self._max_context - prompt_len
        if room is not None and room < 0:
            raise RequestError("input_ids", f"the prompt has {prompt_len} tokens, more than the model's context "
                                            f"length of {self._max_context}")
        if params.max_new_tokens is None:
            return room if room is not None else 1 << 30
        if room is not None and params.max_new_tokens > room:
            raise RequestError("sampling_params.max_new_tokens",
                               f"{prompt_len} prompt tokens + {params.max_new_tokens} new tokens exceed the model's "
                               f"context length of {self._max_context}")
        return params.max_new_tokens

    def _response(self, req: _Request, latency: float) -> dict[str, Any]:
        spans = [WeightVersionSpan(v, s, e) for v, s, e in req.spans] or [
            WeightVersionSpan(self._weight_version, 0, 0)]
        finish = req.finish or FinishReason("abort", message="unfinished")
        text_ids = req.output_ids
        if finish.type == "stop" and text_ids:  # SGLang trims the matched stop token from the text
            text_ids = text_ids[:-1]
        tok = self._tokenizer
        text = tok.decode(text_ids, skip_special_tokens=req.params.skip_special_tokens) if tok is not None else ""
        token_texts = None
        if req.return_logprob and req.return_text_in_logprobs and tok is not None:
            token_texts = [tok.decode([t]) for t in req.output_ids]
        result = GenerateResult(
            rid=req.rid, output_ids=req.output_ids, output_logprobs=req.logprobs if req.return_logprob else None,
            finish_reason=finish.type, finish_detail=finish, weight_version=spans[-1].version,
            prompt_tokens=len(req.input_ids), completion_tokens=len(req.output_ids), weight_versions=spans,
            text=text)
        return result.to_json(token_texts=token_texts, e2e_latency=latency)

    async def _handle_model_info(self, _: web.Request) -> web.Response:
        config = self._model.config
        info = ModelInfo(model_path=self.model_path, tokenizer_path=self.model_path,
                         weight_version=self._weight_version, model_type=getattr(config, "model_type", None),
                         architectures=getattr(config, "architectures", None))
        return web.json_response(info.to_json())

    async def _handle_health(self, _: web.Request) -> web.Response:
        alive = self._scheduler is not None and not self._scheduler.done() and not self._closing
        return web.Response(status=200 if alive else 503)

    async def _handle_update_weights(self, request: web.Request) -> web.Response:
        try:
            parsed = UpdateWeightsFromDiskRequest.from_json(await self._json_body(request, empty_ok=False))
        except RequestError as exc:
            return self._error(exc)
        async with self._update_lock, self._weight_update(parsed.abort_all_requests):
            if parsed.flush_cache and self._pending():
                return self._error(self._flush_refusal("flush_cache"))
            loop = asyncio.get_running_loop()
            result = await loop.run_in_executor(self._executor, self._load_weights, parsed)
        log.info("engine_weights_update", model_path=parsed.model_path, success=result.success,
                 message=result.message, weight_version=self._weight_version)
        return web.json_response(result.to_json(), status=200 if result.success else 400)

    async def _handle_pause(self, request: web.Request) -> web.Response:
        try:
            mode = parse_pause(await self._json_body(request, empty_ok=True))
        except RequestError as exc:
            return self._error(exc)
        if mode == "abort":
            self._abort_all("generation paused (mode abort)")
        elif mode == "retract":
            self._retractions += 1
        self._paused, self._pause_mode = True, mode
        await self._until_parked()
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def _handle_continue(self, request: web.Request) -> web.Response:
        try:
            parse_continue(await self._json_body(request, empty_ok=True))
        except RequestError as exc:
            return self._error(exc)
        self._paused, self._pause_mode = False, ""
        self._release_held()
        self._kick.set()
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def _handle_flush_cache(self, _: web.Request) -> web.Response:
        # There is no prefix cache to drop here, but the answer follows SGLang's rule: refused
        # (400) while any request is queued or running, paused ones included.
        status = 400 if self._pending() else 200
        return web.Response(status=status, text="Cache flushed.\nPlease check backend logs for more details. "
                                                "(When there are running or waiting requests, the operation will "
                                                "not be performed.)\n")

    def _pending(self) -> list[_Request]:
        """Requests the scheduler holds: queued or running (paused in place or retracted too)."""
        return [r for r in self._requests.values() if r.state == "running" or r in self._waiting]

    def _flush_refusal(self, field_name: str) -> str:
        pending = self._pending()
        running = sum(r.state == "running" for r in pending)
        return (f"{field_name}: Cache not flushed because there are pending requests. #queue-req: "
                f"{len(pending) - running}, #running-req: {running} (paused {self._pause_mode or 'no'}); SGLang "
                f"fails 'Cache flush failed after updating weights' here: update with flush_cache=false, or "
                f"pause in mode abort")

    def _release_held(self) -> None:
        if self._paused or self._writers:
            return
        while self._held:
            self._waiting.append(self._held.popleft())
        self._kick.set()

    @contextlib.asynccontextmanager
    async def _weight_update(self, abort_all_requests: bool) -> AsyncIterator[None]:
        """SGLang's rule for a weight update: when generation is paused it applies at once (the
        requests in flight keep their state); otherwise it takes the model's writer lock — new
        requests wait, and the update waits until those in flight have finished."""
        if abort_all_requests:
            self._abort_all("aborted for a weight update")
        if self._paused:
            yield
            return
        self._writers += 1
        try:
            while self._pending():
                await asyncio.sleep(0.005)
            yield
        finally:
            self._writers -= 1
            self._release_held()

    async def _handle_update_weight_version(self, request: web.Request) -> web.Response:
        try:
            parsed = UpdateWeightVersionRequest.from_json(await self._json_body(request, empty_ok=False))
        except RequestError as exc:
            return self._error(exc)
        if parsed.abort_all_requests:
            self._abort_all(f"aborted by /update_weight_version to {parsed.new_version}")
        self._weight_version = parsed.new_version
        return web.json_response({"success": True, "message": f"Weight version updated to {parsed.new_version}",
                                  "new_version": parsed.new_version})

    async def _handle_abort(self, request: web.Request) -> web.Response:
        try:
            parsed = AbortRequest.from_json(await self._json_body(request, empty_ok=True))
        except RequestError as exc:
            return self._error(exc)
        message = parsed.abort_message or "aborted by /abort_request"
        if parsed.abort_all:
            self._abort_all(message)
        elif parsed.rid is not None and parsed.rid in self._requests:
            self._abort(self._requests[parsed.rid], message)
        return web.Response(status=200)

    # -- the colocated weight sync (HTTP) -------------------------------------------------------

    @staticmethod
    def _control(result: ControlResult) -> web.Response:
        return web.json_response(result.to_json(), status=200 if result.success else 400)

    async def _handle_init_weights_group(self, request: web.Request) -> web.Response:
        try:
            parsed = InitWeightsUpdateGroupRequest.from_json(await self._json_body(request, empty_ok=False))
        except RequestError as exc:
            return self._error(exc)
        try:
            check_backend(parsed.backend)  # nccl without CUDA: refused before waiting for anyone
        except WeightGroupError as exc:
            return self._control(ControlResult(False, f"Failed to initialize custom process group: {exc}."))
        # Shielded: a client that gives up must not leave a joined group untracked.
        result = await asyncio.shield(asyncio.ensure_future(self._join_group(parsed)))
        log.info("engine_weights_group_init", group=parsed.group_name, backend=parsed.backend,
                 rank=parsed.rank_offset, world_size=parsed.world_size, success=result.success,
                 message=result.message)
        return self._control(result)

    async def _join_group(self, parsed: InitWeightsUpdateGroupRequest) -> ControlResult:
        async with self._group_lock:
            if parsed.group_name in self._weight_groups:
                return ControlResult(False, f"Failed to initialize custom process group: the group "
                                            f"{parsed.group_name!r} already exists.")
            try:
                group = await in_daemon_thread(lambda: join_weight_update_group(
                    master_address=parsed.master_address, master_port=parsed.master_port,
                    rank=parsed.rank_offset, world_size=parsed.world_size, group_name=parsed.group_name,
                    backend=parsed.backend, timeout_s=self.weights_group_timeout_s), "engine-weights-join")
            except Exception as exc:  # no store, a member missing at the timeout, …
                return ControlResult(False, f"Failed to initialize custom process group: {exc}.")
            self._weight_groups[parsed.group_name] = group
            return ControlResult(True, "Succeeded to initialize custom process group.")

    async def _handle_begin_weight_update(self, request: web.Request) -> web.Response:
        try:
            BeginWeightUpdateRequest.from_json(await self._json_body(request, empty_ok=True))
        except RequestError as exc:
            return self._error(exc)
        if self._weight_session:
            return self._control(ControlResult(False, "a weight-update session is already open; call "
                                                      "end_weight_update() first"))
        self._weight_session = True
        return self._control(ControlResult(True, "Success"))

    async def _handle_end_weight_update(self, request: web.Request) -> web.Response:
        try:
            parse_end_weight_update(await self._json_body(request, empty_ok=True))
        except RequestError as exc:
            return self._error(exc)
        if not self._weight_session:
            return self._control(ControlResult(False, "no weight-update session is open; call "
                                                      "begin_weight_update() first"))
        self._weight_session = False
        return self._control(ControlResult(True, "Success"))

    async def _handle_update_distributed(self, request: web.Request) -> web.Response:
        try:
            parsed = UpdateWeightsFromDistributedRequest.from_json(await self._json_body(request, empty_ok=False))
            specs = self._receive_specs(parsed)
        except RequestError as exc:
            return self._error(exc)
        # Refusals that happen before receiving, as in SGLang (the sender's broadcast then waits).
        if not self._weight_session:
            return self._control(ControlResult(False, "update_weights_from_distributed must run between "
                                                      "begin_weight_update() and end_weight_update()"))
        if parsed.group_name not in self._weight_groups:
            return self._control(ControlResult(False, f"Failed to receive weights: the group {parsed.group_name!r} "
                                                      f"is not initialized (call init_weights_update_group first)"))
        # Shielded: once receiving, the engine finishes the collective even if the client left.
        result = await asyncio.shield(asyncio.ensure_future(self._receive_and_load(parsed, specs)))
        log.info("engine_weights_distributed", group=parsed.group_name, tensors=len(specs), success=result.success,
                 message=result.message, weight_version=self._weight_version)
        return self._control(result)

    @staticmethod
    def _receive_specs(parsed: UpdateWeightsFromDistributedRequest) -> list[TensorSpec]:
        """What to allocate for the receive; RequestError when it cannot be received at all."""
        if parsed.load_format not in (None, FLATTENED_BUCKET):
            raise RequestError("load_format", f"expected null or {FLATTENED_BUCKET!r}, got {parsed.load_format!r}")
        specs = []
        for i, (name, dtype, shape) in enumerate(zip(parsed.names, parsed.dtypes, parsed.shapes, strict=True)):
            try:
                specs.append(TensorSpec(name, parse_dtype(dtype), shape))
            except ValueError as exc:  # a name this torch build does not have
                raise RequestError(f"dtypes[{i}]", str(exc)) from None
        if parsed.load_format == FLATTENED_BUCKET:
            try:
                Bucket.layout(specs)
            except ValueError as exc:
                raise RequestError("dtypes", f"cannot lay out the flattened bucket: {exc}") from None
        return specs

    async def _receive_and_load(self, parsed: UpdateWeightsFromDistributedRequest, specs: list[TensorSpec]
                                ) -> ControlResult:
        async with self._group_lock:
            group = self._weight_groups.get(parsed.group_name)
            if group is None:  # destroyed while this request waited for the lock
                return ControlResult(False, f"Failed to receive weights: the group {parsed.group_name!r} is not "
                                            f"initialized")
            async with self._weight_update(parsed.abort_all_requests):
                try:
                    received = await in_daemon_thread(
                        lambda: receive_named_tensors(group, specs, parsed.load_format), "engine-weights-receive")
                except Exception as exc:  # a member failed or timed out: this group is out of step
                    return ControlResult(False, f"Failed to receive weights: {exc}")
                if parsed.flush_cache and self._pending():
                    return ControlResult(False, self._flush_refusal("flush_cache"))
                async with self._update_lock:
                    loop = asyncio.get_running_loop()
                    return await loop.run_in_executor(self._executor, self._load_received, received, parsed)

    async def _handle_destroy_weights_group(self, request: web.Request) -> web.Response:
        try:
            parsed = DestroyWeightsUpdateGroupRequest.from_json(await self._json_body(request, empty_ok=True))
        except RequestError as exc:
            return self._error(exc)
        async with self._group_lock:  # after the collectives already queued on it
            group = self._weight_groups.pop(parsed.group_name, None)
            if group is not None:
                group.close()
        log.info("engine_weights_group_destroy", group=parsed.group_name, existed=group is not None)
        if group is None:
            return self._control(ControlResult(False, "The group to be destroyed does not exist."))
        return self._control(ControlResult(True, "Succeeded to destroy custom process group."))

    # -- scheduling (event loop) ----------------------------------------------------------------

    def _complete(self, req: _Request) -> None:
        req.state = "done"
        if not req.future.done():
            req.future.set_result(None)

    def _abort(self, req: _Request, message: str) -> None:
        if req.state == "done":
            return
        if req.state == "waiting":
            for queue in (self._waiting, self._held):
                try:
                    queue.remove(req)
                except ValueError:
                    pass
            req.finish = FinishReason("abort", message=message)
            self._complete(req)
        else:
            req.abort_message = message
            self._kick.set()

    def _abort_all(self, message: str) -> int:
        targets = list(self._requests.values())
        for req in targets:
            self._abort(req, message)
        return len(targets)

    async def _park(self) -> None:
        self._parked.set()
        try:
            await self._kick.wait()
        finally:
            self._kick.clear()
            self._parked.clear()

    async def _until_parked(self) -> None:
        """Returns once the scheduler is waiting between steps (after what it was computing)."""
        self._parked.clear()
        self._kick.set()
        while not self._parked.is_set():
            if self._scheduler is None or self._scheduler.done():
                return
            try:
                await asyncio.wait_for(self._parked.wait(), 1.0)
            except TimeoutError:
                continue

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while not self._closing:
            if self._paused or not self._waiting:
                await self._park()
                continue
            if self.batch_window_s > 0:
                await asyncio.sleep(self.batch_window_s)
            if self._paused or not self._waiting or self._closing:
                continue
            batch = [self._waiting.popleft() for _ in range(min(self.max_batch, len(self._waiting)))]
            for req in batch:
                req.state = "running"
            try:
                retractions = self._retractions  # this wave's cache was computed after these
                wave = await loop.run_in_executor(self._executor, self._prefill, batch)
                while wave.requests:
                    if any(r.abort_message is not None for r in wave.requests):
                        finished = await loop.run_in_executor(self._executor, self._step, wave, False)
                    elif self._paused:
                        await self._park()
                        continue
                    elif self._retractions != retractions:
                        # Retracted while paused: the cache was given up; recompute prompt + tokens
                        # so far with the weights that serve now.
                        retractions = self._retractions
                        wave = await loop.run_in_executor(self._executor, self._prefill, wave.requests)
                        continue
                    else:
                        finished = await loop.run_in_executor(self._executor, self._step, wave, True)
                    for req in finished:
                        self._complete(req)
            except Exception as exc:  # a failed step fails its wave, not the engine
                log.exception("engine_step_failed", error=repr(exc))
                for req in batch:
                    if req.state != "done":
                        req.error = exc
                        self._complete(req)

    # -- compute (the single compute thread) ----------------------------------------------------

    def _forward(self, input_ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor,
                 cache: Any) -> tuple[torch.Tensor, Any]:
        out = self._model(input_ids=input_ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
                          use_cache=True, logits_to_keep=1)
        return out.logits[:, -1].float(), out.past_key_values

    def _prefill(self, batch: list[_Request]) -> _Wave:
        with torch.inference_mode():
            # Prompt plus the tokens so far (none, unless the wave was retracted).
            rows = [r.input_ids + r.output_ids for r in batch]
            width = max(len(r) for r in rows)
            ids = torch.full((len(batch), width), self._pad_id, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for i, row in enumerate(rows):
                n = len(row)
                ids[i, width - n:] = torch.tensor(row, dtype=torch.long)
                mask[i, width - n:] = 1
            positions = (mask.cumsum(1) - 1).clamp_(min=0)
            logits, cache = self._forward(ids, mask, positions, None)
            return _Wave(list(batch), cache, mask, positions[:, -1:], logits, self._weight_version)

    def _step(self, wave: _Wave, sample: bool) -> list[_Request]:
        """Samples one token for every row (when `sample`), retires finished and aborted rows, and
        computes the next logits of the rest. Returns the requests that finished."""
        with torch.inference_mode():
            drawn = self._sample(wave) if sample else []
            finished: list[_Request] = []
            keep: list[int] = []
            for i, req in enumerate(wave.requests):
                if req.abort_message is not None:
                    req.finish = FinishReason("abort", message=req.abort_message)
                    finished.append(req)
                    continue
                if sample:
                    token, logprob = drawn[i]
                    req.add_token(token, logprob, wave.version)
                    self.generated_tokens += 1
                    if self._check_finished(req, token):
                        finished.append(req)
                        continue
                keep.append(i)
            if len(keep) < len(wave.requests):
                if keep:
                    wave.keep(keep)
                else:
                    wave.requests = []
            if sample and wave.requests:
                tokens = torch.tensor([[r.output_ids[-1]] for r in wave.requests], dtype=torch.long)
                wave.mask = torch.cat([wave.mask, torch.ones((len(wave.requests), 1), dtype=torch.long)], dim=1)
                wave.positions = wave.positions + 1
                wave.next_logits, wave.cache = self._forward(tokens, wave.mask, wave.positions, wave.cache)
                wave.version = self._weight_version
            return finished

    def _check_finished(self, req: _Request, token: int) -> bool:
        # As SGLang's Req.check_finished: the length check first; ignore_eos turns off every
        # stop token, the request's stop_token_ids as well as the model's EOS.
        if len(req.output_ids) >= req.max_new_tokens:
            req.finish = FinishReason("length", length=req.max_new_tokens)
        elif not req.params.ignore_eos and (token in req.params.stop_token_ids or token in self._eos_ids):
            req.finish = FinishReason("stop", matched=token)
        return req.finish is not None

    def _sample(self, wave: _Wave) -> list[tuple[int, float]]:
        logits = wave.next_logits
        temperatures = torch.tensor([r.params.temperature if r.params.temperature > 0 else 1.0
                                     for r in wave.requests], dtype=logits.dtype)
        logprobs = torch.log_softmax(logits / temperatures[:, None], dim=-1)
        out = []
        for i, req in enumerate(wave.requests):
            if req.params.temperature == 0:
                token = int(torch.argmax(logits[i]))
            else:
                token = self._draw(logprobs[i], req)
            out.append((token, float(logprobs[i, token])))
        return out

    @staticmethod
    def _draw(logprobs: torch.Tensor, req: _Request) -> int:
        """Inverse-CDF sampling with one uniform draw from the request's generator, after top-k
        and top-p truncation (ties broken by token id: a stable sort)."""
        probs = logprobs.double().exp()
        top_k, top_p = req.params.top_k, req.params.top_p
        ids: torch.Tensor | None = None
        if (top_k == -1 or top_k >= probs.numel()) and top_p >= 1.0:
            values = probs
        else:
            values, ids = torch.sort(probs, descending=True, stable=True)
            if 0 < top_k < values.numel():
                values, ids = values[:top_k], ids[:top_k]
            if top_p < 1.0:
                keep = (values.cumsum(0) - values) < top_p
                keep[0] = True
                values, ids = values[keep], ids[keep]
        cdf = values.cumsum(0)
        u = torch.rand((1,), generator=req.generator, dtype=torch.float64) * cdf[-1]
        j = min(int(torch.searchsorted(cdf, u, right=True)), cdf.numel() - 1)
        return j if ids is None else int(ids[j])

    def _load_weights(self, req: UpdateWeightsFromDiskRequest) -> UpdateWeightsResult:
        from safetensors import safe_open

        def fail(message: str) -> UpdateWeightsResult:
            return UpdateWeightsResult(False, f"Failed to update weights: {message}. The old weights "
                                              f"(version {self._weight_version}) keep serving.")

        if req.load_format not in (None, "auto", "safetensors"):
            return fail(f"load_format {req.load_format!r} is not supported (auto or safetensors)")
        path = Path(req.model_path)
        if not path.is_dir():
            return fail(f"{path} is not a directory")
        files = sorted(path.glob("*.safetensors"))
        if not files:
            return fail(f"no *.safetensors files in {path}")
        params = self._model.state_dict()
        loaded: dict[str, torch.Tensor] = {}
        try:
            for file in files:
                with safe_open(str(file), framework="pt") as handle:
                    for name in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                        if name not in params:
                            return fail(f"{file.name} holds {name!r}, which the served model does not have")
                        tensor = handle.get_tensor(name)
                        if tuple(tensor.shape) != tuple(params[name].shape):
                            return fail(f"shape mismatch for {name!r}: {tuple(tensor.shape)} in {file.name}, "
                                        f"{tuple(params[name].shape)} in the served model")
                        loaded[name] = tensor
        except Exception as exc:  # unreadable or truncated file
            return fail(f"cannot read the safetensors files ({exc})")
        # Tied parameters (e.g. lm_head and embeddings) are saved once: a name is covered when any
        # name sharing its storage was loaded.
        storage: dict[int, list[str]] = {}
        for name, tensor in params.items():
            storage.setdefault(tensor.data_ptr(), []).append(name)
        missing = [name for name, tensor in params.items()
                   if not any(n in loaded for n in storage[tensor.data_ptr()])]
        if missing:
            return fail(f"missing tensors {missing[:5]}{' …' if len(missing) > 5 else ''}")
        with torch.no_grad():
            for name, tensor in loaded.items():
                params[name].copy_(tensor.to(params[name].dtype))
        self.model_path = str(path)
        message = "Succeeded to update model weights."
        if req.weight_version is not None:
            self._weight_version = req.weight_version
            message += f" Weight version updated to {req.weight_version}."
        return UpdateWeightsResult(True, message)

    def _load_received(self, received: list[tuple[str, torch.Tensor]], req: UpdateWeightsFromDistributedRequest
                       ) -> ControlResult:
        """Copies received tensors into the served parameters after checking all of them (the
        compute thread, between two steps): one bad tensor drops the whole bucket."""

        def fail(message: str) -> ControlResult:
            return ControlResult(False, f"Failed to update parameter online: {message}. The old weights of these "
                                        f"tensors (version {self._weight_version}) keep serving.")

        if req.selector == "draft":
            return fail("the embedded engine has no draft model (selector 'draft')")
        params = self._model.state_dict()
        for name, tensor in received:
            target = params.get(name)
            if target is None:
                return fail(f"{name!r} is not a parameter of the served model")
            if tuple(tensor.shape) != tuple(target.shape):
                return fail(f"shape mismatch for {name!r}: received {list(tensor.shape)}, the served model has "
                            f"{list(target.shape)}")
            if tensor.is_floating_point() != target.is_floating_point():
                return fail(f"dtype mismatch for {name!r}: received {tensor.dtype}, the served model has "
                            f"{target.dtype}")
        with torch.no_grad():
            for name, tensor in received:
                params[name].copy_(tensor)  # casts to the parameter's dtype, as a disk load does
        message = "Succeeded to update parameter online."
        if req.weight_version is not None:
            self._weight_version = req.weight_version
            message += f" Weight version updated to {req.weight_version}."
        return ControlResult(True, message)


async def start_engine(model_path: str | Path, *, host: str = "127.0.0.1", port: int = 0, max_batch: int = 64,
                       threads: int = 1, weight_version: str = DEFAULT_WEIGHT_VERSION, batch_window_s: float = 0.005,
                       weights_group_timeout_s: float = 600.0) -> EmbeddedEngine:
    """Loads the model, starts the server and returns the running engine (stop it with `stop()`)."""
    engine = EmbeddedEngine(model_path, host=host, port=port, max_batch=max_batch, threads=threads,
                            weight_version=weight_version, batch_window_s=batch_window_s,
                            weights_group_timeout_s=weights_group_timeout_s)
    await engine.start()
    return engine


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m policyloop.engines.embedded", description=__doc__.split("\n")[0])
    parser.add_argument("--model-path", required=True, help="a Hugging Face causal-LM directory")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--max-batch", type=int, default=64, help="most requests decoded together")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--weight-version", default=DEFAULT_WEIGHT_VERSION,
                        help="the version reported until the first update (SGLang's default: \"default\")")
    parser.add_argument("--batch-window-ms", type=float, default=5.0,
                        help="how long to gather concurrent requests into one wave")
    return parser.parse_args(argv)


async def _serve(args: argparse.Namespace) -> None:
    engine = await start_engine(args.model_path, host=args.host, port=args.port, max_batch=args.max_batch,
                                threads=args.threads, weight_version=args.weight_version,
                                batch_window_s=args.batch_window_ms / 1000)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await engine.stop()


def main(argv: list[str] | None = None) -> None:
    import os

    from policyloop.telemetry.logging import configure_logging

    args = _parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a local directory: never reach for the hub
    configure_logging(service="engine", run_id="", instance=f"{args.host}:{args.port}")
    asyncio.run(_serve(args))


if __name__ == "__main__":
    main()
