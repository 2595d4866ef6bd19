"""The learner's figures: its typed status (heartbeat, /healthz) and its Prometheus metrics,
kept together so that the two never disagree."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from policyloop.contracts.v1 import bus_pb2, status_pb2
from policyloop.contracts.versions import sample_lag
from policyloop.rl import losses
from policyloop.telemetry.metrics import (
    LAG_AT_BOUND,
    LEARNER_DROPPED,
    LEARNER_PHASE_SECONDS,
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



def exported_statistics(report: StepReport) -> dict[str, float]:
    """A step's statistics by name: its mean reward and gradient norm, and the loss's own — the
    labels of LEARNER_STEP_STAT and what trackers log of a step."""
    return {"mean_reward": report.mean_reward, "grad_norm": report.grad_norm, **report.statistics}


# The phases of a learner step, in order (perf/step_profile.py stacks them so): waiting for a full
# batch, the trainer's own (pack, forward, backward, optimizer, and the hand-off to its thread),
# exporting the weights, hashing them, waiting for the previous version's publication, the LEDGER
# record, then the version's publication (PUBLISH_PHASES), the checkpoint.
# A publication: the colocated broadcast, encoding the delta, pushing it (the publisher's verify and
# store included), the version registry and the trajectories' release, the run's progress in Redis.
PUBLISH_PHASES = ("colocated", "encode", "push", "registry", "progress")
STEP_PHASES = ("wait_for_batch", "pack", "forward", "backward", "optimizer", "trainer_other", "export", "hash",
               "publish_wait", "ledger", *PUBLISH_PHASES, "checkpoint")
# Where a phase ran: on the step's own path (these add up to its wall time), or overlapping the next step.
ON_STEP, OVERLAPPED = "step", "overlap"


def trainer_phases(clock: dict[str, float], report: StepReport) -> dict[str, float]:
    """The learner's phase clock with the trainer's own phases (report.phases) in place of
    `trainer`, and what is left of it as trainer_other."""
    phases = dict(clock)
    trainer = phases.pop("trainer", 0.0)
    phases.update(report.phases)
    phases["trainer_other"] = max(0.0, trainer - sum(report.phases.values()))
    return phases


def publish_phases(clock: dict[str, float], pushed: PushReport) -> dict[str, float]:
    """A publication's phase clock with the encode inside `push` taken out."""
    phases = dict(clock)
    phases["encode"] = min(pushed.encode_s, phases.get("push", 0.0))
    phases["push"] = phases.get("push", 0.0) - phases["encode"]
    return phases


def in_order(phases: dict[str, float]) -> dict[str, float]:
    return {name: phases[name] for name in STEP_PHASES if name in phases}


def advertised_status(settings: LearnerSettings) -> status_pb2.LearnerStatus:
    """What the learner advertises from its start: the loop's shared settings and its objective,
    which rollout replicas and the gateway check theirs and runs' against."""
    return status_pb2.LearnerStatus(loop=settings.loop_config(),
                                    loss=losses.to_proto(settings.loss),
                                    lora_runs=settings.lora_runs, full_model=settings.full_model,
                                    tinker=settings.tinker)


class LearnerFigures:
    def __init__(self, status: status_pb2.LearnerStatus) -> None:
        self.status = status

    def saw_trajectories(self, count: int) -> None:
        if not self.status.first_trajectory_at:
            self.status.first_trajectory_at = time.time()
        self.status.trajectories_seen += count

    def dropped(self, reason: str, count: int = 1) -> None:
        LEARNER_DROPPED.labels(reason).inc(count)
        setattr(self.status.dropped, reason, getattr(self.status.dropped, reason) + count)

    def dead_lettered(self, invalid_total: int) -> None:
        """The pull worker dead-letters invalid groups (failed validation, unscored)."""
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

    def phases(self, seconds: dict[str, float], path: str = ON_STEP) -> None:
        for phase, spent in in_order(seconds).items():
            LEARNER_PHASE_SECONDS.labels(phase, path).inc(spent)

    def stepped(self, report: StepReport, seconds: float) -> None:
        LEARNER_TOKENS.inc(report.trained_tokens)
        LEARNER_STEP_SECONDS.observe(seconds)
        status = self.status
        status.step = report.step
        status.busy_s += seconds
        status.last_step_at = time.time()
        status.trained_tokens += report.trained_tokens
        status.trained_samples += report.samples
        status.last_step.CopyFrom(status_pb2.StepStats(mean_reward=report.mean_reward, grad_norm=report.grad_norm,
                                                       statistics=report.statistics))
        for name, value in exported_statistics(report).items():
            LEARNER_STEP_STAT.labels(name).set(value)
