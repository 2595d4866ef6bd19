"""Sampling for the Tinker API on an engine of the cluster, through the SGLang protocol.

A sampling session names weights: the base model, or a version of a Tinker model's adapter
that its learner published (save_weights_for_sampler). An adapter version is fetched from the
publisher like any version (an exact delta from the one held, else a keyframe) and loaded into
the engine from tensors under `<weights model>@<version>`; the engine keeps the few most
recently used, each freed once no request samples with it."""

from __future__ import annotations

import asyncio
import math
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from policyloop.contracts.v1 import tinker_pb2, tinker_wire_pb2
from policyloop.engines.protocol import GenerateRequest, SamplingParams
from policyloop.engines.sglang_client import SGLangClient
from policyloop.rl.settings import LoraSpec
from policyloop.telemetry.logging import get_logger
from policyloop.weights.client import WeightClient
from policyloop.weights.codec import WeightSet
from policyloop.weights.sync import sync_weights

log = get_logger(__name__)


class SampleRequestError(ValueError):
    """A sample request that cannot be done; the message names the field."""


@dataclass(frozen=True)
class SampleSpec:
    """One asample call, as the engine runs it."""

    prompt: list[int]
    num_samples: int
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop_token_ids: tuple[int, ...] | None  # None: the model's EOS; (): nothing stops, EOS included
    prompt_logprobs: bool


def parse_sample_request(body: dict) -> SampleSpec:  # type: ignore[type-arg]
    """The fields of the SDK's SampleRequest this cluster serves; SampleRequestError otherwise."""
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
        if not all(0 <= t < 2**31 for t in ids):  # else the engine refuses it, reported as a server error
            raise SampleRequestError(f"prompt.chunks[{i}].tokens: token ids are within [0, 2**31)")
        tokens.extend(ids)
    if not tokens:
        raise SampleRequestError("prompt: no tokens")
    num = body.get("num_samples", 1)
    if not isinstance(num, int) or isinstance(num, bool) or not 1 <= num <= 256:
        raise SampleRequestError(f"num_samples: from 1 to 256, got {num!r}")
    params = body.get("sampling_params") or {}
    if not isinstance(params, dict):
        raise SampleRequestError("sampling_params: an object is required")
    stop = params.get("stop")
    if stop is None:
        stop_ids: tuple[int, ...] | None = None
    elif isinstance(stop, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in stop):
        stop_ids = tuple(stop)
    else:
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
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise SampleRequestError(f"sampling_params.max_tokens: a positive integer, got {max_tokens!r}")
    seed = params.get("seed")
    if seed is not None and (not isinstance(seed, int) or seed < 0):
        raise SampleRequestError(f"sampling_params.seed: a non-negative integer, got {seed!r}")
    numbers = {}
    for name, default in (("temperature", 1.0), ("top_p", 1.0), ("top_k", -1)):
        value = params.get(name, default)
        if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
            raise SampleRequestError(f"sampling_params.{name}: a number, got {value!r}")
        numbers[name] = value
    if seed is not None and seed >= 2**63:
        raise SampleRequestError(f"sampling_params.seed: below 2**63, got {seed}")
    return SampleSpec(prompt=tokens, num_samples=num, max_tokens=max_tokens,
                      temperature=float(numbers["temperature"]), top_p=float(numbers["top_p"]),
                      top_k=int(numbers["top_k"]), seed=seed, stop_token_ids=stop_ids,
                      prompt_logprobs=bool(body.get("prompt_logprobs", False)))


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

    async def sample(self, session: tinker_pb2.TinkerSamplingSession, spec: SampleSpec,
                     rid: str) -> tinker_wire_pb2.SampleResponse:
        name = await self._acquire(session) if session.weights_model else None
        try:
            params = SamplingParams(max_new_tokens=spec.max_tokens, temperature=spec.temperature, top_p=spec.top_p,
                                    top_k=spec.top_k, stop_token_ids=spec.stop_token_ids or (),
                                    ignore_eos=spec.stop_token_ids == ())
            requests = [GenerateRequest(
                input_ids=spec.prompt, rid=f"{rid}:{i}", lora_path=name, return_logprob=True,
                sampling_params=params if spec.seed is None else params.model_copy(
                    update={"sampling_seed": spec.seed + i}),
                logprob_start_len=0 if spec.prompt_logprobs and i == 0 else -1)
                for i in range(spec.num_samples)]
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
        if spec.prompt_logprobs:
            response.prompt_logprobs = _floats(results[0].input_logprobs or [None] * len(spec.prompt))
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
