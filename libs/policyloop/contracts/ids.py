"""The ids the loop gives a run's tasks and their samples. Each is a pure function of what it
names, so a task fed again (a feeder that took over) or a sample generated again (a redelivered
task) gets the same id and is deduplicated; and an id names its task and run wherever it goes
(LEDGER records only trajectory ids; a dead letter that cannot be decoded still has its message id)."""

from __future__ import annotations


def task_id(run_id: str, index: int) -> str:
    """The run's index-th task (and its group: a group's id is its task's)."""
    return f"{run_id}:{index:09d}"


def trajectory_id(task_id: str, sample_index: int) -> str:
    """The task's sample_index-th sample."""
    return f"{task_id}/{sample_index}"


def task_of(trajectory_id: str) -> str:
    """The task a sample's id names."""
    return trajectory_id.rpartition("/")[0]


def run_of(task_id: str) -> str | None:
    """The run a task id made by `task_id` names (None: an id made otherwise, e.g. by hand)."""
    run, sep, index = task_id.rpartition(":")
    return run if sep and run and index.isdigit() else None
