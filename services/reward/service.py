"""reward service: ROLLOUTS → scored TRAJECTORIES.

Each Rollout is scored by its task's verifier (policyloop.envs.scoring), or, for code
scorers (unit tests, a team's reward code), by a job run in the sandbox service
(policyloop.envs.code) — never in this process: the reward and its breakdown are recorded in the
Trajectory. The Rollout is acked only after TRAJECTORIES
acknowledged the Trajectory, published under the same trajectory id, so redeliveries are stored
once. A trajectory no verifier here can score is dead-lettered with the reason.
"""

from __future__ import annotations

from pydantic import Field

from policyloop.bus import Delivery, PermanentError, PullWorker, trajectories_subject
from policyloop.contracts.v1 import bus_pb2
from policyloop.contracts.validate import validate_trajectory
from policyloop.envs.code import is_code_scorer, sandbox_job, score_result
from policyloop.envs.scoring import UnscorableTrajectory, score_trajectory
from policyloop.runtime import ServiceContext, ServiceSettings, run_main, run_pull_workers
from policyloop.sandbox.client import run_in_sandbox
from policyloop.telemetry.metrics import REWARD
from policyloop.trajectories import now_ms


class RewardSettings(ServiceSettings):
    concurrency: int = Field(64, description="Rollouts this replica scores at once.")
    sandbox_timeout_s: float = Field(
        120.0, description="How long a code scorer (unit tests, reward code) may wait for the sandbox's result, "
                           "queueing included; then the Rollout is handed back and tried again later.")


async def body(ctx: ServiceContext) -> None:
    settings: RewardSettings = ctx.settings  # type: ignore[assignment]
    ctx.detail["rollouts_done"] = 0

    async def handle(delivery: Delivery[bus_pb2.Trajectory]) -> None:
        traj = delivery.message
        try:
            if is_code_scorer(traj):
                # Code runs only in the sandbox, never in this process.
                code_job = sandbox_job(traj)
                result = await run_in_sandbox(ctx.bus, code_job.job, timeout_s=settings.sandbox_timeout_s)
                reward, breakdown = score_result(traj, code_job, result)
            else:
                reward, breakdown = score_trajectory(traj)
        except UnscorableTrajectory as exc:
            raise PermanentError(str(exc)) from exc
        traj.scored = True
        traj.reward = reward
        del traj.reward_breakdown[:]
        traj.reward_breakdown.extend(breakdown)
        traj.timings.scored_unix_ms = now_ms()
        await ctx.bus.publish(trajectories_subject(traj.environment), traj, traj.trajectory_id)
        REWARD.labels(traj.environment).observe(reward)
        ctx.detail["rollouts_done"] = int(ctx.detail["rollouts_done"]) + 1

    worker = PullWorker(
        ctx.bus, ctx.bus.topology.consumers["reward"], bus_pb2.Trajectory, handle,
        service="reward", concurrency=settings.concurrency, validator=validate_trajectory,
    )
    await run_pull_workers(ctx, worker)


def main(argv: list[str] | None = None) -> int:
    return run_main("reward", RewardSettings, body, argv)
