"""Collecting trajectories into complete groups for the learner."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from enum import Enum

from policyloop.contracts.v1 import bus_pb2


class Admission(Enum):
    PENDING = "pending"        # waiting for the rest of its group
    COMPLETE = "complete"      # completed its group
    DUPLICATE = "duplicate"    # this trajectory id is already held or was trained


@dataclass
class GroupCollector:
    """Holds trajectories by group until every sample of the group has arrived. Groups
    complete in arrival order; a trajectory id seen before is refused (redeliveries)."""

    groups: OrderedDict[str, dict[int, bus_pb2.Trajectory]] = field(default_factory=OrderedDict)
    complete: OrderedDict[str, list[bus_pb2.Trajectory]] = field(default_factory=OrderedDict)
    trained_ids: set[str] = field(default_factory=set)

    def add(self, traj: bus_pb2.Trajectory) -> Admission:
        if traj.trajectory_id in self.trained_ids or self._holds(traj):
            return Admission.DUPLICATE
        members = self.groups.setdefault(traj.group_id, {})
        members[traj.sample_index] = traj
        if len(members) < traj.group_size:
            return Admission.PENDING
        del self.groups[traj.group_id]
        self.complete[traj.group_id] = [members[i] for i in sorted(members)]
        return Admission.COMPLETE

    def _holds(self, traj: bus_pb2.Trajectory) -> bool:
        held = self.groups.get(traj.group_id, {}).get(traj.sample_index)
        done = self.complete.get(traj.group_id)
        return held is not None or (done is not None and any(t.trajectory_id == traj.trajectory_id for t in done))

    @property
    def complete_groups(self) -> int:
        return len(self.complete)

    def take(self, count: int) -> list[list[bus_pb2.Trajectory]]:
        """The `count` oldest complete groups, now counted as trained."""
        taken = []
        while self.complete and len(taken) < count:
            _, group = self.complete.popitem(last=False)
            taken.append(group)
            self.trained_ids.update(t.trajectory_id for t in group)
        return taken


def sample_lag(traj: bus_pb2.Trajectory, trained_version: int) -> int:
    """Training version minus the oldest policy version that generated any of its tokens."""
    if not traj.version_spans:
        return 0
    return trained_version - min(span.version for span in traj.version_spans)


def split_stale(groups: list[list[bus_pb2.Trajectory]], training_version: int, max_lag: int
                ) -> tuple[list[list[bus_pb2.Trajectory]], list[list[bus_pb2.Trajectory]]]:
    """(fresh, stale) groups: a group is stale when any of its samples lags the training version
    by more than `max_lag` (its advantages need the whole group, so it goes whole). -1: no bound."""
    if max_lag < 0:
        return groups, []
    fresh, stale = [], []
    for group in groups:
        (stale if any(sample_lag(t, training_version) > max_lag for t in group) else fresh).append(group)
    return fresh, stale
