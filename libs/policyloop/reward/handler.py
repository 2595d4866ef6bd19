"""One group of rollouts in, the same group scored out. The ROLLOUTS message is acked (by the
pull worker) only after TRAJECTORIES acknowledged the scored group, published under the same
group id, so a redelivery is stored once. A group with a sample no scorer here can score is
dead-lettered whole, with the reason naming the sample (PermanentError): GRPO's advantages need
every member, so a group is never trained in part."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from policyloop.bus import Bus, Delivery, PermanentError, trajectories_subject
from policyloop.common.clock import now_ms
from policyloop.contracts.v1 import bus_pb2
from policyloop.scorers.registry import ScorerRegistry
from policyloop.scorers.score import Score, UnscorableTrajectory
from policyloop.telemetry import tracing
from policyloop.telemetry.metrics import REWARD, REWARD_POINTS, run_label


def record_score(traj: bus_pb2.Trajectory, score: Score) -> None:
    reward, breakdown = score
    traj.scored = True
    traj.reward = reward
    del traj.reward_breakdown[:]
    traj.reward_breakdown.extend(breakdown)
    traj.timings.scored_unix_ms = now_ms()


class RolloutScorer:
    """The reward service's handler of ROLLOUTS deliveries."""

    def __init__(self, bus: Bus, registry: ScorerRegistry, on_scored: Callable[[int], None] = lambda _: None) -> None:
        self.bus = bus
        self.registry = registry
        self.on_scored = on_scored  # told how many samples each scored group had

    async def handle(self, delivery: Delivery[bus_pb2.TrajectoryGroup]) -> None:
        group = delivery.message
        # Together: a group of sandboxed scorers' jobs runs side by side.
        scores = await asyncio.gather(*(self.score(traj) for traj in group.trajectories))
        for traj, score in zip(group.trajectories, scores, strict=True):
            record_score(traj, score)
        environment = group.trajectories[0].environment
        await self.bus.publish(trajectories_subject(environment), group, group.group_id)
        for traj in group.trajectories:
            run = run_label(traj.run_id)
            REWARD.labels(run, traj.environment).observe(traj.reward)
            REWARD_POINTS.labels(run, traj.environment).inc(traj.reward)
        self.on_scored(len(group.trajectories))

    async def score(self, traj: bus_pb2.Trajectory) -> Score:
        with tracing.span("score", attributes={tracing.TRAJECTORY_ID: traj.trajectory_id,
                                               tracing.ENVIRONMENT: traj.environment}) as made:
            try:
                score = await self.registry.score(traj)  # sandboxed scorers: their jobs are children
            except UnscorableTrajectory as exc:
                raise PermanentError(f"trajectory {traj.trajectory_id}: {exc}") from exc
            made.set_attribute("policyloop.reward", score[0])
        return score
