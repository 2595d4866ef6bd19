"""The colocated weight-sync path end to end, on CPU: a DistributedWeightSender in the test
process broadcasts weights over a real gloo group to real embedded engines (HTTP servers on
loopback, one of them a separate process), driven by SGLang's routes. The weights must land
bit for bit (checked on the engine's parameters and by generating exactly like the same
weights loaded from disk); bad tensors are refused with the old weights kept and the group still
usable; an engine that refuses before receiving puts the group out of step, which the sender
then says; nccl without a GPU is refused with a clear error; the learner's default process group
is left alone."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
import torch
import torch.distributed as dist

from policyloop.cluster.local import free_port
from policyloop.engines.embedded import EmbeddedEngine, start_engine
from policyloop.engines.protocol import GenerateRequest, GenerateResult, SamplingParams, error_message
from policyloop.engines.sglang_client import SGLangClient, WeightUpdateError
from policyloop.models.tokenizer import VOCAB
from policyloop.weights.broadcast.engine_control import WeightSyncError
from policyloop.weights.broadcast.group import WeightGroupError
from policyloop.weights.broadcast.sender import DistributedWeightSender, EngineTarget

DIGITS = [VOCAB[c] for c in "0123456789"]
PROMPTS = [[DIGITS[(7 * i + 3 * k) % 10] for k in range(4 + i)] + [VOCAB["+"], DIGITS[i], VOCAB["="]]
           for i in range(3)]
GROUP_TIMEOUT_S = 60.0  # a broken test fails at this, not at the pytest timeout


@pytest.fixture
async def engine(tiny_model_dir: Path) -> AsyncIterator[EmbeddedEngine]:
    running = await start_engine(tiny_model_dir, max_batch=8, threads=1, weight_version="0",
                                 weights_group_timeout_s=GROUP_TIMEOUT_S)
    yield running
    await running.stop()


@pytest.fixture
async def client(engine: EmbeddedEngine) -> AsyncIterator[SGLangClient]:
    async with SGLangClient(engine.base_url, timeout_s=GROUP_TIMEOUT_S, retries=1) as c:
        yield c


def reference_model(model_dir: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def perturbed_weights(model_dir: Path, seed: int, scale: float = 0.05) -> dict[str, torch.Tensor]:
    """The model's parameters (tied ones once, as named_parameters gives them) plus noise."""
    generator = torch.Generator().manual_seed(seed)
    return {name: (p.detach() + scale * torch.randn(p.shape, generator=generator)).contiguous()
            for name, p in reference_model(model_dir).named_parameters()}


def served_parameters(engine: EmbeddedEngine) -> dict[str, torch.Tensor]:
    """A copy of what the engine serves (read from the engine object: the test shares its process)."""
    return {name: t.detach().clone() for name, t in engine.served.parameters().items()}


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8),
                                                                     b.contiguous().view(torch.uint8))


def assert_serving(engine: EmbeddedEngine, expected: dict[str, torch.Tensor]) -> None:
    served = served_parameters(engine)
    mismatched = [name for name, tensor in expected.items() if not same_bytes(served[name], tensor)]
    assert not mismatched, f"not bit-exact: {mismatched[:5]}"


async def greedy_outputs(client: SGLangClient) -> list[GenerateResult]:
    params = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    return [await client.generate(GenerateRequest(input_ids=ids, sampling_params=params)) for ids in PROMPTS]


def tokens_and_logprobs(results: list[GenerateResult]) -> list[tuple[list[int], list[float] | None]]:
    return [(r.output_ids, r.output_logprobs) for r in results]


async def post(url: str, payload: object) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as session, session.post(url, json=payload) as response:
        return response.status, await response.json(content_type=None)


# ---------------------------------------------------------------------------------------------


async def test_weights_land_bit_exact_and_serve_like_the_same_weights_from_disk(
        engine: EmbeddedEngine, client: SGLangClient, tiny_model_dir: Path, tmp_path: Path) -> None:
    weights = perturbed_weights(tiny_model_dir, seed=1)
    before = await greedy_outputs(client)
    sender = DistributedWeightSender(backend="gloo", bucket_bytes=16 * 1024, timeout_s=GROUP_TIMEOUT_S)
    await sender.init([client])
    try:
        stats = await sender.send(weights, weight_version="1")
    finally:
        await sender.close()
    assert stats.buckets > 1 and stats.tensors == len(weights)
    assert stats.nbytes == sum(t.numel() * 4 for t in weights.values())

    assert (await client.model_info()).weight_version == "1"
    assert_serving(engine, weights)  # every parameter holds exactly the bytes sent
    after = await greedy_outputs(client)
    assert all(r.weight_version == "1" for r in after)
    assert tokens_and_logprobs(after) != tokens_and_logprobs(before)

    # The same weights through the disk path generate exactly the same tokens and logprobs.
    model = reference_model(tiny_model_dir)
    model.load_state_dict(weights, strict=False)  # lm_head is tied to the embeddings
    model.save_pretrained(tmp_path / "perturbed", safe_serialization=True)
    await client.update_weights_from_disk(str(tiny_model_dir), weight_version="2")
    assert tokens_and_logprobs(await greedy_outputs(client)) == tokens_and_logprobs(before)
    await client.update_weights_from_disk(str(tmp_path / "perturbed"), weight_version="3")
    assert tokens_and_logprobs(await greedy_outputs(client)) == tokens_and_logprobs(after)

    # The group is gone on both sides.
    status, body = await post(engine.base_url + "/destroy_weights_update_group", {})
    assert status == 400 and body["success"] is False and "does not exist" in body["message"]


async def test_two_engines_at_their_rank_offsets_one_in_another_process(
        engine: EmbeddedEngine, client: SGLangClient, tiny_model_dir: Path) -> None:
    port = free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "policyloop.engines.embedded", "--model-path",
                             str(tiny_model_dir), "--host", "127.0.0.1", "--port", str(port), "--max-batch", "8",
                             "--threads", "1"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        async with SGLangClient(f"http://127.0.0.1:{port}", timeout_s=GROUP_TIMEOUT_S, retries=1) as remote:
            await remote.wait_healthy(timeout_s=60)
            weights = perturbed_weights(tiny_model_dir, seed=2)
            # Half the tensors go as bfloat16: buckets of two dtypes, cast into float32 parameters.
            for name in list(weights)[::2]:
                weights[name] = weights[name].to(torch.bfloat16)
            sender = DistributedWeightSender(backend="gloo", bucket_bytes=32 * 1024, timeout_s=GROUP_TIMEOUT_S)
            await sender.init([EngineTarget(client), EngineTarget(remote)])  # ranks 1 and 2
            assert sender.world_size == 3
            try:
                stats = await sender.send(weights, weight_version="5")
                assert stats.buckets >= 2
            finally:
                await sender.close()

            assert (await client.model_info()).weight_version == "5"
            assert (await remote.model_info()).weight_version == "5"
            assert_serving(engine, {name: t.float() for name, t in weights.items()})
            here, there = await greedy_outputs(client), await greedy_outputs(remote)
            assert tokens_and_logprobs(here) == tokens_and_logprobs(there)  # same bytes, same answers
            assert all(r.weight_version == "5" for r in here + there)
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(proc.wait, 30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


async def test_a_request_in_flight_continues_on_the_new_weights(
        engine: EmbeddedEngine, client: SGLangClient, tiny_model_dir: Path) -> None:
    params = SamplingParams(max_new_tokens=120, temperature=0.0, ignore_eos=True)
    request = asyncio.ensure_future(client.generate(GenerateRequest(input_ids=PROMPTS[0], rid="long",
                                                                    sampling_params=params)))
    while (engine.progress("long") or 0) < 3:
        await asyncio.sleep(0.001)
    await client.pause_generation("in_place")  # held between two steps: its progress is now fixed
    held = engine.progress("long")
    assert held is not None
    sender = DistributedWeightSender(backend="gloo", bucket_bytes=16 * 1024, timeout_s=GROUP_TIMEOUT_S)
    await sender.init([client])
    try:
        await sender.send(perturbed_weights(tiny_model_dir, seed=6), weight_version="1")  # continues at the end
    finally:
        await sender.close()
    result = await request
    assert result.finish_reason == "length" and result.completion_tokens == 120
    spans = [(s.version, s.start, s.end) for s in result.weight_versions or []]
    # The token drawn from logits computed before the pause still counts as version 0.
    assert len(spans) == 2 and spans[0][:2] == ("0", 0) and spans[1] == ("1", spans[0][2], 120)
    assert held <= spans[0][2] <= held + 1


async def test_bad_tensors_are_refused_and_the_old_weights_keep_serving(
        engine: EmbeddedEngine, client: SGLangClient, tiny_model_dir: Path) -> None:
    weights = perturbed_weights(tiny_model_dir, seed=3)
    original = served_parameters(engine)
    sender = DistributedWeightSender(backend="gloo", timeout_s=GROUP_TIMEOUT_S)  # one bucket holds everything
    await sender.init([client])
    try:
        unknown = {**weights, "model.layers.0.not_a_weight": torch.zeros(3)}
        with pytest.raises(WeightSyncError, match="not_a_weight") as info:
            await sender.send(unknown, weight_version="1")
        assert "still usable" in str(info.value) and "stay paused" in str(info.value)
        assert_serving(engine, original)
        assert (await client.model_info()).weight_version == "0"

        name = "model.layers.0.mlp.up_proj.weight"
        reshaped = {**weights, name: torch.zeros(weights[name].shape[0], 3)}
        with pytest.raises(WeightSyncError, match=f"shape mismatch for '{name}'"):
            await sender.send(reshaped, weight_version="1")
        assert_serving(engine, original)
        assert (await client.model_info()).weight_version == "0"

        # The group stayed in step: the good weights go through and generation resumes.
        await sender.send(weights, weight_version="1")
        assert_serving(engine, weights)
        assert all(r.weight_version == "1" for r in await greedy_outputs(client))
    finally:
        await sender.close()


async def test_an_engine_refusing_before_receiving_puts_the_group_out_of_step(
        engine: EmbeddedEngine, client: SGLangClient, tiny_model_dir: Path) -> None:
    weights = perturbed_weights(tiny_model_dir, seed=4)
    original = served_parameters(engine)
    # settle_s: how long the failed bucket waits for its broadcast; timeout_s: when the broadcast gives up
    sender = DistributedWeightSender(backend="gloo", timeout_s=5, settle_s=0.5)
    await sender.init([client])
    await client.destroy_weights_update_group()  # behind the sender's back: the engine cannot receive
    with pytest.raises(WeightSyncError, match="out of step"):
        await sender.send(weights, weight_version="1")
    with pytest.raises(WeightGroupError, match="out of step"):
        await sender.send(weights, weight_version="1")
    with pytest.raises(WeightSyncError, match="out of step"):
        await sender.close()
    assert_serving(engine, original)
    assert (await client.model_info()).weight_version == "0"
    # The engine was left paused inside its session: closing both lets it serve again.
    await client.end_weight_update()
    await client.continue_generation()
    assert all(r.weight_version == "0" for r in await greedy_outputs(client))


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
async def test_nccl_without_a_gpu_is_refused(engine: EmbeddedEngine, client: SGLangClient) -> None:
    request = {"master_address": "127.0.0.1", "master_port": free_port(), "rank_offset": 1, "world_size": 2,
               "backend": "nccl"}
    status, body = await post(engine.base_url + "/init_weights_update_group", request)
    assert status == 400 and body["success"] is False
    assert "nccl" in body["message"] and "CUDA" in body["message"] and "gloo" in body["message"]
    with pytest.raises(WeightUpdateError, match="CUDA"):
        await client.init_weights_update_group("127.0.0.1", free_port(), 1, 2, backend="nccl")
    with pytest.raises(WeightGroupError, match="CUDA"):  # refused here before any engine waits
        await DistributedWeightSender(backend="nccl").init([client])


async def test_requests_that_cannot_be_received_are_refused(engine: EmbeddedEngine, client: SGLangClient) -> None:
    url = engine.base_url
    update = {"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[64]],
              "load_format": "flattened_bucket"}
    status, body = await post(url + "/update_weights_from_distributed", update)
    assert status == 400 and body["success"] is False and "begin_weight_update()" in body["message"]

    assert (await post(url + "/begin_weight_update", {}))[0] == 200
    status, body = await post(url + "/begin_weight_update", {})
    assert status == 400 and "already open" in body["message"]
    status, body = await post(url + "/update_weights_from_distributed", update)
    assert status == 400 and body["success"] is False and "not initialized" in body["message"]
    for bad, field in (({**update, "dtypes": ["float32", "float32"]}, "dtypes"),
                       ({**update, "shapes": [[-64]]}, "shapes[0]"),
                       ({**update, "load_format": "auto"}, "load_format"),
                       ({**update, "dtypes": ["bfloat16", "float32"], "names": ["a", "b"], "shapes": [[1], [1]]},
                        "dtypes"),  # a float32 at byte 2: SGLang refuses the layout too
                       ({**update, "tensors": []}, "tensors")):
        status, body = await post(url + "/update_weights_from_distributed", bad)
        assert status == 400 and (error_message(body) or "").startswith(field), (field, body)
    assert (await post(url + "/end_weight_update", {}))[0] == 200
    status, body = await post(url + "/end_weight_update", {})
    assert status == 400 and "no weight-update session" in body["message"]

    status, body = await post(url + "/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 1,
                                                                   "rank_offset": 0, "world_size": 2})
    assert status == 400 and (error_message(body) or "").startswith("rank_offset")
    assert (await client.model_info()).weight_version == "0"


async def test_the_learners_default_process_group_is_left_alone(
        engine: EmbeddedEngine, client: SGLangClient, tiny_model_dir: Path) -> None:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        registered = dict(dist.distributed_c10d._world.pg_names)
        sender = DistributedWeightSender(backend="gloo", timeout_s=GROUP_TIMEOUT_S)
        await sender.init([client])
        await sender.send(perturbed_weights(tiny_model_dir, seed=5), weight_version="1")
        await sender.close()
        assert dist.is_initialized() and dist.get_world_size() == 1 and dist.get_rank() == 0
        assert dict(dist.distributed_c10d._world.pg_names) == registered  # no group was registered
        total = torch.ones(3)
        dist.all_reduce(total)
        assert torch.equal(total, torch.ones(3))
    finally:
        dist.destroy_process_group()
