"""Checks of bus messages beyond what protobuf decoding guarantees. Each raises
`InvalidMessage` naming the field, which the bus layer turns into a dead letter."""

from __future__ import annotations

import math

from policyloop.contracts.v1 import bus_pb2


class InvalidMessage(ValueError):
    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field = field


def validate_task(task: bus_pb2.Task) -> None:
    if not task.task_id:
        raise InvalidMessage("task_id", "is empty")
    if not task.environment:
        raise InvalidMessage("environment", "is empty")
    if not task.prompt_token_ids and not task.prompt_text:
        raise InvalidMessage("prompt_token_ids", "and prompt_text are both empty")
    if task.group_size < 1:
        raise InvalidMessage("group_size", "must be at least 1")
    if task.tools and task.sampling.ignore_eos:
        raise InvalidMessage("sampling.ignore_eos", "cannot be combined with tools (a tool call ends at a stop token)")


def validate_trajectory(traj: bus_pb2.Trajectory) -> None:
    if not traj.trajectory_id:
        raise InvalidMessage("trajectory_id", "is empty")
    if not traj.task_id:
        raise InvalidMessage("task_id", "is empty")
    if traj.group_size < 1 or traj.sample_index >= traj.group_size:
        raise InvalidMessage("sample_index", f"{traj.sample_index} is outside a group of {traj.group_size}")
    n = len(traj.response_token_ids)
    if len(traj.behaviour_logprobs) != n:
        raise InvalidMessage("behaviour_logprobs", f"has {len(traj.behaviour_logprobs)} values for {n} tokens")
    if len(traj.loss_mask) != n:
        raise InvalidMessage("loss_mask", f"has {len(traj.loss_mask)} values for {n} tokens")
    position = 0
    for i, span in enumerate(traj.version_spans):
        if span.start != position or span.end <= span.start:
            raise InvalidMessage(f"version_spans[{i}]", f"[{span.start}, {span.end}) does not continue at {position}")
        position = span.end
    if traj.version_spans and position != n:
        raise InvalidMessage("version_spans", f"cover {position} of {n} response tokens")
    _validate_turns(traj)


def _validate_turns(traj: bus_pb2.Trajectory) -> None:
    """Turns cover the response in order; tool tokens are never trained on."""
    if not traj.turns:
        return
    position = 0
    for i, turn in enumerate(traj.turns):
        if turn.start != position or turn.end < turn.start or turn.end > len(traj.response_token_ids):
            raise InvalidMessage(f"turns[{i}]", f"[{turn.start}, {turn.end}) does not continue at {position}")
        if turn.role == bus_pb2.Turn.ROLE_TOOL and any(traj.loss_mask[turn.start:turn.end]):
            raise InvalidMessage(f"turns[{i}]", "a tool turn's tokens must have loss_mask false")
        if turn.role not in (bus_pb2.Turn.ROLE_MODEL, bus_pb2.Turn.ROLE_TOOL):
            raise InvalidMessage(f"turns[{i}].role", "is unspecified")
        position = turn.end
    if position != len(traj.response_token_ids):
        raise InvalidMessage("turns", f"cover {position} of {len(traj.response_token_ids)} response tokens")


def validate_sandbox_job(job: bus_pb2.SandboxJob) -> None:
    if not job.job_id:
        raise InvalidMessage("job_id", "is empty")
    if not job.command:
        raise InvalidMessage("command", "is empty")
    for path in job.files:
        if path.startswith("/") or ".." in path.split("/"):
            raise InvalidMessage("files", f"path {path!r} leaves the scratch directory")
    for name in ("wall_seconds", "cpu_seconds"):
        value = getattr(job.limits, name)
        if not math.isfinite(value) or value < 0:
            raise InvalidMessage(f"limits.{name}", f"{value} is not a number of seconds (0: the default)")
