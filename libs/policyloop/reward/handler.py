"""One Rollout in, one scored Trajectory out. The Rollout is acked (by the pull worker) only
after TRAJECTORIES acknowledged the Trajectory, published under the same trajectory id, so a
redelivery is stored once. A trajectory no scorer here can score is dead-lettered with the
reason (PermanentError)."""

from __future__ import annotations

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

    def __init__(self, bus: Bus, registry: ScorerRegistry, on_scored: Callable[[], None] = lambda: None) -> None:
        self.bus = bus
        self.registry = registry
        self.on_scored = on_scored

    async def handle(self, delivery: Delivery[bus_pb2.Trajectory]) -> None:
        traj = delivery.message
        with tracing.span("score", attributes={tracing.TRAJECTORY_ID: traj.trajectory_id,
                                               tracing.ENVIRONMENT: traj.environment}) as made:
            try:
                score = await self.registry.score(traj)  # sandboxed scorers: their jobs are children
            except UnscorableTrajectory as exc:
                raise PermanentError(str(exc)) from exc
            made.set_attribute("policyloop.reward", score[0])
        record_score(traj, score)
        await self.bus.publish(trajectories_subject(traj.environment), traj, traj.trajectory_id)
        run = run_label(traj.run_id)
        REWARD.labels(run, traj.environment).observe(traj.reward)
        REWARD_POINTS.labels(run, traj.environment).inc(traj.reward)
        self.on_scored()
