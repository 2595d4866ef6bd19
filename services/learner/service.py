"""learner service: consumes TRAJECTORIES.

In this version the learner has no model yet (training comes with the loop issue). It holds
the `learner` cursor over TRAJECTORIES, groups trajectories by group id, and reports how many
complete groups it has seen and the stream position it reached.
"""

from __future__ import annotations

from pydantic import Field

from policyloop.bus import Delivery, PullWorker
from policyloop.contracts.v1 import bus_pb2
from policyloop.contracts.validate import validate_trajectory
from policyloop.runtime import ServiceContext, ServiceSettings, run_main, run_pull_workers


class LearnerSettings(ServiceSettings):
    model: str = Field("policy", description="Name of the model this learner trains.")


async def body(ctx: ServiceContext) -> None:
    ctx.policy_version = await ctx.versions.get(ctx.settings.model)  # type: ignore[attr-defined]
    open_groups: dict[str, set[int]] = {}
    ctx.detail.update(trajectories_seen=0, groups_complete=0, stream_position=0)

    async def handle(delivery: Delivery[bus_pb2.Trajectory]) -> None:
        traj = delivery.message
        members = open_groups.setdefault(traj.group_id, set())
        members.add(traj.sample_index)
        if len(members) == traj.group_size:
            del open_groups[traj.group_id]
            ctx.detail["groups_complete"] = int(ctx.detail["groups_complete"]) + 1
        ctx.detail["trajectories_seen"] = int(ctx.detail["trajectories_seen"]) + 1
        ctx.detail["stream_position"] = max(int(ctx.detail["stream_position"]), delivery.stream_seq)

    worker = PullWorker(
        ctx.bus, ctx.bus.topology.consumers["learner"], bus_pb2.Trajectory, handle,
        service="learner", validator=validate_trajectory,
    )
    await run_pull_workers(ctx, worker)


def main(argv: list[str] | None = None) -> int:
    return run_main("learner", LearnerSettings, body, argv)
