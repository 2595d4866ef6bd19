"""A version staged beside the served weights while the engine generates, then swapped in at a
boundary between two decode steps (the embedded engine's /stage_weights_from_* and
/activate_staged_weights): the swap serves exactly what a copy-in load serves, every token keeps
the version that computed it, and bad input is refused with the served version untouched."""

from __future__ import annotations

import asyncio
import base64
import re
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import safetensors.torch
import torch

from policyloop.engines.embedded import EmbeddedEngine, start_engine
from policyloop.engines.embedded_client import EmbeddedEngineClient
from policyloop.engines.sglang_client import EngineError, WeightUpdateError
from tests.integration.test_engine import decoding, greedy, post, prompt, teacher_logprobs, wait_for
from tests.tiny_model import build_tiny_model, perturbed_copy


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = build_tiny_model(tmp_path_factory.mktemp("staging-base"))
    return {"base": base, "next": perturbed_copy(base, tmp_path_factory.mktemp("staging-next"), scale=0.05),
            "other_shape": build_tiny_model(tmp_path_factory.mktemp("staging-other"), hidden_size=32)}


@pytest.fixture
async def engine(models: dict[str, Path]) -> AsyncIterator[EmbeddedEngine]:
    running = await start_engine(models["base"], max_batch=8, threads=1, weight_version="0")
    yield running
    await running.stop()


@pytest.fixture
async def client(engine: EmbeddedEngine) -> AsyncIterator[EmbeddedEngineClient]:
    async with EmbeddedEngineClient(engine.base_url, timeout_s=60, retries=0) as c:
        yield c


def file_bytes(model_dir: Path) -> bytes:
    return (model_dir / "model.safetensors").read_bytes()


async def test_a_version_staged_while_the_compute_thread_is_busy_is_swapped_in_between_two_steps(
        engine: EmbeddedEngine, client: EmbeddedEngineClient, models: dict[str, Path]) -> None:
    ids = prompt(6, 4)
    running = await decoding(engine, client, "long", ids, 240)
    # Hold the compute thread on purpose: staging must not need it (generation would go on).
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        held.set()
        release.wait(60)

    holding = asyncio.ensure_future(engine.scheduler.compute(hold))
    await wait_for(held.is_set, what="the compute thread held")
    staged = await client.stage_weights_from_disk(str(models["next"]), "1")
    assert staged.weight_version == "1" and staged.tensors > 0 and staged.bytes > 0 and staged.prepare_s > 0
    assert (await client.model_info()).weight_version == "0"  # staged, not serving
    activating = asyncio.create_task(client.activate_staged_weights("1"))
    release.set()
    await holding
    activated = await activating
    assert activated.weight_version == "1" and 0 <= activated.pause_s < 1
    result = await running
    assert len(result.output_ids) == 240
    # Every token keeps the version that computed it: some by "0", the rest by "1", split once.
    spans = result.weight_versions or []
    assert [s.version for s in spans] == ["0", "1"] and spans[0].end == spans[1].start and spans[1].end == 240
    metrics = await post_metrics(engine)
    assert "policyloop_engine_weight_activations_total 1.0" in metrics
    [pause_total] = [float(line.split()[1]) for line in metrics.splitlines()
                     if line.startswith("policyloop_engine_activation_pause_seconds_total ")]
    assert pause_total == pytest.approx(activated.pause_s)
    assert "policyloop_engine_staged_weight_bytes 0.0" in metrics


async def post_metrics(engine: EmbeddedEngine) -> str:
    import aiohttp

    async with aiohttp.ClientSession() as session, session.get(engine.base_url + "/metrics") as response:
        return await response.text()


async def test_the_swapped_version_serves_exactly_what_a_loaded_one_does(
        engine: EmbeddedEngine, client: EmbeddedEngineClient, models: dict[str, Path]) -> None:
    ids = prompt(5, 8)
    before = await client.generate(greedy(ids, 16))
    await client.stage_weights_from_tensor(file_bytes(models["next"]), "1")
    assert (await client.generate(greedy(ids, 16))).output_ids == before.output_ids  # staging changes nothing
    await client.activate_staged_weights("1")
    swapped = await client.generate(greedy(ids, 16))
    assert swapped.weight_version == "1" and swapped.output_ids != before.output_ids
    ref = teacher_logprobs(models["next"], [(ids, swapped.output_ids)])[0]
    assert max(abs(a - b) for a, b in zip(swapped.output_logprobs or [], ref, strict=True)) < 1e-4
    # Tied names (lm_head and the embeddings here) still share one tensor after the swap.
    params = engine.served.parameter_objects()
    assert params["lm_head.weight"] is params["model.embed_tokens.weight"]
    # A copy-in load of the same weights serves the same tokens and logprobs.
    await client.update_weights_from_disk(str(models["next"]), weight_version="2")
    loaded = await client.generate(greedy(ids, 16))
    assert loaded.output_ids == swapped.output_ids and loaded.output_logprobs == swapped.output_logprobs
    # And the base comes back by a swap too (a full file of tensors).
    await client.stage_weights_from_disk(str(models["base"]), "3")
    await client.activate_staged_weights("3")
    assert (await client.generate(greedy(ids, 16))).output_ids == before.output_ids


async def test_what_cannot_be_staged_or_activated_is_refused_and_the_served_version_keeps_serving(
        engine: EmbeddedEngine, client: EmbeddedEngineClient, models: dict[str, Path], tmp_path: Path) -> None:
    refusals = [
        (client.stage_weights_from_tensor(file_bytes(models["other_shape"]), "1"), "shape mismatch"),
        (client.stage_weights_from_tensor(safetensors.torch.save({"lm_head.bias": torch.zeros(3)}), "1"),
         "'lm_head.bias' is not a parameter"),
        (client.stage_weights_from_tensor(b"not a safetensors file", "1"),
         "serialized_named_tensors[0]: not a safetensors file"),
        (client.stage_weights_from_disk(str(tmp_path / "absent"), "1"), "is not a directory"),
        (client.stage_weights_from_disk(str(models["other_shape"]), "1"), "shape mismatch"),
        (client.activate_staged_weights("1"), "nothing is staged"),
    ]
    for call, named in refusals:
        with pytest.raises(EngineError, match=re.escape(named)):
            await call
        assert (await client.model_info()).weight_version == "0"
    await client.stage_weights_from_disk(str(models["next"]), "1")
    with pytest.raises(WeightUpdateError, match="version 1 is staged"):
        await client.activate_staged_weights("7")
    encoded = base64.b64encode(file_bytes(models["next"])).decode()
    for path, body, field in [
            ("/stage_weights_from_disk", {"model_path": str(models["next"])}, "weight_version"),
            ("/stage_weights_from_disk", {"weight_version": "2"}, "model_path"),
            ("/stage_weights_from_tensor", {"serialized_named_tensors": [encoded], "weight_version": "2"},
             "load_format"),
            ("/stage_weights_from_tensor", {"serialized_named_tensors": [encoded], "load_format": "safetensors",
                                            "weight_version": ""}, "weight_version"),
            ("/activate_staged_weights", {}, "weight_version"),
            ("/activate_staged_weights", {"weight_version": "1", "flush": True}, "flush")]:
        status, answer = await post(engine.base_url + path, body)
        assert status in (400, 422) and field in str(answer), (path, body, answer)  # 422: a schema error, as SGLang
    # A copy-in load replaces the weights the stage was made against: the stage is dropped.
    await client.update_weights_from_disk(str(models["base"]), weight_version="5")
    with pytest.raises(WeightUpdateError, match="nothing is staged"):
        await client.activate_staged_weights("1")
    assert (await client.model_info()).weight_version == "5"
