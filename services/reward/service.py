"""reward service: ROLLOUTS → scored TRAJECTORIES.

Each group of rollouts is scored, sample by sample, by its task's typed scorer
(policyloop.reward): a built-in verifier in this process; for code scorers (unit tests, a
team's reward code), a job run in the sandbox service — never in this process; for a reward
model, the engines serving it (reward_models), its samples batched with other groups'. The logic is in
policyloop.reward; this is its wiring.
"""

from __future__ import annotations

from policyloop.bus import PullWorker
from policyloop.contracts.v1 import bus_pb2, status_pb2
from policyloop.contracts.validate import validate_group
from policyloop.reward.handler import RolloutScorer
from policyloop.reward.settings import RewardSettings
from policyloop.runtime import ServiceContext, run_main, run_pull_workers
from policyloop.sandbox.client import run_in_sandbox
from policyloop.scorers.registry import default_registry
from policyloop.scorers.settings import ScorerContext


async def body(ctx: ServiceContext) -> None:
    settings: RewardSettings = ctx.settings  # type: ignore[assignment]
    status = status_pb2.RewardStatus()
    ctx.status = lambda: status

    async def run_job(job: bus_pb2.SandboxJob) -> bus_pb2.SandboxResult:
        return await run_in_sandbox(ctx.bus, job, timeout_s=settings.sandbox_timeout_s)

    def scored(samples: int) -> None:
        status.rollouts_done += samples

    registry = default_registry(run_job, ScorerContext(settings, ctx.redis, settings.namespace))
    scorer = RolloutScorer(ctx.bus, registry, on_scored=scored)
    worker = PullWorker(
        ctx.bus, ctx.bus.topology.consumers["reward"], bus_pb2.TrajectoryGroup, scorer.handle,
        service="reward", concurrency=settings.concurrency, validator=validate_group,
    )
    try:
        await run_pull_workers(ctx, worker)
    finally:
        await registry.close()


def main(argv: list[str] | None = None) -> int:
    return run_main("reward", RewardSettings, body, argv)
