"""A run's progress in Redis: the learner records each step's samples by run and environment,
rollout replicas the tokens they generate; the gateway reads it for GetRun and WatchRun.

One hash per run (`pl:<ns>:progress:<run_id>`), updated with HINCRBY / HINCRBYFLOAT so that any
number of writers add up without coordination. A step the learner replays after a restart was
recorded when it was first taken and is not recorded again.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable

import redis.asyncio as aioredis

from policyloop.common.clock import now_ms
from policyloop.contracts.v1 import bus_pb2, loop_pb2
from policyloop.contracts.versions import sample_lag


class RunProgressStore:
    def __init__(self, client: aioredis.Redis, namespace: str) -> None:
        self.client = client
        self.prefix = f"pl:{namespace}:progress:"

    async def record_step(self, step: int, trained_version: int, samples: Iterable[bus_pb2.Trajectory]) -> None:
        """One learner step: its samples counted by run and environment, with rewards, lags and tokens."""
        by_run: defaultdict[str, list[bus_pb2.Trajectory]] = defaultdict(list)
        for traj in samples:
            by_run[traj.run_id].append(traj)
        now = now_ms()
        pipe = self.client.pipeline(transaction=False)
        for run_id, trajs in by_run.items():
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
            pipe.hincrby(key, "trained_samples", len(trajs))
            pipe.hincrby(key, "trained_tokens", tokens)
            pipe.hset(key, "learner_step", step)
            pipe.hsetnx(key, "first_step_ms", now)
            pipe.hset(key, "last_step_ms", now)
        await pipe.execute()

    async def record_dropped(self, samples: Iterable[bus_pb2.Trajectory]) -> None:
        counts = Counter(traj.run_id for traj in samples)
        pipe = self.client.pipeline(transaction=False)
        for run_id, count in counts.items():
            pipe.hincrby(self.prefix + run_id, "dropped_samples", count)
        await pipe.execute()

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
    return progress
