"""Redis-backed shared state. Keys live under `pl:<namespace>:` so that several clusters (or
tests) can share one Redis without seeing each other.

- VersionRegistry: the current policy version per model, advanced only by compare-and-set.
- HeartbeatRegistry: who is alive (a key per instance with a TTL), with its version and health.
- IdempotencyKeys: claim a key once (SET NX with a TTL), e.g. to run a side effect once.
"""

from __future__ import annotations

import asyncio
import time

import redis.asyncio as aioredis
import redis.exceptions
from google.protobuf import json_format
from pydantic import BaseModel, ConfigDict, Field
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff

from policyloop.common.clock import now_ms
from policyloop.contracts.v1 import status_pb2


class StateUnavailable(Exception):
    """Redis did not answer within the connect deadline."""


class VersionConflict(Exception):
    def __init__(self, model: str, expected: int, actual: int) -> None:
        super().__init__(f"policy version of {model} is {actual}, not the expected {expected}")
        self.model, self.expected, self.actual = model, expected, actual


class RedisPool(BaseModel):
    """The connections of one Redis client (a service holds one or two). A command finding them
    all busy waits for one to come back instead of failing: a burst of requests (150 Tinker
    samples at once) queues for a few milliseconds rather than answering errors."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_connections: int = Field(64, ge=1, description="Connections the client opens at most; commands beyond "
                                                       "wait for a free one.")
    wait_timeout_s: float = Field(20.0, gt=0, description="How long a command waits for a free connection before "
                                                          "it fails (ConnectionError: No connection available).")


async def connect_redis(
    url: str, *, connect_timeout_s: float = 10.0, decode_responses: bool = True, pool: RedisPool | None = None
) -> aioredis.Redis:
    """Connects and pings within the deadline (retrying while the server starts). Later
    commands retry on connection errors, so a Redis restart is survived. `pool`: its bounds
    (RedisPool's defaults if None)."""
    pool = pool or RedisPool()
    connections = aioredis.BlockingConnectionPool.from_url(
        url,
        max_connections=pool.max_connections,
        timeout=pool.wait_timeout_s,
        decode_responses=decode_responses,
        socket_connect_timeout=2,
        socket_timeout=5,
        health_check_interval=10,
        retry=Retry(ExponentialBackoff(cap=1.0, base=0.05), retries=8),
        retry_on_error=[redis.exceptions.ConnectionError, redis.exceptions.TimeoutError],
    )
    client = aioredis.Redis.from_pool(connections)  # closing the client closes its pool
    deadline = time.monotonic() + connect_timeout_s
    while True:
        try:
            # The client's own retries could outlast the deadline: bound each attempt.
            await asyncio.wait_for(client.ping(), timeout=max(0.1, deadline - time.monotonic()))
            return client
        except (TimeoutError, redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError) as exc:
            if time.monotonic() >= deadline:
                await client.aclose()
                raise StateUnavailable(f"no Redis at {url} within {connect_timeout_s}s: {exc!r}") from exc
            await asyncio.sleep(0.2)


def _prefix(namespace: str) -> str:
    return f"pl:{namespace}:"


# Keys a SCAN call looks at. Redis' default (10) makes a scan of a namespace holding a few thousand
# keys (pacing slots) a hundred round trips; heartbeats are read every few seconds by every replica.
SCAN_BATCH = 1000

# KEYS[1] = version key; ARGV[1] = expected (current) version, ARGV[2] = new version,
# ARGV[3] = time. Absent key counts as version 0. Returns {1, new} or {0, actual}.
_CAS_SCRIPT = """
local current = tonumber(redis.call('HGET', KEYS[1], 'version') or '0')
if current ~= tonumber(ARGV[1]) then
  return {0, current}
end
redis.call('HSET', KEYS[1], 'version', ARGV[2], 'updated_unix_ms', ARGV[3])
return {1, tonumber(ARGV[2])}
"""


# KEYS[1] = version key; ARGV[1] = new version, ARGV[2] = time. Moves the version forward only.
# Returns {1, previous} or {0, current} when the current version is not below the new one.
_ADVANCE_SCRIPT = """
local current = tonumber(redis.call('HGET', KEYS[1], 'version') or '0')
if current >= tonumber(ARGV[1]) then
  return {0, current}
end
redis.call('HSET', KEYS[1], 'version', ARGV[1], 'updated_unix_ms', ARGV[2])
return {1, current}
"""


class VersionRegistry:
    """The current policy version of each model. Versions only move by compare-and-set, so two
    learners (or a learner and its restarted self) can never both publish version v+1."""

    def __init__(self, client: aioredis.Redis, namespace: str) -> None:
        self.client = client
        self.prefix = _prefix(namespace) + "version:"
        self._cas = client.register_script(_CAS_SCRIPT)
        self._advance = client.register_script(_ADVANCE_SCRIPT)

    async def get(self, model: str) -> int:
        value = await self.client.hget(self.prefix + model, "version")
        return int(value) if value is not None else 0

    async def compare_and_set(self, model: str, expected: int, new: int) -> int:
        """Sets the version to `new` if it is `expected` now; raises VersionConflict otherwise."""
        if new <= expected:
            raise ValueError(f"a new version must be greater than {expected}, got {new}")
        ok, actual = await self._cas(
            keys=[self.prefix + model], args=[expected, new, now_ms()]
        )
        if not ok:
            raise VersionConflict(model, expected, int(actual))
        return new

    async def advance(self, model: str, new: int) -> int:
        """Moves the version forward to `new` from wherever it is below it (a Redis restarted
        from an append-only file a second old may be behind the learner); returns the previous
        version. Raises VersionConflict when it is already `new` or later: another learner."""
        ok, current = await self._advance(keys=[self.prefix + model], args=[new, now_ms()])
        if not ok:
            raise VersionConflict(model, new - 1, int(current))
        return int(current)

    async def all(self) -> dict[str, tuple[int, int]]:
        """{model: (version, updated_unix_ms)} for every model with a version."""
        out: dict[str, tuple[int, int]] = {}
        async for key in self.client.scan_iter(match=self.prefix + "*", count=SCAN_BATCH):
            fields = await self.client.hgetall(key)
            if "version" in fields:
                out[key.removeprefix(self.prefix)] = (
                    int(fields["version"]), int(fields.get("updated_unix_ms", 0))
                )
        return out


# A service instance's heartbeat: the typed record every service writes (contracts status.proto).
Heartbeat = status_pb2.ServiceHeartbeat


class HeartbeatRegistry:
    """One key per service instance, refreshed every few seconds with a TTL: an instance that
    stops beating disappears by itself."""

    def __init__(self, client: aioredis.Redis, namespace: str) -> None:
        self.client = client
        self.prefix = _prefix(namespace) + "hb:"

    async def beat(self, heartbeat: Heartbeat, ttl_s: float) -> None:
        heartbeat.beat_unix_ms = now_ms()
        key = f"{self.prefix}{heartbeat.service}:{heartbeat.instance}"
        # The message's JSON mapping: typed by its schema, and readable with redis-cli.
        await self.client.set(key, json_format.MessageToJson(heartbeat, indent=None), px=max(1, int(ttl_s * 1000)))

    async def remove(self, service: str, instance: str) -> None:
        await self.client.delete(f"{self.prefix}{service}:{instance}")

    async def alive(self, service: str | None = None) -> list[Heartbeat]:
        match = f"{self.prefix}{service}:*" if service else f"{self.prefix}*"
        keys = [key async for key in self.client.scan_iter(match=match, count=SCAN_BATCH)]
        if not keys:
            return []
        beats = []
        for raw in await self.client.mget(keys):
            if raw is not None:  # expired between SCAN and MGET
                beats.append(json_format.Parse(raw, Heartbeat(), ignore_unknown_fields=True))
        return sorted(beats, key=lambda b: (b.service, b.instance))


class IdempotencyKeys:
    """Claims that make a side effect happen once across replicas and restarts."""

    def __init__(self, client: aioredis.Redis, namespace: str) -> None:
        self.client = client
        self.prefix = _prefix(namespace) + "idem:"

    async def claim(self, key: str, ttl_s: float, owner: str = "1") -> bool:
        """True for the first caller within the TTL, False for every later one."""
        return bool(await self.client.set(self.prefix + key, owner, nx=True, px=max(1, int(ttl_s * 1000))))

    async def owner(self, key: str) -> str | None:
        return await self.client.get(self.prefix + key)

    async def extend(self, key: str, ttl_s: float, owner: str) -> bool:
        """Renews a claim `owner` still holds (a lease); False if it lapsed or changed hands."""
        script = (
            "if redis.call('GET', KEYS[1]) == ARGV[1] then "
            "return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end return 0"
        )
        return bool(await self.client.eval(script, 1, self.prefix + key, owner, max(1, int(ttl_s * 1000))))

    async def release(self, key: str, owner: str) -> bool:
        """Drops the claim if `owner` still holds it (so a failed attempt can be retried)."""
        script = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0"
        return bool(await self.client.eval(script, 1, self.prefix + key, owner))
