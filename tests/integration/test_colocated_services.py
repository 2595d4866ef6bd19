"""The colocated path through the services: the learner broadcasts each new version straight
into the engine its rollout replica uses (gloo on CPU, as NCCL would on GPUs), the replica
takes it from the engine without fetching, and what the engine serves is exactly the version
the publisher stored."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from policyloop.bus import Bus, trajectories_subject
from policyloop.cluster.local import free_port
from policyloop.engines.embedded import start_engine
from policyloop.engines.protocol import GenerateRequest, SamplingParams
from policyloop.engines.sglang_client import SGLangClient
from policyloop.models.tokenizer import VOCAB
from policyloop.weights.client import WeightClient
from policyloop.weights.sync import sync_weights
from tests.conftest import ServiceLauncher
from tests.helpers import eventually, publish_group, scored_group

PROMPTS = [[VOCAB[c] for c in text] for text in ("12+7=", "40+45=", "3+9=", "77+11=")]


async def greedy(client: SGLangClient) -> list[tuple[list[int], list[float] | None]]:
    results = []
    for prompt in PROMPTS:  # one at a time: the same batch shapes on both engines
        result = await client.generate(GenerateRequest(
            input_ids=prompt, sampling_params=SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True),
            return_logprob=True))
        results.append((result.output_ids, result.output_logprobs))
    return results


async def test_learner_broadcasts_versions_into_a_colocated_engine(
        bus: Bus, services: ServiceLauncher, tiny_model_dir: Path, tmp_path: Path) -> None:
    port = free_port()
    engine = subprocess.Popen([sys.executable, "-m", "policyloop.engines.embedded", "--model-path",
                               str(tiny_model_dir), "--port", str(port), "--threads", "1"],
                              stdin=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    client = SGLangClient(url, timeout_s=60)
    reference = None
    try:
        await client.wait_healthy(timeout_s=60)
        publisher = services.start("publisher")
        await services.wait_healthy(publisher)
        endpoint = f"127.0.0.1:{publisher.ports['grpc']}"
        loop = {"POLICYLOOP_GROUPS_PER_STEP": "2"}  # shared: the replica takes no work while they differ
        learner = services.start("learner", env={
            **loop, "POLICYLOOP_PUBLISHER_ENDPOINT": endpoint,
            "POLICYLOOP_COLOCATED__ENGINES": json.dumps([url]), "POLICYLOOP_COLOCATED__BACKEND": "gloo"})
        rollout = services.start("rollout", env={**loop, "POLICYLOOP_ENGINE_URL": url,
                                                 "POLICYLOOP_WEIGHT_SOURCE": "colocated"})
        await services.wait_healthy(learner, rollout, timeout_s=60)
        for task in ("a", "b"):
            for traj in scored_group(task, environment="addition@v1", prompt=PROMPTS[0]):
                await publish_group(bus, trajectories_subject("addition@v1"), traj, msg_id=traj.trajectory_id)

        async def rollout_serves_version_1() -> bool:
            return any(e["event"] == "weights_loaded" and e.get("version") == 1 for e in rollout.log_events())

        await eventually(rollout_serves_version_1, timeout_s=60)
        loaded = [e for e in rollout.log_events() if e["event"] == "weights_loaded"]
        assert loaded[-1]["kind"] == "colocated"  # taken from the engine, nothing fetched
        assert not any(e["event"] == "weights_broadcast_missing" for e in rollout.log_events())
        assert (await client.model_info()).weight_version == "1"
        assert any(e["event"] == "weights_broadcast" and e["version"] == 1 for e in learner.log_events())

        # The engine serves exactly the version the publisher stored: an engine loading that
        # version from disk generates the same tokens with the same logprobs, bit for bit.
        from policyloop.weights.torch_io import write_version_dir

        weights_client = WeightClient(endpoint)
        try:
            version_1, _ = await sync_weights(weights_client, "policy", None, 1)
        finally:
            await weights_client.close()
        directory = write_version_dir(tmp_path / "check", tiny_model_dir, version_1)
        reference = await start_engine(tiny_model_dir, threads=1)
        async with SGLangClient(reference.base_url, timeout_s=60) as ref_client:
            before = await greedy(ref_client)
            await ref_client.update_weights_from_disk(str(directory), weight_version="1")
            expected = await greedy(ref_client)
        served = await greedy(client)
        assert served == expected and served != before
    finally:
        await client.close()
        if reference is not None:
            await reference.stop()
        engine.terminate()
        engine.wait(15)


async def test_without_the_broadcast_the_replica_loads_from_the_publisher(
        bus: Bus, services: ServiceLauncher, tiny_model_dir: Path) -> None:
    """The learner's colocated engine is unreachable: it logs the failed broadcast, still
    publishes, and does not retry at every version; the colocated replica waits
    colocated_wait_s, then fetches the version from the publisher and loads it."""
    port = free_port()
    engine = subprocess.Popen([sys.executable, "-m", "policyloop.engines.embedded", "--model-path",
                               str(tiny_model_dir), "--port", str(port), "--threads", "1"],
                              stdin=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    client = SGLangClient(url, timeout_s=60)
    try:
        await client.wait_healthy(timeout_s=60)
        publisher = services.start("publisher")
        await services.wait_healthy(publisher)
        loop = {"POLICYLOOP_GROUPS_PER_STEP": "1", "POLICYLOOP_MAX_LAG": "-1"}  # shared by learner and replica
        learner = services.start("learner", env={
            **loop, "POLICYLOOP_PUBLISHER_ENDPOINT": f"127.0.0.1:{publisher.ports['grpc']}",
            "POLICYLOOP_COLOCATED__ENGINES": json.dumps([f"http://127.0.0.1:{free_port()}"]),
            "POLICYLOOP_COLOCATED__BACKEND": "gloo"})
        rollout = services.start("rollout", env={**loop, "POLICYLOOP_ENGINE_URL": url,
                                                 "POLICYLOOP_WEIGHT_SOURCE": "colocated",
                                                 "POLICYLOOP_COLOCATED_WAIT_S": "1"})
        await services.wait_healthy(learner, rollout, timeout_s=60)
        for task in ("a", "b"):
            for traj in scored_group(task, environment="addition@v1", prompt=PROMPTS[0]):
                await publish_group(bus, trajectories_subject("addition@v1"), traj, msg_id=traj.trajectory_id)

        async def loaded_version_2() -> bool:
            return (await client.model_info()).weight_version == "2"

        await eventually(loaded_version_2, timeout_s=90)
        events = rollout.log_events()
        assert [e["version"] for e in events if e["event"] == "weights_broadcast_missing"][:1] == [1]
        loaded = [e for e in events if e["event"] == "weights_loaded"]
        assert loaded[0]["version"] == 1 and loaded[0]["kind"] == "keyframe"
        failures = [e for e in learner.log_events() if e["event"] == "weights_broadcast_failed"]
        assert len(failures) == 1  # version 2 went by the publisher only: no second group formed
    finally:
        await client.close()
        engine.terminate()
        engine.wait(15)


async def test_a_colocated_replica_needs_the_engine_url(services: ServiceLauncher) -> None:
    import asyncio

    rollout = services.start("rollout", env={"POLICYLOOP_WEIGHT_SOURCE": "colocated"})
    assert await asyncio.to_thread(rollout.proc.wait, 60) == 1
    [failure] = [e for e in rollout.log_events() if e["event"] == "service_failed"]
    assert "needs engine_url" in failure["error"]
