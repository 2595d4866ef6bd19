"""Sampling for the Tinker API, on a rollout replica's engine through the SGLang protocol.

The front puts each accepted asample call on TINKER_SAMPLES; a rollout replica started with
tinker_sampling takes it (TinkerSampling) and samples on its engine. A sampling session names
weights: the base model, or a version of a Tinker model's adapter that its learner published
(save_weights_for_sampler). An adapter version is fetched from the publisher like any version
(an exact delta from the one held, else a keyframe) and loaded into the engine from tensors under
`<weights model>@<version>`; the engine keeps the few most recently used, each freed once no
request samples with it. The result goes on TINKER_RESULTS, where retrieve_future finds it."""

from __future__ import annotations

import asyncio
import math
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence

import numpy as np

from policyloop.bus import Bus, Delivery, PermanentError, PullWorker, tinker_result_subject
from policyloop.contracts.v1 import tinker_pb2, tinker_wire_pb2
from policyloop.engines.protocol import GenerateRequest, SamplingParams
from policyloop.engines.sglang_client import EngineError, SGLangClient
from policyloop.rl.settings import LoraSpec
from policyloop.telemetry.logging import get_logger
from policyloop.weights.client import WeightClient
from policyloop.weights.codec import WeightSet
from policyloop.weights.sync import sync_weights

log = get_logger(__name__)

MAX_SAMPLES = 256      # num_samples of one call
TOKEN_ID_BOUND = 2**31  # the engine refuses ids past int32


class SampleRequestError(ValueError):
    """A sample request that cannot be done; the message names the field."""


def parse_sample_request(body: dict) -> tinker_pb2.TinkerSampleRequest:  # type: ignore[type-arg]
    """The fields of the SDK's SampleRequest this cluster serves, as the replica runs them
    (request_id and session left for the front to fill); SampleRequestError otherwise."""
    prompt = body.get("prompt")
    if not isinstance(prompt, dict) or not isinstance(prompt.get("chunks"), list):
        raise SampleRequestError("prompt: a ModelInput {chunks: [...]} is required")
    tokens: list[int] = []
    for i, chunk in enumerate(prompt["chunks"]):
        if not isinstance(chunk, dict) or chunk.get("type", "encoded_text") != "encoded_text":
            raise SampleRequestError(f"prompt.chunks[{i}]: only encoded_text chunks are supported (text models)")
        ids = chunk.get("tokens")
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise SampleRequestError(f"prompt.chunks[{i}].tokens: a list of token ids is required")
        if not all(0 <= t < TOKEN_ID_BOUND for t in ids):  # else the engine refuses it, reported as a server error
            raise SampleRequestError(f"prompt.chunks[{i}].tokens: token ids are within [0, 2**31)")
        tokens.extend(ids)
    if not tokens:
        raise SampleRequestError("prompt: no tokens")
    num = body.get("num_samples", 1)
    if not isinstance(num, int) or isinstance(num, bool) or not 1 <= num <= MAX_SAMPLES:
        raise SampleRequestError(f"num_samples: from 1 to {MAX_SAMPLES}, got {num!r}")
    params = body.get("sampling_params") or {}
    if not isinstance(params, dict):
        raise SampleRequestError("sampling_params: an object is required")
    request = tinker_pb2.TinkerSampleRequest(prompt=tokens, num_samples=num,
                                             prompt_logprobs=bool(body.get("prompt_logprobs", False)))
    stop = params.get("stop")
    if isinstance(stop, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in stop):
        request.stop.SetInParent()
        request.stop.token_ids.extend(stop)
    elif stop is not None:
        raise SampleRequestError("sampling_params.stop: give token ids (stop strings are not supported here)")
    for name in ("topk_prompt_logprobs", "topk_sample_logprobs", "prompt_alt_tokens_k"):
        if body.get(name):
            raise SampleRequestError(f"{name}: top-k logprobs are not supported by this cluster")
    for name in ("target_prompt_logprobs", "prompt_logprobs_last_n"):
        if body.get(name) is not None:
            raise SampleRequestError(f"{name}: not supported by this cluster")
    if body.get("record_stability_info"):
        raise SampleRequestError("record_stability_info: not supported by this cluster")
    max_tokens = params.get("max_tokens", 16)
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or not 1 <= max_tokens < 2**31:
        raise SampleRequestError(f"sampling_params.max_tokens: a positive integer, got {max_tokens!r}")
    request.max_tokens = max_tokens
    seed = params.get("seed")
    if seed is not None:
        if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
            raise SampleRequestError(f"sampling_params.seed: a non-negative integer, got {seed!r}")
        if seed >= 2**63:
            raise SampleRequestError(f"sampling_params.seed: below 2**63, got {seed}")
        request.seed = seed
    for name, default in (("temperature", 1.0), ("top_p", 1.0), ("top_k", -1)):
        value = params.get(name, default)
        if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
            raise SampleRequestError(f"sampling_params.{name}: a number, got {value!r}")
        if name == "top_k" and not -1 <= value < 2**31:
            raise SampleRequestError(f"sampling_params.top_k: -1 (none) or a count, got {value!r}")
        setattr(request, name, int(value) if name == "top_k" else float(value))
    return request


def validate_sample_request(request: tinker_pb2.TinkerSampleRequest) -> None:
    """What a replica checks of a TINKER_SAMPLES message before it samples (ValueError: the
    message is dead-lettered with the reason); the front's requests pass."""
    if not request.request_id:
        raise ValueError("request_id: required (the result is put under it)")
    if not request.HasField("session"):
        raise ValueError("session: required (what to sample with)")
    if not request.prompt or not all(0 <= t < TOKEN_ID_BOUND for t in request.prompt):
        raise ValueError("prompt: token ids within [0, 2**31), at least one")
    if not 1 <= request.num_samples <= MAX_SAMPLES:
        raise ValueError(f"num_samples: from 1 to {MAX_SAMPLES}, got {request.num_samples}")
    if request.max_tokens < 1:
        raise ValueError("max_tokens: at least 1")
    if request.session.weights_model and (request.session.version < 1 or not request.session.fetch_endpoint):
        raise ValueError("session: an adapter's version (from 1) and the publisher it is fetched from")
    if not all(math.isfinite(v) for v in (request.temperature, request.top_p)):
        raise ValueError("temperature, top_p: finite numbers")
    if request.HasField("stop") and not all(0 <= t < TOKEN_ID_BOUND for t in request.stop.token_ids):
        raise ValueError("stop.token_ids: token ids within [0, 2**31)")


def _floats(values: Sequence[float | None]) -> bytes:
    return np.asarray([np.nan if v is None else v for v in values], dtype="<f4").tobytes()


class EngineSampler:
    def __init__(self, engine: SGLangClient, publisher_for: Callable[[str], WeightClient],
                 keep_loaded: int = 4) -> None:
        self.engine, self.publisher_for, self.keep_loaded = engine, publisher_for, keep_loaded
        self.held: dict[str, WeightSet] = {}              # per weights model: the newest fetched (delta base)
        self.loaded: OrderedDict[str, None] = OrderedDict()  # names in the engine, least recently used first
        self.in_use: Counter[str] = Counter()
        self._loading = asyncio.Lock()

    async def sample(self, request: tinker_pb2.TinkerSampleRequest) -> tinker_wire_pb2.SampleResponse:
        session = request.session
        name = await self._acquire(session) if session.weights_model else None
        try:
            stop = tuple(request.stop.token_ids) if request.HasField("stop") else None
            params = SamplingParams(max_new_tokens=request.max_tokens, temperature=request.temperature,
                                    top_p=request.top_p, top_k=request.top_k, stop_token_ids=stop or (),
                                    ignore_eos=stop == ())
            requests = [GenerateRequest(
                input_ids=list(request.prompt), rid=f"{request.request_id}:{i}", lora_path=name, return_logprob=True,
                sampling_params=params if not request.HasField("seed") else params.model_copy(
                    update={"sampling_seed": request.seed + i}),
                logprob_start_len=0 if request.prompt_logprobs and i == 0 else -1)
                for i in range(request.num_samples)]
            results = await self.engine.generate_batch(requests)
        finally:
            if name is not None:
                self.in_use[name] -= 1
        response = tinker_wire_pb2.SampleResponse()
        for result in results:
            response.sequences.add(
                stop_reason=tinker_wire_pb2.STOP_REASON_LENGTH if result.finish_reason == "length"
                else tinker_wire_pb2.STOP_REASON_STOP,
                tokens=np.asarray(result.output_ids, dtype="<i4").tobytes(),
                logprobs=_floats(result.output_logprobs or []))
        if request.prompt_logprobs:
            response.prompt_logprobs = _floats(results[0].input_logprobs or [None] * len(request.prompt))
        return response

    async def _acquire(self, session: tinker_pb2.TinkerSamplingSession) -> str:
        name = f"{session.weights_model}@{session.version}"
        async with self._loading:
            if name not in self.loaded:
                held = self.held.get(session.weights_model)
                client = self.publisher_for(session.fetch_endpoint)
                weights, report = await sync_weights(client, session.weights_model, held, session.version)
                from policyloop.rl.lora import adapter_config_dict, adapter_safetensors
                from policyloop.weights.torch_io import to_tensor

                tensors = {k: to_tensor(t) for k, t in weights.tensors.items()}
                payload, checksums = await asyncio.to_thread(adapter_safetensors, tensors)
                await self.engine.load_lora_adapter_from_tensors(
                    name, adapter_config_dict(LoraSpec.from_proto(session.lora)), payload, checksums)
                if held is None or weights.version >= held.version:
                    self.held[session.weights_model] = weights
                self.loaded[name] = None
                log.info("tinker_sampler_loaded", name=name, kind=report.kind, payload_bytes=report.payload_bytes)
            self.loaded.move_to_end(name)
            self.in_use[name] += 1
            await self._evict()
        return name

    async def _evict(self) -> None:
        for name in list(self.loaded):
            if len(self.loaded) <= self.keep_loaded:
                return
            if not self.in_use[name]:
                del self.loaded[name]
                await self.engine.unload_lora_adapter(name)


class TinkerSampling:
    """A rollout replica's share of TINKER_SAMPLES: each request sampled on its engine, the
    result put on TINKER_RESULTS under the request id (a redelivered request's result is stored
    once: the request id is its message id). A request the engine refuses (4xx) is answered with
    that error; one that keeps failing otherwise (the publisher or the engine away) is retried,
    and answered with the last error on its last delivery. Either way the client is told, and the
    request goes to the DLQ with the reason."""

    def __init__(self, bus: Bus, sampler: EngineSampler, *, concurrency: int = 64,
                 ready: Callable[[], bool] | None = None, service: str = "rollout") -> None:
        self.bus, self.sampler, self.concurrency, self.ready, self.service = bus, sampler, concurrency, ready, service
        self.done = 0  # requests answered with samples
        self.max_deliver = bus.topology.consumers["tinker-sampling"].max_deliver

    def pull_worker(self) -> PullWorker[tinker_pb2.TinkerSampleRequest]:
        return PullWorker(self.bus, self.bus.topology.consumers["tinker-sampling"], tinker_pb2.TinkerSampleRequest,
                          self.handle, service=self.service, concurrency=self.concurrency,
                          validator=validate_sample_request, ready=self.ready)

    async def handle(self, delivery: Delivery[tinker_pb2.TinkerSampleRequest]) -> None:
        request = delivery.message
        result = tinker_pb2.TinkerResult(request_id=request.request_id)
        try:
            result.sample.CopyFrom(await self.sampler.sample(request))
        except Exception as exc:
            refused = isinstance(exc, EngineError) and exc.status is not None and 400 <= exc.status < 500
            if not refused and delivery.delivery_count < self.max_deliver:
                raise  # retried: the engine or the publisher may be back
            await self._answer(result, f"sampling failed: {exc}", "user" if refused else "server")
            raise PermanentError(f"sample request {request.request_id} failed on delivery "
                                 f"{delivery.delivery_count}: {exc!r}") from exc
        await self.bus.publish(tinker_result_subject(request.request_id), result,
                               f"tinker-result-{request.request_id}")
        self.done += 1

    async def _answer(self, result: tinker_pb2.TinkerResult, message: str, category: str) -> None:
        log.warning("tinker_sample_failed", request=result.request_id, error=message)
        result.error.CopyFrom(tinker_pb2.TinkerError(message=message, category=category))
        await self.bus.publish(tinker_result_subject(result.request_id), result, f"tinker-result-{result.request_id}")
