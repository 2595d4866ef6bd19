"""A run's progress in Redis: the learner records each step's samples by run and environment,
rollout replicas the tokens they generate; the gateway reads it for GetRun and WatchRun.

One hash per run (`pl:<ns>:progress:<run_id>`), updated with HINCRBY / HINCRBYFLOAT so that any
number of writers add up without coordination. Samples are counted with their tasks' outcomes
(policyloop.state.outcomes), once per task: a step the learner replays after a restart, or a copy
of a task already trained, adds nothing.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Awaitable, Iterable

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from policyloop.common.clock import now_ms
from policyloop.contracts.ids import run_of, task_of
from policyloop.contracts.v1 import bus_pb2, loop_pb2
from policyloop.contracts.versions import sample_lag
from policyloop.state.outcomes import (
    DEAD_LETTERED,
    DROPPED,
    TASKS_FIELD,
    TRAINED,
    TaskOutcomes,
    dropped,
    task_counts,
)
from policyloop.telemetry.logging import get_logger

log = get_logger(__name__)


async def record_progress(update: Awaitable[None]) -> None:
    """A run's figures and its tasks' accounting (GetRun, WatchRun, its end): never worth
    stopping training for (a resumed learner accounts again for the steps it remembers)."""
    try:
        await update
    except (RedisError, OSError) as exc:
        log.warning("progress_not_recorded", error=repr(exc))



class RunProgressStore:
    def __init__(self, client: aioredis.Redis, namespace: str) -> None:
        self.client = client
        self.outcomes = TaskOutcomes(client, namespace)
        self.prefix = self.outcomes.progress_prefix

    async def record_step(self, step: int, trained_version: int, samples: Iterable[bus_pb2.Trajectory]) -> None:
        """One learner step: its tasks accounted for as trained, and its samples counted by run and
        environment, with rewards, lags and tokens. Samples of a task accounted for before (a step
        replayed after a restart, a copy of a trained task) are not counted again."""
        now = now_ms()
        pipe = self.client.pipeline(transaction=False)
        runs = _by_run(samples)
        for run_id, trajs in runs.items():
            # A run is finished only once its last step's figures are written too (below).
            new = set(await self.outcomes.record(run_id, TRAINED, task_counts(t.task_id for t in trajs),
                                                 finish=False))
            trajs = [t for t in trajs if t.task_id in new]
            if not trajs:
                continue
            key = self.prefix + run_id
            envs: defaultdict[str, list[float]] = defaultdict(list)
            lags: Counter[int] = Counter()
            tokens = 0
            for traj in trajs:
                envs[traj.environment].append(traj.reward)
                lags[sample_lag(traj, trained_version)] += 1
                tokens += sum(traj.loss_mask)
            for env, rewards in envs.items():
                pipe.hincrby(key, f"samples:{env}", len(rewards))
                pipe.hincrbyfloat(key, f"reward_sum:{env}", sum(rewards))
                pipe.hset(key, f"last_reward:{env}", repr(sum(rewards) / len(rewards)))
            for lag, count in lags.items():
                pipe.hincrby(key, f"lag:{lag}", count)
            pipe.hincrby(key, "trained_tokens", tokens)
            pipe.hset(key, "learner_step", step)
            pipe.hsetnx(key, "first_step_ms", now)
            pipe.hset(key, "last_step_ms", now)
        await pipe.execute()
        for run_id in runs:
            await self.outcomes.finish_if_accounted(run_id)

    async def record_trained_ids(self, trajectory_ids: Iterable[str]) -> None:
        """Tasks trained by a step known only by its samples' ids (a step replayed from LEDGER after
        a restart, whose figures were recorded when it was first taken, or were lost with it)."""
        by_run: defaultdict[str, list[str]] = defaultdict(list)
        for trajectory_id in trajectory_ids:
            task = task_of(trajectory_id)
            run_id = run_of(task)
            if run_id is not None:
                by_run[run_id].append(task)
        for run_id, tasks in by_run.items():
            await self.outcomes.record(run_id, TRAINED, task_counts(tasks))

    async def record_dropped(self, samples: Iterable[bus_pb2.Trajectory], reason: str) -> None:
        """Samples acked without training: their tasks accounted for as dropped for `reason`."""
        for run_id, trajs in _by_run(samples).items():
            await self.outcomes.record(run_id, dropped(reason), task_counts(t.task_id for t in trajs))

    async def record_generated(self, run_id: str, tokens: int) -> None:
        key, now = self.prefix + run_id, now_ms()
        pipe = self.client.pipeline(transaction=False)
        pipe.hincrby(key, "generated_tokens", tokens)
        pipe.hsetnx(key, "first_generated_ms", now)
        pipe.hset(key, "last_generated_ms", now)
        await pipe.execute()

    async def get(self, run_id: str) -> loop_pb2.RunProgress:
        fields = await self.client.hgetall(self.prefix + run_id)
        return progress_from_fields({_text(k): _text(v) for k, v in fields.items()})


def _by_run(samples: Iterable[bus_pb2.Trajectory]) -> dict[str, list[bus_pb2.Trajectory]]:
    by_run: defaultdict[str, list[bus_pb2.Trajectory]] = defaultdict(list)
    for traj in samples:
        by_run[traj.run_id].append(traj)
    return by_run


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _rate(count: str | None, first_ms: str | None, last_ms: str | None) -> float:
    if not count or not first_ms or not last_ms or int(last_ms) <= int(first_ms):
        return 0.0
    return int(count) / ((int(last_ms) - int(first_ms)) / 1000)


def progress_from_fields(fields: dict[str, str]) -> loop_pb2.RunProgress:
    """The RunProgress message from the hash's fields (pure: tested without Redis)."""
    progress = loop_pb2.RunProgress(
        learner_step=int(fields.get("learner_step", 0)), trained_samples=int(fields.get("trained_samples", 0)),
        dropped_samples=int(fields.get("dropped_samples", 0)), trained_tokens=int(fields.get("trained_tokens", 0)),
        generated_tokens=int(fields.get("generated_tokens", 0)),
        dead_lettered_samples=int(fields.get("dead_lettered_samples", 0)),
        trained_tokens_per_second=_rate(fields.get("trained_tokens"), fields.get("first_step_ms"),
                                        fields.get("last_step_ms")),
        generated_tokens_per_second=_rate(fields.get("generated_tokens"), fields.get("first_generated_ms"),
                                          fields.get("last_generated_ms")),
    )
    for name, value in fields.items():
        kind, _, scope = name.partition(":")
        if kind == "samples":
            env = progress.environments[scope]
            env.trained_samples = int(value)
            env.mean_reward = float(fields.get(f"reward_sum:{scope}", 0.0)) / max(1, int(value))
            env.last_step_reward = float(fields.get(f"last_reward:{scope}", 0.0))
        elif kind == "lag":
            progress.lag_histogram[int(scope)] = int(value)
    _count_tasks(progress, fields)
    return progress


def _count_tasks(progress: loop_pb2.RunProgress, fields: dict[str, str]) -> None:
    """The run's tasks by outcome (state.outcomes): trained, dropped by reason, dead-lettered."""
    for name, value in fields.items():
        if not name.startswith(TASKS_FIELD):
            continue
        outcome, _, reason = name.removeprefix(TASKS_FIELD).partition(":")
        if outcome == TRAINED:
            progress.tasks_trained += int(value)
        elif outcome == DEAD_LETTERED:
            progress.tasks_dead_lettered += int(value)
        elif outcome == DROPPED:
            progress.tasks_dropped += int(value)
            progress.tasks_dropped_by_reason[reason] += int(value)
