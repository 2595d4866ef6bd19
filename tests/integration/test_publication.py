"""The one write-ahead path every learner mode publishes through (weights/publication.py), on its
own against real NATS, Redis and an in-process publisher whose Push the test holds: the step is in
LEDGER first, nothing is released nor the registry advanced until the publisher stores the
version, and a Tinker model's versions (no registry) are published all the same."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from policyloop.bus import Bus
from policyloop.ledger import trained_steps
from policyloop.state import VersionRegistry
from policyloop.state.progress import RunProgressStore
from policyloop.weights.client import WeightClient
from policyloop.weights.library import WeightLibrary
from policyloop.weights.publication import Version, VersionPublication
from policyloop.weights.push import VersionPusher
from policyloop.weights.server import start_weight_server
from policyloop.weights.store import VersionStore
from policyloop.weights.torch_io import weight_set
from tests.helpers import scored_group
from tests.integration.test_learner_steps import HeldPushes, _announce


@pytest.mark.timeout(120)
async def test_a_version_is_recorded_then_stored_then_released(bus: Bus, redis_client, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    library = WeightLibrary(VersionStore(tmp_path / "store", retention=4), snapshot_every=2)
    publisher = HeldPushes(library, on_stored=_announce)
    server, port = await start_weight_server(publisher, host="127.0.0.1", port=0)
    client = WeightClient(f"127.0.0.1:{port}", deadline_s=30)
    versions = VersionRegistry(redis_client, "default")
    released: list[str] = []
    samples = [t for group in [scored_group("a")] for t in group]
    publication = VersionPublication(
        bus, "policy.lora.r1", "r1", "learner-0", pusher=VersionPusher(client, "policy.lora.r1", run_id="r1"),
        versions=versions, progress=RunProgressStore(redis_client, "default"),
        release=lambda done: released.extend(t.trajectory_id for t in done), sequence=lambda _: 7)
    weights = weight_set(1, {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3)})
    try:
        await publication.record(1, 1, weights, samples)
        [record] = await trained_steps(bus, "policy.lora.r1")
        assert record.version == 1 and record.trajectory_ids == ("a/0", "a/1") and record.stream_sequences == (7, 7)
        assert record.manifest_hash == weights.manifest_hash

        publishing = asyncio.create_task(publication.publish(Version(1, 1, 0, 0, samples), weights))
        await asyncio.wait_for(publisher.entered.wait(), 30)
        assert released == [] and await versions.get("policy.lora.r1") == 0  # the push is not through yet
        publisher.let_through.set()
        pushed = await asyncio.wait_for(publishing, 30)
        assert pushed.kind == "keyframe" and await versions.get("policy.lora.r1") == 1
        assert released == ["a/0", "a/1"]
        await publication.figures()

        # A Tinker model's sampler weights: published the same way, asked for by number (no registry).
        sampler = VersionPublication(bus, "policy.lora.m1", "m1", "learner-0",
                                     pusher=VersionPusher(client, "policy.lora.m1", run_id="m1"), versions=None)
        assert (await sampler.publish(Version(1, 1, 0, 0, ()), weights)).kind == "keyframe"
        assert await versions.get("policy.lora.m1") == 0
        assert [v.version for v in await client.list_versions("policy.lora.m1")] == [1]
    finally:
        publisher.let_through.set()
        await client.close()
        await server.stop(None)
        await library.drain()
