"""The learner service's refusals: unscored trajectories are dead-lettered, and it will not
train base weights under a later version number."""

from __future__ import annotations

import asyncio

from policyloop.bus import Bus, trajectories_subject
from policyloop.contracts.v1 import bus_pb2
from policyloop.state import VersionRegistry
from tests.conftest import ServiceLauncher
from tests.helpers import eventually, stored, stored_messages


async def test_unscored_trajectory_is_dead_lettered(bus: Bus, services: ServiceLauncher) -> None:
    learner = services.start("learner")
    await services.wait_healthy(learner, timeout_s=60)
    traj = bus_pb2.Trajectory(trajectory_id="a/0", task_id="a", group_id="a", group_size=1,
                              environment="e", prompt_token_ids=[5, 16])
    await bus.publish(trajectories_subject("e"), traj, traj.trajectory_id)

    async def dead() -> bool:
        return len(await stored_messages(bus, "DLQ")) == 1

    await eventually(dead)
    [letter] = await stored(bus, "DLQ", bus_pb2.DeadLetter)
    assert letter.service == "learner" and "not scored" in letter.reason


async def test_learner_refuses_to_restart_base_weights_at_a_later_version(
    services: ServiceLauncher, redis_client  # type: ignore[no-untyped-def]
) -> None:
    await VersionRegistry(redis_client, "default").compare_and_set("policy", 0, 3)
    learner = services.start("learner")
    assert await asyncio.to_thread(learner.proc.wait, 60) == 1
    [failure] = [e for e in learner.log_events() if e["event"] == "service_failed"]
    assert "at version 3" in failure["error"]
