"""What a trajectory's version spans say about its age (pure functions of bus messages)."""

from __future__ import annotations

from policyloop.contracts.v1 import bus_pb2


def oldest_version(group: list[bus_pb2.Trajectory]) -> int:
    """The oldest policy version among a group's tokens (0 when none is recorded)."""
    versions = [span.version for t in group for span in t.version_spans]
    return min(versions) if versions else 0


def sample_lag(traj: bus_pb2.Trajectory, trained_version: int) -> int:
    """Training version minus the oldest policy version that generated any of its tokens."""
    if not traj.version_spans:
        return 0
    return trained_version - min(span.version for span in traj.version_spans)
