"""A run's dead-lettered tasks: the gateway reads DLQ and accounts for each task (or group) it
holds as dead-lettered in the task's run (policyloop.state.outcomes), so that a run whose last
tasks no service could handle still ends, with counts that add up.

A letter names its task by its payload (a Task, or a TrajectoryGroup whose id is its task's), or
— when that payload cannot be decoded — by the message id it was published under, which is the
task's id for every message of a run's task. A letter about a letter (the gateway could not
handle it) is read for the one inside.
"""

from __future__ import annotations

from google.protobuf.message import DecodeError

from policyloop.bus import Delivery
from policyloop.bus.connection import MSG_ID_HEADER
from policyloop.contracts.ids import run_of
from policyloop.contracts.v1 import bus_pb2
from policyloop.state.catalog import RunRegistry
from policyloop.state.outcomes import DEAD_LETTERED, TaskCount, TaskOutcomes

_NESTING = 4  # letters about letters read through (one per failed attempt to count one)


def dead_task(letter: bus_pb2.DeadLetter, nesting: int = _NESTING) -> tuple[str, TaskCount] | None:
    """The run and task a dead letter holds; None for one that holds no run's task (a sandbox job,
    a quarantined version, a message published by hand)."""
    try:
        if letter.origin_stream == "TASKS":
            task = bus_pb2.Task.FromString(letter.payload)
            if task.run_id and task.task_id:
                return task.run_id, TaskCount(task.task_id, 0)
        elif letter.origin_stream in ("ROLLOUTS", "TRAJECTORIES"):
            members = bus_pb2.TrajectoryGroup.FromString(letter.payload).trajectories
            if members and members[0].run_id and members[0].task_id:
                return members[0].run_id, TaskCount(members[0].task_id, len(members))
        elif letter.origin_stream == "DLQ" and nesting > 0:
            return dead_task(bus_pb2.DeadLetter.FromString(letter.payload), nesting - 1)
        else:
            return None
    except DecodeError:
        pass
    message_id = letter.headers.get(MSG_ID_HEADER, "")
    run_id = run_of(message_id)
    return None if run_id is None else (run_id, TaskCount(message_id, 0))


class DeadLetterAccounting:
    """The handler of the gateway's DLQ consumer."""

    def __init__(self, runs: RunRegistry, outcomes: TaskOutcomes) -> None:
        self.runs, self.outcomes = runs, outcomes

    async def handle(self, delivery: Delivery[bus_pb2.DeadLetter]) -> None:
        found = dead_task(delivery.message)
        if found is None:
            return
        run_id, task = found
        if await self.runs.state(run_id) is None:  # no such run (any more): nothing to account to
            return
        await self.outcomes.record(run_id, DEAD_LETTERED, [task])
