"""What became of each task of a run — trained, dropped (with the reason) or dead-lettered —
recorded once per task whoever records it and however often its messages were redelivered, and
the run marked FINISHED in the same atomic step that accounts for its last task.

A task's outcome is a field of the run's outcome hash (`pl:<ns>:outcomes:<run_id>`), set with
HSETNX: the first outcome stands (a replayed step, a redelivered copy or a dead letter of a
task already trained changes nothing), and only a newly accounted task adds to the run's
counts in its progress hash. The learner records trained and dropped tasks, a rollout replica
the tasks of a stopped run it acks unsampled, and the gateway the tasks DLQ holds.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import redis.asyncio as aioredis

from policyloop.common.clock import now_ms
from policyloop.contracts.v1 import loop_pb2
from policyloop.state.catalog import ENDED_STATES, run_key_prefix

TRAINED = "trained"
DEAD_LETTERED = "dead_lettered"
DROPPED = "dropped"
TASKS_FIELD = "tasks:"
# Why a task is dropped: beyond the lag bound when the learner came to it, or its run ended first.
STALE = "stale"
RUN_STOPPED = "run_stopped"  # progress hash fields "tasks:<outcome>", counting tasks by outcome

_CHUNK_TASKS = 1000  # tasks per script call

# Where an outcome's samples are counted in the progress hash.
_SAMPLES_FIELD = {TRAINED: "trained_samples", DROPPED: "dropped_samples", DEAD_LETTERED: "dead_lettered_samples"}

# KEYS: outcomes hash, progress hash, run hash. ARGV: outcome, samples field, now (ms), the
# RUNNING and FINISHED state numbers (FINISHED empty: do not finish it here), then (task id,
# samples) pairs. Returns the newly accounted task ids. Once every task of a running run is
# accounted for, it is FINISHED.
_RECORD = """
local outcomes, progress, run = KEYS[1], KEYS[2], KEYS[3]
local outcome, samples_field, now, running, finished = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]
local new, samples = {}, 0
for i = 6, #ARGV, 2 do
  if redis.call('HSETNX', outcomes, ARGV[i], outcome) == 1 then
    new[#new + 1] = ARGV[i]
    samples = samples + tonumber(ARGV[i + 1])
  end
end
if #new > 0 then
  redis.call('HINCRBY', progress, 'tasks:' .. outcome, #new)
  if samples > 0 then redis.call('HINCRBY', progress, samples_field, samples) end
end
local total = redis.call('HGET', run, 'tasks_total')
local running_now = redis.call('HGET', run, 'state') == running
if finished ~= '' and total and running_now and redis.call('HLEN', outcomes) >= tonumber(total) then
  redis.call('HSET', run, 'state', finished, 'updated', now)
end
return new
"""


def dropped(reason: str) -> str:
    """The outcome of a task acked without training, for `reason` (stale, run_stopped, ...)."""
    return f"{DROPPED}:{reason}"


@dataclass(frozen=True)
class TaskCount:
    """One task's share of an outcome: its id and how many of its samples it had."""

    task_id: str
    samples: int


@dataclass(frozen=True)
class RunStanding:
    """A run's state, its tasks fed and how many of them are accounted for (None state: no such run)."""

    state: int | None
    tasks_total: int
    tasks_enqueued: int
    accounted: int

    @property
    def ended(self) -> bool:
        """Stopped or failed: no more of its tasks are fed."""
        return self.state in ENDED_STATES

    def all_held(self, held_tasks: int) -> bool:
        """Whether `held_tasks` held by a learner are all its tasks not yet accounted for: nothing
        more of it can arrive, so a batch they do not fill is its last. A running run's tasks are
        all it will feed; a stopped one's, those it fed before it stopped."""
        if self.state == loop_pb2.RUN_STATE_RUNNING:
            return self.accounted + held_tasks >= self.tasks_total
        return self.ended and self.accounted + held_tasks >= self.tasks_enqueued


class TaskOutcomes:
    """`client` may decode responses or not; keys are under the namespace like the run registry's."""

    def __init__(self, client: aioredis.Redis, namespace: str) -> None:
        self.client = client
        self.outcomes_prefix = f"pl:{namespace}:outcomes:"
        self.progress_prefix = f"pl:{namespace}:progress:"  # the run's figures (state.progress)
        self.run_prefix = run_key_prefix(namespace)
        self._record = client.register_script(_RECORD)

    async def record(self, run_id: str, outcome: str, tasks: Iterable[TaskCount], *, finish: bool = True
                     ) -> list[str]:
        """Accounts for `tasks` of `run_id` with `outcome` (TRAINED, DEAD_LETTERED or dropped(reason));
        returns the ids of those not accounted for before. `finish`: mark the run FINISHED if this
        accounts for its last task (else the caller does, with `finish_if_accounted`, once the
        figures that go with them are written)."""
        head: list[str | int] = [outcome, _SAMPLES_FIELD[outcome.partition(":")[0]], now_ms(),
                                 loop_pb2.RUN_STATE_RUNNING, loop_pb2.RUN_STATE_FINISHED if finish else ""]
        keys = [self.outcomes_prefix + run_id, self.progress_prefix + run_id, self.run_prefix + run_id]
        tasks = list(tasks)
        new: list[str] = []
        # In chunks: Redis runs nothing else while a script runs (a resumed learner's thousand steps).
        for start in range(0, max(1, len(tasks)), _CHUNK_TASKS):
            chunk = tasks[start:start + _CHUNK_TASKS]
            if not chunk and not finish:
                break
            args = head + [field for task in chunk for field in (task.task_id, task.samples)]
            new += [t.decode() if isinstance(t, bytes) else t for t in await self._record(keys=keys, args=args)]
        return new

    async def finish_if_accounted(self, run_id: str) -> None:
        """Marks the run FINISHED if it runs and every task of it is accounted for."""
        await self.record(run_id, TRAINED, [])

    async def standing(self, run_id: str) -> RunStanding:
        pipe = self.client.pipeline(transaction=False)
        pipe.hget(self.run_prefix + run_id, "state")
        pipe.hget(self.run_prefix + run_id, "tasks_total")
        pipe.hget(self.run_prefix + run_id, "tasks_enqueued")
        pipe.hlen(self.outcomes_prefix + run_id)
        state, total, enqueued, accounted = await pipe.execute()
        return RunStanding(None if state is None else int(state), int(total or 0), int(enqueued or 0),
                           int(accounted))


def task_counts(task_ids: Iterable[str]) -> list[TaskCount]:
    """Tasks and their samples from the samples' task ids (one id per sample), in first-seen order."""
    counts: dict[str, int] = {}
    for task_id in task_ids:
        counts[task_id] = counts.get(task_id, 0) + 1
    return [TaskCount(t, n) for t, n in counts.items()]
