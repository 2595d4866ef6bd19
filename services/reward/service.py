"""reward service: ROLLOUTS → TRAJECTORIES.

In this version there is no verifier yet (it comes with the loop issue): a Rollout is passed
on unscored (`scored = false`). The bus contract is already the real one: the Rollout is acked
only after TRAJECTORIES acknowledged the Trajectory, published under the same trajectory id,
so redeliveries are stored once.
"""

from __future__ import annotations

from pydantic import Field

from policyloop.bus import Delivery, PullWorker, trajectories_subject
from policyloop.contracts.v1 import bus_pb2
from policyloop.contracts.validate import validate_trajectory
from policyloop.runtime import ServiceContext, ServiceSettings, run_main, run_pull_workers


class RewardSettings(ServiceSettings):
    concurrency: int = Field(8, description="Rollouts this replica scores at once.")


async def body(ctx: ServiceContext) -> None:
    settings: RewardSettings = ctx.settings  # type: ignore[assignment]
    ctx.detail["rollouts_done"] = 0

    async def handle(delivery: Delivery[bus_pb2.Trajectory]) -> None:
        traj = delivery.message
        await ctx.bus.publish(trajectories_subject(traj.environment), traj, traj.trajectory_id)
        ctx.detail["rollouts_done"] = int(ctx.detail["rollouts_done"]) + 1

    worker = PullWorker(
        ctx.bus, ctx.bus.topology.consumers["reward"], bus_pb2.Trajectory, handle,
        service="reward", concurrency=settings.concurrency, validator=validate_trajectory,
    )
    await run_pull_workers(ctx, worker)


def main(argv: list[str] | None = None) -> int:
    return run_main("reward", RewardSettings, body, argv)
