"""The learner's part of each trajectory's trace: the step that trained it and the version that
carried it to the engines (or why it was not trained), recorded under the trajectory's own trace
context, which its TRAJECTORIES message brought (policyloop.telemetry.tracing)."""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

from policyloop.contracts.v1 import bus_pb2
from policyloop.telemetry import tracing


@dataclass(frozen=True)
class Interval:
    """Wall-clock nanoseconds (spans are in wall-clock time)."""
    start_ns: int
    end_ns: int


class LearnerTraces:
    """Holds the trace context of each trajectory from its admission until it is trained or
    dropped. Without tracing it holds nothing."""

    def __init__(self) -> None:
        self.held: dict[str, tracing.Context] = {}

    def admitted(self, trajectory_id: str) -> None:
        """Called in the handler of the trajectory's delivery, whose context is current; a
        redelivered copy keeps the first one's."""
        if tracing.enabled():
            self.held.setdefault(trajectory_id, tracing.current())

    def trained(self, samples: Iterable[bus_pb2.Trajectory], *, step: int, version: int, train: Interval,
                publish: Interval, publish_kind: str) -> None:
        for traj in samples:
            parent = self.held.pop(traj.trajectory_id, None)
            if parent is None:
                continue
            attributes: dict[str, tracing.AttributeValue] = {
                tracing.TRAJECTORY_ID: traj.trajectory_id, tracing.STEP: step, tracing.POLICY_VERSION: version}
            tracing.record_span("train", parent, train.start_ns, train.end_ns, attributes)
            tracing.record_span("publish version", parent, publish.start_ns, publish.end_ns,
                                {**attributes, "policyloop.weights_kind": publish_kind})

    def dropped(self, samples: Iterable[bus_pb2.Trajectory], reason: str) -> None:
        now = time.time_ns()
        for traj in samples:
            parent = self.held.pop(traj.trajectory_id, None)
            if parent is not None:
                tracing.record_span("dropped", parent, now, now,
                                    {tracing.TRAJECTORY_ID: traj.trajectory_id, "policyloop.drop_reason": reason})
