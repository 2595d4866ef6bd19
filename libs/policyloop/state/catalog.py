"""Environments and runs, kept in Redis by the gateway (any replica can answer for any run).

A run is a hash: its definition (the StartRunRequest, immutable), its state, its feeding
progress and timestamps, each a field of its own so that the feeder and StopRun never
overwrite each other's updates.
"""

from __future__ import annotations

import time

import redis.asyncio as aioredis

from policyloop.common.clock import now_ms
from policyloop.contracts.v1 import loop_pb2

# Stopped or failed: no more of the run's tasks are fed, and what was fed may not all be trained.
ENDED_STATES = frozenset({loop_pb2.RUN_STATE_STOPPED, loop_pb2.RUN_STATE_FAILED})
TERMINAL_STATES = ENDED_STATES | {loop_pb2.RUN_STATE_FINISHED}


def run_key_prefix(namespace: str) -> str:
    """Where the run registry keeps a run's hash (`<prefix><run_id>`)."""
    return f"pl:{namespace}:run:"


class EnvironmentConflict(Exception):
    """A different definition is stored under the same name@version."""


class EnvironmentCatalog:
    def __init__(self, client: aioredis.Redis, namespace: str) -> None:
        """`client` must not decode responses: definitions are protobuf bytes."""
        self.client = client
        self.prefix = f"pl:{namespace}:env:"

    async def put(self, key: str, env: loop_pb2.Environment) -> bool:
        """Stores the environment; True if new, False if the identical one was there."""
        data = env.SerializeToString(deterministic=True)
        if await self.client.set(self.prefix + key, data, nx=True):
            return True
        if await self.client.get(self.prefix + key) == data:
            return False
        raise EnvironmentConflict(f"{key} exists with a different definition; submit a new version")

    async def get(self, key: str) -> loop_pb2.Environment | None:
        data = await self.client.get(self.prefix + key)
        if data is None:
            return None
        env = loop_pb2.Environment()
        env.ParseFromString(data)
        return env


class RunConflict(Exception):
    pass


class RunRegistry:
    def __init__(self, client: aioredis.Redis, namespace: str) -> None:
        """`client` must not decode responses: definitions are protobuf bytes."""
        self.client = client
        self.prefix = run_key_prefix(namespace)
        self.index = f"pl:{namespace}:runs"

    async def create(self, run_id: str, request: loop_pb2.StartRunRequest, tasks_total: int,
                     start_version: int = 0) -> None:
        now = str(now_ms())
        key = self.prefix + run_id
        created = await self.client.hsetnx(key, "definition", request.SerializeToString(deterministic=True))
        if not created:
            raise RunConflict(f"run {run_id} exists")
        await self.client.hset(key, mapping={
            "state": str(loop_pb2.RUN_STATE_RUNNING), "tasks_total": str(tasks_total),
            "tasks_enqueued": "0", "created": now, "updated": now, "error": "", "start_version": str(start_version),
        })
        await self.client.sadd(self.index, run_id)

    async def definition(self, run_id: str) -> loop_pb2.StartRunRequest | None:
        data = await self.client.hget(self.prefix + run_id, "definition")
        if data is None:
            return None
        request = loop_pb2.StartRunRequest()
        request.ParseFromString(data)
        return request

    async def get(self, run_id: str, policy_version: int = 0) -> loop_pb2.Run | None:
        fields = await self.client.hgetall(self.prefix + run_id)
        if b"definition" not in fields:
            return None
        request = loop_pb2.StartRunRequest()
        request.ParseFromString(fields[b"definition"])
        return loop_pb2.Run(
            run_id=run_id,
            state=int(fields.get(b"state", b"0")),
            environments=request.environments,
            model=request.model,
            max_lag=request.max_lag,
            tasks_total=int(fields.get(b"tasks_total", b"0")),
            tasks_enqueued=int(fields.get(b"tasks_enqueued", b"0")),
            policy_version=policy_version,
            created_unix_ms=int(fields.get(b"created", b"0")),
            updated_unix_ms=int(fields.get(b"updated", b"0")),
            error=fields.get(b"error", b"").decode(),
            lora=request.lora if request.HasField("lora") else None,
            start_version=int(fields.get(b"start_version", b"0")),
        )

    async def state(self, run_id: str) -> int | None:
        """The run's state (None: no such run, e.g. tasks published by hand)."""
        value = await self.client.hget(self.prefix + run_id, "state")
        return None if value is None else int(value)

    async def set_state(self, run_id: str, state: int, error: str = "") -> None:
        await self.client.hset(self.prefix + run_id, mapping={
            "state": str(state), "error": error, "updated": str(now_ms()),
        })

    async def set_enqueued(self, run_id: str, count: int) -> None:
        await self.client.hset(self.prefix + run_id, mapping={
            "tasks_enqueued": str(count), "updated": str(now_ms()),
        })

    async def run_ids(self) -> list[str]:
        return sorted(m.decode() for m in await self.client.smembers(self.index))


class StoppedRuns:
    """Whether a run has ended (stopped, finished or failed), as the rollout asks before sampling
    one of its Tasks: a stopped run's queued Tasks are acked unsampled. Answers are cached for
    `ttl_s` (one Redis read per run and interval, not per Task)."""

    def __init__(self, runs: RunRegistry, ttl_s: float = 1.0) -> None:
        self.runs, self.ttl_s = runs, ttl_s
        self._cache: dict[str, tuple[float, bool]] = {}

    async def ended(self, run_id: str) -> bool:
        now = time.monotonic()
        cached = self._cache.get(run_id)
        if cached is not None and now - cached[0] < self.ttl_s:
            return cached[1]
        state = await self.runs.state(run_id)
        ended = state in TERMINAL_STATES
        self._cache[run_id] = (now, ended)
        return ended
