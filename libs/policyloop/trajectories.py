"""Identity and bookkeeping of trajectories as they pass from service to service."""

from __future__ import annotations

import time

from policyloop.contracts.v1 import bus_pb2


def now_ms() -> int:
    return int(time.time() * 1000)


def trajectory_id(task_id: str, sample_index: int) -> str:
    """Stable across redeliveries and replicas, so a re-published sample is deduplicated."""
    return f"{task_id}/{sample_index}"


def group_members(task: bus_pb2.Task, replica: str) -> list[bus_pb2.Trajectory]:
    """One trajectory record per sample of the task's group, with everything the task fixes
    (identity, prompt, metadata) filled in and no response yet."""
    started = now_ms()
    return [
        bus_pb2.Trajectory(
            trajectory_id=trajectory_id(task.task_id, i),
            task_id=task.task_id,
            group_id=task.task_id,
            sample_index=i,
            group_size=task.group_size,
            run_id=task.run_id,
            environment=task.environment,
            prompt_token_ids=task.prompt_token_ids,
            rollout_replica=replica,
            metadata=task.metadata,
            timings=bus_pb2.Timings(
                task_created_unix_ms=task.created_unix_ms, generation_started_unix_ms=started
            ),
        )
        for i in range(task.group_size)
    ]
