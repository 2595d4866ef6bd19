"""The contract with SGLang 0.5.23: every request the client can send, as it goes on the wire, is
checked against SGLang's own API (tests/data/sglang-0.5.23-api.json, extracted from the wheel):
the route exists, takes the method, and the body has only fields SGLang's request struct has,
with every field SGLang requires. The requests are captured by aiohttp tracing while the client
talks to the embedded engine, so what is checked is what was sent."""

from __future__ import annotations

import base64
import inspect
import json
import re
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import aiohttp
import pytest

from policyloop.engines.embedded import EmbeddedEngine, start_engine
from policyloop.engines.partial import generate_resumable, generate_resumable_batch
from policyloop.engines.protocol import GenerateRequest, SamplingParams
from policyloop.engines.sglang_client import EngineError, SGLangClient
from tests.helpers import make_lora_adapter
from tests.integration.test_engine_lora import sent_as_tensors
from tests.tiny_model import build_tiny_reward_model

REFERENCE = json.loads((Path(__file__).resolve().parents[1] / "data" / "sglang-0.5.23-api.json").read_text())
# io_struct.BaseReq (the base of every *ReqInput but GenerateReqInput), left out of the extraction.
BASE_REQ_FIELDS = {"rid", "http_worker_ipc"}
# Served by SGLang beside its routes: Prometheus' ASGI app mounted at /metrics with --enable-metrics
# (the replica reads its engine's load there; the compose and Kubernetes SGLang commands enable it).
MOUNTED = {"/metrics": ["GET"]}


@pytest.fixture
async def engine(tiny_model_dir: Path) -> AsyncIterator[EmbeddedEngine]:
    running = await start_engine(tiny_model_dir, max_batch=8, threads=1, weight_version="0")
    yield running
    await running.stop()


def capturing() -> tuple[aiohttp.TraceConfig, list[tuple[str, str, Any]]]:
    """A trace config recording (method, path, JSON body or None) of every request sent."""
    sent: list[tuple[str, str, Any]] = []
    trace = aiohttp.TraceConfig(trace_config_ctx_factory=lambda trace_request_ctx: SimpleNamespace(chunks=[]))

    async def on_chunk(_session: object, ctx: SimpleNamespace, params: aiohttp.TraceRequestChunkSentParams) -> None:
        ctx.chunks.append(params.chunk)

    async def on_end(_session: object, ctx: SimpleNamespace, params: aiohttp.TraceRequestEndParams) -> None:
        raw = b"".join(ctx.chunks)
        sent.append((params.method, params.url.path, json.loads(raw) if raw else None))

    trace.on_request_chunk_sent.append(on_chunk)
    trace.on_request_end.append(on_end)
    return trace, sent


def struct_of(route: str) -> str | None:
    request_type = REFERENCE["routes"][route]["request_type"] or ""
    match = re.search(r"\b(\w+Req(?:Input)?)\b", request_type)
    return match.group(1) if match else None


def violations(method: str, path: str, body: Any) -> list[str]:
    """What SGLang 0.5.23 would not take in this request."""
    if path in MOUNTED:
        return [] if method in MOUNTED[path] and not body else [f"{method} {path}: SGLang serves it to GET only"]
    route = REFERENCE["routes"].get(path)
    if route is None:
        return [f"{path}: SGLang has no such route"]
    problems = [] if method in route["methods"] else [f"{method} {path}: SGLang takes {route['methods']}"]
    struct = struct_of(path)
    if struct is None:
        return problems + ([f"{path}: SGLang takes no body, got {body!r}"] if body else [])
    spec = REFERENCE["request_structs"][struct]
    fields = set(spec["fields"]) | (BASE_REQ_FIELDS if "BaseReq" in spec["bases"] else set())
    body = body or {}
    problems += [f"{path}: {struct} has no field {name!r}" for name in body if name not in fields]
    required = [name for name, f in spec["fields"].items() if f["default"] is None]
    problems += [f"{path}: {struct} requires {name!r}" for name in required if name not in body]
    if struct == "GenerateReqInput":
        # The batch form: a list where SGLang's type for the field takes one.
        takes_lists = {name for name, f in spec["fields"].items() if "List" in f["type"]}
        problems += [f"{path}: {struct}.{name} takes no list" for name, value in body.items()
                     if isinstance(value, list) and name in spec["fields"] and name not in takes_lists]
        sampling = set(REFERENCE["sampling_params_fields"])
        params = body.get("sampling_params") or {}
        for one in params if isinstance(params, list) else [params]:
            problems += [f"{path}: SamplingParams has no {name!r}" for name in one if name not in sampling]
    return problems


def check_the_bodies_sent(sent: list[tuple[str, str, Any]], adapter: Path, payload: bytes,
                          checksums: dict[str, str], model_file: bytes) -> None:
    """What the client put in the bodies: batches, adapters (`payload`: one's tensors) and a version's tensors."""
    bodies = {path: body for _, path, body in sent if body}
    assert bodies["/pause_generation"]["mode"]
    generated = [body for _, path, body in sent if path == "/generate"]
    assert generated[0]["sampling_params"]["sampling_seed"] == 3
    batches = [body for body in generated if isinstance(body["input_ids"][0], list)]
    assert len(batches) == 3 and batches[0]["rid"] == ["b1", "c2"] and len(batches[0]["sampling_params"]) == 2
    assert batches[2]["lora_path"] == ["run-a@3", None] and generated[-3]["lora_path"] == "run-a@3"
    assert generated[-1]["lora_path"] == "run-a@4"
    assert bodies["/load_lora_adapter"] == {"lora_name": "run-a@3", "lora_path": str(adapter)}
    from_tensors = bodies["/load_lora_adapter_from_tensors"]
    assert from_tensors["load_format"] == "safetensors" and from_tensors["expected_checksums"] == checksums
    assert [base64.b64decode(c) for c in from_tensors["serialized_named_tensors"]] == [payload]
    whole_model = bodies["/update_weights_from_tensor"]
    assert whole_model["load_format"] == "safetensors" and whole_model["weight_version"] == "6"
    assert [base64.b64decode(c) for c in whole_model["serialized_named_tensors"]] == [model_file]


async def test_every_client_request_is_one_sglang_takes(engine: EmbeddedEngine, tiny_model_dir: Path,
                                                        tmp_path: Path) -> None:
    adapter = make_lora_adapter(tiny_model_dir, tmp_path / "adapter", seed=1)
    trace, sent = capturing()
    async with SGLangClient(engine.base_url, timeout_s=30, retries=0, trace_configs=[trace]) as client:
        exercised = set()

        async def call(name: str, *args: Any, **kwargs: Any) -> Any:
            exercised.add(name)
            try:
                return await getattr(client, name)(*args, **kwargs)
            except EngineError:  # refusals still went on the wire: the request is what is checked
                return None

        request = GenerateRequest(input_ids=[4, 5, 14, 6, 16], rid="c1", return_text_in_logprobs=True,
                                  sampling_params=SamplingParams(max_new_tokens=4, temperature=0.7, top_p=0.9, top_k=5,
                                                                 stop_token_ids=(1,), sampling_seed=3, ignore_eos=True))
        await call("generate", request)
        await generate_resumable(client, request)
        second = request.model_copy(update={"rid": "c2", "input_ids": [5, 14, 5, 16]})
        await call("generate_batch", [request.model_copy(update={"rid": "b1"}), second])
        await generate_resumable_batch(client, [request.model_copy(update={"rid": "b3"}), second])
        await call("load_lora_adapter", "run-a@3", str(adapter))
        await call("generate", request.model_copy(update={"rid": "l1", "lora_path": "run-a@3"}))
        await call("generate_batch", [request.model_copy(update={"rid": "l2", "lora_path": "run-a@3"}),
                                      second.model_copy(update={"rid": "l3"})])
        await call("unload_lora_adapter", "run-a@3")
        config, payload, checksums = sent_as_tensors(adapter)
        await call("load_lora_adapter_from_tensors", "run-a@4", config, payload, checksums)
        await call("generate", request.model_copy(update={"rid": "l4", "lora_path": "run-a@4", "logprob_start_len": 0}))
        await call("unload_lora_adapter", "run-a@4")
        await call("model_info")
        await call("load")
        await call("health")
        await call("wait_healthy", 5)
        await call("update_weights_from_disk", str(tiny_model_dir), weight_version="1", flush_cache=True,
                   abort_all_requests=True, load_format=None)
        model_file = (tiny_model_dir / "model.safetensors").read_bytes()
        await call("update_weights_from_tensor", model_file, weight_version="6", flush_cache=True,
                   abort_all_requests=False)
        await call("update_weight_version", "7", abort_all_requests=False)
        for mode in ("in_place", "retract", "abort"):
            await call("pause_generation", mode)
            await call("continue_generation")
        await call("flush_cache")
        await call("abort_request", "c1")
        await call("abort_request", abort_all=True)
        await call("init_weights_update_group", "127.0.0.1", 29500, 1, 2, backend="nccl")  # refused: no CUDA
        await call("begin_weight_update", "all")
        await call("update_weights_from_distributed", ["model.norm.weight"], ["float32"], [[64]],
                   load_format="flattened_bucket", weight_version="2", flush_cache=False, abort_all_requests=False)
        await call("end_weight_update")
        await call("destroy_weights_update_group")
    # A reward model's engine: its scores on /classify.
    reward_engine = await start_engine(build_tiny_reward_model(tmp_path / "reward-model"), max_batch=4, threads=1)
    try:
        async with SGLangClient(reward_engine.base_url, timeout_s=30, retries=0, trace_configs=[trace]) as scorer:
            exercised.add("classify")
            assert len(await scorer.classify(["1+1=2", "1+1=3"], rids=["s1", "s2"])) == 2
            assert len(await scorer.classify([[4, 14, 4, 16, 5]])) == 1
    finally:
        await reward_engine.stop()

    # Every public call of the client that reaches the engine is exercised here.
    api = {name for name, member in inspect.getmembers(SGLangClient, inspect.iscoroutinefunction)
           if not name.startswith("_")} - {"close"}
    assert api == exercised, f"add to this contract test: {sorted(api - exercised)}"
    assert {path for _, path, _ in sent} >= {
        "/generate", "/model_info", "/health", "/update_weights_from_disk", "/update_weight_version",
        "/pause_generation",
        "/continue_generation", "/flush_cache", "/abort_request", "/init_weights_update_group",
        "/begin_weight_update", "/update_weights_from_distributed", "/end_weight_update",
        "/destroy_weights_update_group", "/metrics", "/load_lora_adapter", "/unload_lora_adapter",
        "/load_lora_adapter_from_tensors", "/update_weights_from_tensor", "/classify"}
    check_the_bodies_sent(sent, adapter, payload, checksums, model_file)
    problems = [p for method, path, body in sent for p in violations(method, path, body)]
    assert not problems, problems


def test_the_checker_catches_what_sglang_would_not_take() -> None:
    assert violations("POST", "/update_weights_from_disk", {"weight_version": "1"}) == [
        "/update_weights_from_disk: UpdateWeightFromDiskReqInput requires 'model_path'"]
    assert violations("GET", "/pause_generation", {"mode": "abort", "hard": True}) == [
        "GET /pause_generation: SGLang takes ['POST']",
        "/pause_generation: PauseGenerationReqInput has no field 'hard'"]
    assert violations("POST", "/generate", {"input_ids": [1], "sampling_params": {"temprature": 1}}) == [
        "/generate: SamplingParams has no 'temprature'"]
    assert violations("POST", "/update_weights", {}) == ["/update_weights: SGLang has no such route"]
    assert violations("POST", "/generate", {"input_ids": [[1], [2]], "rid": ["a", "b"], "stream": [False, False],
                                            "sampling_params": [{}, {"temprature": 1}]}) == [
        "/generate: GenerateReqInput.stream takes no list", "/generate: SamplingParams has no 'temprature'"]
    assert violations("POST", "/abort_request", {"rid": "x", "abort_all": False}) == []
    assert violations("GET", "/metrics", None) == []
    assert violations("POST", "/load_lora_adapter", {"lora_name": "a"}) == [
        "/load_lora_adapter: LoadLoRAAdapterReqInput requires 'lora_path'"]
    assert violations("POST", "/generate", {"input_ids": [1], "lora_name": "a"}) == [
        "/generate: GenerateReqInput has no field 'lora_name'"]
    assert violations("POST", "/metrics", {}) == ["POST /metrics: SGLang serves it to GET only"]
    assert violations("POST", "/classify", {"text": ["a"], "rid": ["x"]}) == []
    assert violations("POST", "/classify", {"texts": ["a"]}) == ["/classify: EmbeddingReqInput has no field 'texts'"]
