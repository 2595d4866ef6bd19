"""Relayed fan-out between real services: the publisher (tree.fanout 1) and two rollout replicas
with their relays on. The second replica fetches through the first; when the first is killed, the
second reports it, is placed under the publisher and fetches from there — nothing lost."""

from __future__ import annotations

import pytest
import safetensors.torch
import torch

from policyloop.state import HeartbeatRegistry
from policyloop.weights.client import WeightClient
from policyloop.weights.push import VersionPusher
from policyloop.weights.torch_io import weight_set
from tests.conftest import ServiceLauncher
from tests.helpers import eventually

RELAY = {"POLICYLOOP_RELAY__ENABLED": "true", "POLICYLOOP_RELAY__PARENT_DEADLINE_S": "60"}


@pytest.mark.timeout(300)
async def test_a_replica_fetches_through_another_and_from_the_publisher_once_that_one_dies(
        services: ServiceLauncher, redis_client) -> None:  # type: ignore[no-untyped-def]
    base = safetensors.torch.load_file(str(services.model_dir / "model.safetensors"))
    publisher = services.start("publisher", env={"POLICYLOOP_TREE__FANOUT": "1"})
    await services.wait_healthy(publisher)
    client = WeightClient(f"127.0.0.1:{publisher.ports['grpc']}")
    pusher = VersionPusher(client, "policy")
    registry = HeartbeatRegistry(redis_client, "default")

    async def push(version: int) -> None:
        torch.manual_seed(version)
        changed = {k: t + 0.05 * torch.randn_like(t) if t.is_floating_point() else t for k, t in base.items()}
        await pusher.push(weight_set(version, changed), step=version)

    async def rollout(instance: str):  # type: ignore[no-untyped-def]
        beats = {b.instance: b for b in await registry.alive("rollout")}
        return beats.get(instance)

    def at(instance: str, version: int):  # type: ignore[no-untyped-def]
        async def check() -> bool:
            beat = await rollout(instance)
            return beat is not None and beat.policy_version == version
        return check

    try:
        first = services.start("rollout", "rollout-a", env=RELAY)
        await services.wait_healthy(first)
        await push(1)
        await eventually(at("rollout-a", 1), timeout_s=60, what="rollout-a at version 1")
        second = services.start("rollout", "rollout-b", env=RELAY)
        await services.wait_healthy(second)
        await eventually(at("rollout-b", 1), timeout_s=60, what="rollout-b at version 1")
        beat = await rollout("rollout-b")
        assert (beat.rollout.last_fetch.source, beat.rollout.tree_depth) == ("rollout-a", 2)
        assert beat.rollout.last_fetch.kind == "keyframe"  # it held nothing: rollout-a made one from its weights
        await push(2)
        await eventually(at("rollout-b", 2), timeout_s=60, what="rollout-b at version 2")
        beat = await rollout("rollout-b")
        assert (beat.rollout.last_fetch.source, beat.rollout.last_fetch.kind) == ("rollout-a", "delta")

        first.proc.kill()
        first.proc.wait(timeout=30)
        await push(3)
        await eventually(at("rollout-b", 3), timeout_s=120, what="rollout-b at version 3 without rollout-a")
        beat = await rollout("rollout-b")
        assert (beat.rollout.last_fetch.source, beat.rollout.tree_depth) == ("publisher", 1)
        assert "weights_parent_failed" in second.log()
    finally:
        await client.close()
