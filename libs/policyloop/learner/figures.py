"""The learner's figures: its typed status (heartbeat, /healthz) and its Prometheus metrics,
kept together so that the two never disagree."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from policyloop.contracts.v1 import bus_pb2, status_pb2
from policyloop.contracts.versions import sample_lag
from policyloop.telemetry.metrics import (
    LAG_AT_BOUND,
    LEARNER_DROPPED,
    LEARNER_STEP_SECONDS,
    LEARNER_STEP_STAT,
    LEARNER_TOKENS,
    VERSION_LAG,
    WEIGHT_PAYLOAD_BYTES,
    WEIGHT_SYNC_SECONDS,
)

if TYPE_CHECKING:
    from policyloop.learner.settings import LearnerSettings
    from policyloop.rl.trainer import StepReport
    from policyloop.weights.push import PushReport

# StepReport fields that are also StepStats fields (the metric labels of LEARNER_STEP_STAT).
_STEP_STATS = [f.name for f in status_pb2.StepStats.DESCRIPTOR.fields]


def advertised_status(settings: LearnerSettings) -> status_pb2.LearnerStatus:
    """What the learner advertises from its start: the loop's shared settings and its objective,
    which rollout replicas and the gateway check theirs and runs' against."""
    return status_pb2.LearnerStatus(loop=settings.loop_config(),
                                    loss=status_pb2.LossSettings(**settings.loss.model_dump()))


class LearnerFigures:
    def __init__(self, status: status_pb2.LearnerStatus) -> None:
        self.status = status

    def saw_trajectory(self) -> None:
        if not self.status.first_trajectory_at:
            self.status.first_trajectory_at = time.time()
        self.status.trajectories_seen += 1

    def dropped(self, reason: str, count: int = 1) -> None:
        LEARNER_DROPPED.labels(reason).inc(count)
        setattr(self.status.dropped, reason, getattr(self.status.dropped, reason) + count)

    def dead_lettered(self, invalid_total: int) -> None:
        """The pull worker dead-letters invalid trajectories (failed validation, unscored)."""
        self.dropped("invalid", invalid_total - self.status.dropped.invalid)

    def pushed(self, pushed: PushReport) -> None:
        WEIGHT_SYNC_SECONDS.labels("encode").observe(pushed.encode_s)
        WEIGHT_SYNC_SECONDS.labels("push").observe(pushed.push_s)
        WEIGHT_PAYLOAD_BYTES.labels(pushed.kind).inc(pushed.payload_bytes)
        weights = self.status.weights
        weights.versions_pushed += 1
        weights.keyframes += pushed.kind == "keyframe"
        weights.full_bytes += pushed.raw_bytes
        weights.pushed_bytes += pushed.payload_bytes
        weights.delta_bytes += pushed.payload_bytes if pushed.kind == "delta" else 0
        weights.last_changed_fraction = pushed.changed_fraction

    def trained(self, samples: list[bus_pb2.Trajectory], trained_version: int) -> None:
        bound = self.status.loop.max_lag
        for traj in samples:
            lag = sample_lag(traj, trained_version)
            self.status.lag_histogram[lag] += 1
            VERSION_LAG.observe(lag)
            if bound > 0 and lag >= bound:
                LAG_AT_BOUND.inc()

    def stepped(self, report: StepReport, seconds: float) -> None:
        LEARNER_TOKENS.inc(report.trained_tokens)
        LEARNER_STEP_SECONDS.observe(seconds)
        status = self.status
        status.step = report.step
        status.busy_s += seconds
        status.last_step_at = time.time()
        status.trained_tokens += report.trained_tokens
        status.trained_samples += report.samples
        status.last_step.CopyFrom(status_pb2.StepStats(**{name: getattr(report, name) for name in _STEP_STATS}))
        for name in _STEP_STATS:
            # The metric's label for the KL to the behaviour policy predates StepStats' name for it.
            LEARNER_STEP_STAT.labels("kl_behaviour" if name == "approx_kl" else name).set(getattr(report, name))
