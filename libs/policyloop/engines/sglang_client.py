"""The one client the rollout service uses to drive an engine: a real SGLang server or the
embedded engine, over SGLang's native HTTP API (aiohttp).

    async with SGLangClient("http://127.0.0.1:30000", timeout_s=600, retries=3) as engine:
        result = await engine.generate(GenerateRequest(input_ids=[...], sampling_params=SamplingParams(...)))
        await engine.update_weights_from_disk("/ckpt/v7", weight_version="7")

Calls that are safe to repeat (model_info, health, the weight updates from disk and from tensors,
pause, continue, flush, abort) are retried with exponential backoff on connection errors, timeouts and 5xx answers.
`generate` is retried only when the connection could not be opened at all (the server never saw
the request): a request that reached the server may have started decoding, and sending it again
would produce a second, different sample. The colocated weight-sync calls (init/destroy of the
weight-update group, begin/end of the update session, update_weights_from_distributed) are not
retried either (beyond a connection that never opened), for the same reason: an engine that saw
the first request has joined a rendezvous or is waiting for a broadcast that the sender will not
repeat. Failures raise `EngineUnavailable` (cannot reach the engine, or it answered 502/503/504
after the retries), `EngineError` (any other error answer, with `status` and `body`),
`WeightUpdateError` (the update failed or the new version is not served) and
`EngineProtocolError` (an answer that is not what the API promises).

Only fields SGLang has are sent (see `policyloop.engines.protocol`).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, TypeVar

import aiohttp

from policyloop.engines.protocol import (
    DEFAULT_WEIGHT_GROUP,
    PAUSE_MODES,
    SAFETENSORS_FORMAT,
    AbortRequest,
    BeginWeightUpdateRequest,
    ClassifyRequest,
    ClassifyResult,
    ControlResult,
    DestroyWeightsUpdateGroupRequest,
    GenerateRequest,
    GenerateResult,
    InitWeightsUpdateGroupRequest,
    LoadLoraAdapterFromTensorsRequest,
    LoadLoraAdapterRequest,
    LoraUpdateResult,
    ModelInfo,
    UnloadLoraAdapterRequest,
    UpdateWeightsFromDiskRequest,
    UpdateWeightsFromDistributedRequest,
    UpdateWeightsFromTensorRequest,
    UpdateWeightsResult,
    UpdateWeightVersionRequest,
    error_message,
    generate_batch_json,
)
from policyloop.weights.broadcast.engine_control import EngineControlError, WeightSyncError


class WeightAnswer(Protocol):
    """An answer with `success` and `message`: the weight routes' (the embedded engine's staging too)."""

    success: bool
    message: str


R = TypeVar("R", bound=WeightAnswer)
T = TypeVar("T")
A = TypeVar("A", ControlResult, LoraUpdateResult)


class EngineError(EngineControlError):
    """The engine answered with an error."""

    def __init__(self, message: str, status: int | None = None, body: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.body = body


class EngineUnavailable(EngineError):
    """The engine could not be reached (or kept answering 502/503/504)."""


class EngineProtocolError(EngineError):
    """The engine answered something that is not the SGLang API's answer."""


class WeightUpdateError(EngineError, WeightSyncError):
    """A weight update failed (from disk or distributed, or a step of the distributed path: the
    group, the session), or the engine does not report the new weight version."""


_UNAVAILABLE_STATUSES = (502, 503, 504)


@dataclass(frozen=True)
class EngineLoad:
    """How busy an engine is, read from its Prometheus text (summed over its label sets)."""

    queued_requests: float = 0.0
    running_requests: float = 0.0
    kv_used_tokens: float = 0.0
    kv_usage: float | None = None   # fraction of the KV cache in use (None: not reported)

    _NAMES: ClassVar[dict[str, str]] = {
        "sglang:num_queue_reqs": "queued_requests", "sglang:num_running_reqs": "running_requests",
        "sglang:num_used_tokens": "kv_used_tokens", "sglang:token_usage": "kv_usage",
    }

    @classmethod
    def parse(cls, text: str) -> EngineLoad:
        from prometheus_client.parser import text_string_to_metric_families

        found: dict[str, float] = {}
        try:
            for family in text_string_to_metric_families(text):
                field_name = cls._NAMES.get(family.name)
                if field_name is not None:
                    found[field_name] = found.get(field_name, 0.0) + sum(s.value for s in family.samples)
        except ValueError:  # not Prometheus' text format
            return cls()
        return cls(**found)


@dataclass(frozen=True)
class StreamedTokens:
    """A streamed /generate's progress: every output id so far, and the weights that made the last."""

    output_ids: list[int]
    weight_version: str
    output_logprobs: list[float] | None = None  # with return_logprob


class SGLangClient:
    def __init__(self, base_url: str, timeout_s: float = 600.0, retries: int = 3, *, backoff_s: float = 0.2,
                 max_backoff_s: float = 5.0, trace_configs: Sequence[aiohttp.TraceConfig] = ()) -> None:
        """`trace_configs`: aiohttp request tracing (what goes on the wire: logging, the contract test)."""
        self.base_url = base_url.rstrip("/")
        self.trace_configs = list(trace_configs)
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> SGLangClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            # No connection limit: the rollout's concurrency is the engine's batch.
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                                  trace_configs=self.trace_configs or None)
        return self._session

    async def _call(self, method: str, path: str, payload: Any = None, *, idempotent: bool,
                    timeout_s: float | None = None) -> tuple[int, str]:
        """Sends one request (retrying as allowed) and returns (status, body) of a 2xx or 4xx answer."""
        attempts = 1 + max(0, self.retries)
        timeout = aiohttp.ClientTimeout(total=timeout_s or self.timeout_s)
        last: EngineError | None = None
        for attempt in range(attempts):
            if attempt:
                await asyncio.sleep(min(self.max_backoff_s, self.backoff_s * 2 ** (attempt - 1)))
            try:
                async with self._client().request(method, self.base_url + path, json=payload,
                                                  timeout=timeout) as response:
                    body = await response.text()
                    if response.status < 500:
                        return response.status, body
                    error_type = EngineUnavailable if response.status in _UNAVAILABLE_STATUSES else EngineError
                    last = error_type(f"{method} {path}: HTTP {response.status}: {body[:500]}", response.status, body)
                    if not idempotent:
                        raise last
            except aiohttp.ClientConnectorError as exc:  # never reached the server: always safe to retry
                last = EngineUnavailable(f"{method} {path}: cannot connect to {self.base_url} ({exc})")
            except (aiohttp.ClientError, TimeoutError) as exc:
                kind = "timed out" if isinstance(exc, TimeoutError) else f"connection failed ({exc!r})"
                last = EngineUnavailable(f"{method} {path}: {kind} talking to {self.base_url}")
                if not idempotent:
                    raise last from exc
        assert last is not None
        raise last

    @staticmethod
    def _json(path: str, status: int, body: str) -> Any:
        try:
            return json.loads(body)
        except ValueError as exc:
            raise EngineProtocolError(f"{path}: answer is not JSON: {body[:200]!r}", status, body) from exc

    @staticmethod
    def _raise_for_status(method: str, path: str, status: int, body: str) -> None:
        if status >= 400:
            try:
                message = error_message(json.loads(body)) or body
            except ValueError:
                message = body
            raise EngineError(f"{method} {path}: HTTP {status}: {str(message)[:500]}", status, body)

    # -- the API --------------------------------------------------------------------------------

    async def generate(self, req: GenerateRequest) -> GenerateResult:
        status, body = await self._call("POST", "/generate", req.to_json(), idempotent=False)
        self._raise_for_status("POST", "/generate", status, body)
        try:
            return GenerateResult.from_json(self._json("/generate", status, body))
        except (ValueError, KeyError, TypeError, IndexError) as exc:
            raise EngineProtocolError(f"/generate: unexpected answer ({exc})", status, body) from exc

    async def generate_stream(self, req: GenerateRequest) -> AsyncIterator[StreamedTokens | GenerateResult]:
        """/generate with stream: what the engine has produced so far after each step
        (StreamedTokens, cumulative), then the whole answer (GenerateResult). Not retried: a
        stream that breaks raises EngineUnavailable."""
        payload = {**req.to_json(), "stream": True}
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        try:
            async with self._client().post(self.base_url + "/generate", json=payload, timeout=timeout) as response:
                if response.status >= 400:
                    self._raise_for_status("POST", "/generate", response.status, await response.text())
                async for raw in response.content:
                    line = raw.decode().strip()
                    if not line.startswith("data:"):
                        continue
                    data = line.removeprefix("data:").strip()
                    if data == "[DONE]":
                        return
                    chunk = self._json("/generate", response.status, data)
                    if isinstance(chunk, dict) and "error" in chunk:
                        raise EngineError(f"POST /generate: {error_message(chunk) or data[:500]}", 500, data)
                    try:
                        meta = chunk["meta_info"]
                        if meta.get("finish_reason") is None:
                            logprobs = meta.get("output_token_logprobs")
                            yield StreamedTokens(output_ids=list(chunk["output_ids"]),
                                                 weight_version=str(meta.get("weight_version") or ""),
                                                 output_logprobs=None if logprobs is None else
                                                 [float(entry[0]) for entry in logprobs])
                        else:
                            yield GenerateResult.from_json(chunk)
                    except (ValueError, KeyError, TypeError, IndexError) as exc:
                        raise EngineProtocolError(f"/generate: unexpected stream event ({exc})", response.status,
                                                  data) from exc
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise EngineUnavailable(f"POST /generate: the stream from {self.base_url} broke ({exc!r})") from exc

    async def generate_batch(self, requests: Sequence[GenerateRequest]) -> list[GenerateResult]:
        """Several prompts in one /generate call (SGLang's batch form), answered in order. The
        requests may differ only in their prompt and the per-prompt fields (rid, sampling_params,
        return_logprob, ...)."""
        status, body = await self._call("POST", "/generate", generate_batch_json(requests), idempotent=False)
        self._raise_for_status("POST", "/generate", status, body)
        answers = self._json("/generate", status, body)
        if not isinstance(answers, list) or len(answers) != len(requests):
            raise EngineProtocolError(f"/generate: expected a list of {len(requests)} answers to a batch", status, body)
        try:
            results = [GenerateResult.from_json(answer) for answer in answers]
        except (ValueError, KeyError, TypeError, IndexError) as exc:
            raise EngineProtocolError(f"/generate: unexpected answer ({exc})", status, body) from exc
        for request, result in zip(requests, results, strict=True):
            if request.rid is not None and result.rid != request.rid:
                raise EngineProtocolError(f"/generate: the answer for rid {request.rid!r} came as {result.rid!r}",
                                          status, body)
        return results

    async def classify(self, prompts: Sequence[str] | Sequence[Sequence[int]],
                       rids: Sequence[str] | None = None) -> list[ClassifyResult]:
        """A reward model's scores of each prompt (texts or token ids) in one /classify call
        (SGLang's batch form), answered in order. Scoring changes nothing: it is retried."""
        texts = bool(prompts) and isinstance(prompts[0], str)
        request = ClassifyRequest(**{"text" if texts else "input_ids": [p if texts else list(p) for p in prompts]},
                                  rid=list(rids) if rids is not None else None)
        status, body = await self._call("POST", "/classify", request.to_json(), idempotent=True)
        self._raise_for_status("POST", "/classify", status, body)
        answers = self._json("/classify", status, body)
        if not isinstance(answers, list) or len(answers) != len(prompts):
            raise EngineProtocolError(f"/classify: expected a list of {len(prompts)} answers to a batch", status, body)
        try:
            results = [ClassifyResult.from_json(answer) for answer in answers]
        except (ValueError, KeyError, TypeError) as exc:
            raise EngineProtocolError(f"/classify: unexpected answer ({exc})", status, body) from exc
        if rids is not None and [r.rid for r in results] != list(rids):
            raise EngineProtocolError("/classify: the answers' ids are not the rids sent, in order", status, body)
        return results

    async def model_info(self) -> ModelInfo:
        status, body = await self._call("GET", "/model_info", idempotent=True)
        if status == 404:  # SGLang before /model_info existed
            status, body = await self._call("GET", "/get_model_info", idempotent=True)
        self._raise_for_status("GET", "/model_info", status, body)
        try:
            return ModelInfo.from_json(self._json("/model_info", status, body))
        except ValueError as exc:
            raise EngineProtocolError(f"/model_info: unexpected answer ({exc})", status, body) from exc

    async def health(self, timeout_s: float = 5.0) -> bool:
        """True when the engine answers /health with 200 (one try, no retries)."""
        try:
            async with self._client().get(self.base_url + "/health",
                                          timeout=aiohttp.ClientTimeout(total=timeout_s)) as response:
                await response.read()
                return response.status == 200
        except (aiohttp.ClientError, TimeoutError):
            return False

    async def load(self, timeout_s: float = 5.0) -> EngineLoad | None:
        """The engine's queue, running requests and KV cache use from its /metrics (SGLang's names;
        SGLang serves them with --enable-metrics). None when it has no /metrics. One try."""
        try:
            async with self._client().get(self.base_url + "/metrics",
                                          timeout=aiohttp.ClientTimeout(total=timeout_s)) as response:
                if response.status != 200:
                    return None
                text = await response.text()
        except (aiohttp.ClientError, TimeoutError):
            return None
        return EngineLoad.parse(text)

    async def wait_healthy(self, timeout_s: float = 60.0, interval_s: float = 0.2) -> None:
        """Waits until /health answers 200, or raises EngineUnavailable."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not await self.health(timeout_s=max(0.5, min(5.0, deadline - loop.time()))):
            if loop.time() >= deadline:
                raise EngineUnavailable(f"{self.base_url} not healthy after {timeout_s:.0f} s")
            await asyncio.sleep(interval_s)

    async def update_weights_from_disk(self, model_path: str, weight_version: str, flush_cache: bool = True, *,
                                       abort_all_requests: bool = False,
                                       load_format: str | None = None) -> UpdateWeightsResult:
        """Loads the weights in `model_path` and makes `weight_version` the served version; checks
        that the update succeeded and that /model_info then reports `weight_version`."""
        req = UpdateWeightsFromDiskRequest(model_path=model_path, weight_version=str(weight_version),
                                           load_format=load_format, abort_all_requests=abort_all_requests,
                                           flush_cache=flush_cache)
        return await self._versioned_update("/update_weights_from_disk", req.to_json(), UpdateWeightsResult.from_json,
                                            f"update_weights_from_disk({model_path!r})", str(weight_version))

    async def update_weights_from_tensor(self, safetensors: bytes, weight_version: str, flush_cache: bool = True, *,
                                         abort_all_requests: bool = False) -> UpdateWeightsResult:
        """Loads the tensors of one safetensors file sent in the request (load_format
        "safetensors", which the embedded engine takes; SGLang takes pickles only, so an SGLang
        engine loads versions from a directory) and makes `weight_version` the served version,
        checked as update_weights_from_disk checks it. Nothing is written to disk."""
        req = UpdateWeightsFromTensorRequest(serialized_named_tensors=[safetensors], load_format=SAFETENSORS_FORMAT,
                                             weight_version=str(weight_version), flush_cache=flush_cache,
                                             abort_all_requests=abort_all_requests)
        return await self._versioned_update("/update_weights_from_tensor", req.to_json(), UpdateWeightsResult.from_json,
                                            "update_weights_from_tensor", str(weight_version))

    async def update_weight_version(self, new_version: str, *, abort_all_requests: bool = False) -> ControlResult:
        """Relabels the served weights as `new_version` (nothing is loaded) and checks that
        /model_info then reports it. SGLang boots at version "default": the rollout names the
        base weights "0" this way before it generates anything."""
        req = UpdateWeightVersionRequest(new_version=str(new_version), abort_all_requests=abort_all_requests)
        return await self._versioned_update("/update_weight_version", req.to_json(), ControlResult.from_json,
                                            f"update_weight_version({new_version!r})", str(new_version))

    async def _versioned_update(self, path: str, payload: dict[str, Any], parse: Callable[[Any], R], what: str,
                                version: str, *, idempotent: bool = True) -> R:
        """Sends an update that sets the served version (resent on a lost answer when
        `idempotent`), checks its `{success, message}` answer and then that /model_info reports
        `version`."""
        result = await self._succeeded(path, payload, parse, what, idempotent=idempotent)
        served = (await self.model_info()).weight_version
        if served != version:
            raise WeightUpdateError(f"{what} succeeded but the engine reports weight_version {served!r}, not "
                                    f"{version!r}", 200, "")
        return result

    async def _succeeded(self, path: str, payload: dict[str, Any], parse: Callable[[Any], R], what: str, *,
                         idempotent: bool) -> R:
        """Sends a weight request and returns its successful `{success, message}` answer;
        WeightUpdateError with the engine's reason otherwise."""
        status, body, result = await self._parsed(path, payload, parse, idempotent=idempotent)
        if not result.success or status >= 400:
            raise WeightUpdateError(f"{what} failed: {result.message}", status, body)
        return result

    async def pause_generation(self, mode: str = "abort") -> None:
        """mode abort: in-flight requests end now (finish_reason abort); in_place: they stop
        between two steps and resume on continue_generation; retract: SGLang frees their KV cache
        and recomputes it on continue. New requests wait until continue_generation."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"mode must be one of {PAUSE_MODES}, got {mode!r}")
        status, body = await self._call("POST", "/pause_generation", {"mode": mode}, idempotent=True)
        self._raise_for_status("POST", "/pause_generation", status, body)

    async def continue_generation(self) -> None:
        status, body = await self._call("POST", "/continue_generation", {}, idempotent=True)
        self._raise_for_status("POST", "/continue_generation", status, body)

    async def flush_cache(self) -> None:
        """Drops the prefix cache (SGLang refuses, with 400, while requests are in flight)."""
        status, body = await self._call("POST", "/flush_cache", None, idempotent=True)
        self._raise_for_status("POST", "/flush_cache", status, body)

    async def abort_request(self, rid: str | None = None, *, abort_all: bool = False) -> None:
        """Ends request `rid` (or every request): it answers with finish_reason abort and the
        tokens it has. An unknown or finished rid is not an error."""
        if rid is None and not abort_all:
            raise ValueError("give a rid or abort_all=True")
        payload = AbortRequest(rid=rid, abort_all=abort_all).to_json()
        status, body = await self._call("POST", "/abort_request", payload, idempotent=True)
        self._raise_for_status("POST", "/abort_request", status, body)

    # -- LoRA adapters ----------------------------------------------------------------------------

    async def load_lora_adapter(self, lora_name: str, lora_path: str) -> LoraUpdateResult:
        """Loads the peft adapter directory `lora_path` under `lora_name` (what /generate's
        lora_path then names); raises EngineError with the engine's reason when it is refused."""
        payload = LoadLoraAdapterRequest(lora_name=lora_name, lora_path=lora_path).to_json()
        return await self._lora_update("/load_lora_adapter", payload)

    async def load_lora_adapter_from_tensors(self, lora_name: str, config_dict: dict[str, Any], safetensors: bytes,
                                             expected_checksums: dict[str, str] | None = None) -> LoraUpdateResult:
        """Loads an adapter sent in the request under `lora_name`: its adapter_config.json as a
        dict and its tensors as one safetensors file (load_format "safetensors", which the embedded
        engine takes; SGLang takes pickles only, so an SGLang engine loads adapters from a
        directory). The engine checks each tensor's sha256 against `expected_checksums` when given."""
        payload = LoadLoraAdapterFromTensorsRequest(
            lora_name=lora_name, config_dict=config_dict, serialized_named_tensors=[safetensors],
            load_format=SAFETENSORS_FORMAT, expected_checksums=expected_checksums).to_json()
        return await self._lora_update("/load_lora_adapter_from_tensors", payload)

    async def unload_lora_adapter(self, lora_name: str) -> LoraUpdateResult:
        return await self._lora_update("/unload_lora_adapter", UnloadLoraAdapterRequest(lora_name=lora_name).to_json())

    async def _post_once(self, path: str, payload: dict[str, Any], parse: Callable[[Any], A]) -> tuple[int, str, A]:
        """Sends one request that is never resent once it may have reached the engine; (status,
        body, the parsed answer), or SGLang's ErrorResponse raised."""
        return await self._parsed(path, payload, parse, idempotent=False)

    async def _parsed(self, path: str, payload: dict[str, Any], parse: Callable[[Any], T], *,
                      idempotent: bool) -> tuple[int, str, T]:
        status, body = await self._call("POST", path, payload, idempotent=idempotent)
        try:
            return status, body, parse(json.loads(body))
        except ValueError:
            self._raise_for_status("POST", path, status, body)  # SGLang's ErrorResponse (validation)
            raise EngineProtocolError(f"{path}: unexpected answer {body[:200]!r}", status, body) from None

    async def _lora_update(self, path: str, payload: dict[str, Any]) -> LoraUpdateResult:
        status, body, result = await self._post_once(path, payload, LoraUpdateResult.from_json)
        if not result.success or status >= 400:
            raise EngineError(f"POST {path}: HTTP {status}: {result.error_message}", status, body)
        return result

    # -- the colocated weight sync (see policyloop.weights.broadcast) --------------------------

    async def _control(self, path: str, payload: dict[str, Any], what: str) -> ControlResult:
        """Sends one weight-sync request (never resent once it may have reached the engine) and
        returns its successful `{success, message}` answer; raises WeightUpdateError otherwise."""
        return await self._succeeded(path, payload, ControlResult.from_json, what, idempotent=False)

    async def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                        world_size: int, *, group_name: str = DEFAULT_WEIGHT_GROUP,
                                        backend: str = "nccl") -> ControlResult:
        """Asks the engine to join the weight-update group hosted by rank 0 at
        master_address:master_port as ranks rank_offset.. (one per TP rank). The answer comes once
        every member joined, so the sender must be joining at the same time."""
        req = InitWeightsUpdateGroupRequest(master_address=master_address, master_port=master_port,
                                            rank_offset=rank_offset, world_size=world_size, group_name=group_name,
                                            backend=backend)
        return await self._control("/init_weights_update_group", req.to_json(),
                                   f"init_weights_update_group({group_name!r}, rank_offset={rank_offset})")

    async def begin_weight_update(self, selector: str = "all") -> ControlResult:
        """Opens the weight-update session SGLang requires around update_weights_from_distributed."""
        return await self._control("/begin_weight_update", BeginWeightUpdateRequest(selector).to_json(),
                                   "begin_weight_update")

    async def end_weight_update(self) -> ControlResult:
        """Closes the weight-update session (SGLang finalises the loaded weights)."""
        return await self._control("/end_weight_update", {}, "end_weight_update")

    async def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]], *,
                                              group_name: str = DEFAULT_WEIGHT_GROUP, load_format: str | None = None,
                                              weight_version: str | None = None, flush_cache: bool = True,
                                              abort_all_requests: bool = False) -> ControlResult:
        """Has the engine receive these tensors from the group's broadcast and load them; the
        answer comes once they arrived, so the sender broadcasts while this call is pending. With
        `weight_version`, checks that /model_info then reports it."""
        req = UpdateWeightsFromDistributedRequest(
            names=tuple(names), dtypes=tuple(dtypes), shapes=tuple(tuple(s) for s in shapes), group_name=group_name,
            flush_cache=flush_cache, abort_all_requests=abort_all_requests,
            weight_version=None if weight_version is None else str(weight_version), load_format=load_format)
        what = f"update_weights_from_distributed({len(names)} tensors, group {group_name!r})"
        result = await self._control("/update_weights_from_distributed", req.to_json(), what)
        if weight_version is not None:
            served = (await self.model_info()).weight_version
            if served != str(weight_version):
                raise WeightUpdateError(f"{what} succeeded but the engine reports weight_version {served!r}, "
                                        f"not {weight_version!r}")
        return result

    async def destroy_weights_update_group(self, group_name: str = DEFAULT_WEIGHT_GROUP) -> ControlResult:
        """Has the engine leave and release the group."""
        return await self._control("/destroy_weights_update_group",
                                   DestroyWeightsUpdateGroupRequest(group_name).to_json(),
                                   f"destroy_weights_update_group({group_name!r})")
