"""Where evaluation results live: in Redis by run and version (what GetRun and the regression
rule read), and on EVALS (pl.evals.<run>), the durable record of every result."""

from __future__ import annotations

import redis.asyncio as aioredis

from policyloop.bus import Bus, evals_subject
from policyloop.contracts.v1 import loop_pb2

RUN_EVALS_SHOWN = 100  # GetRun shows a run's newest results up to this many


class EvalStore:
    """A Redis hash per run: version → VersionEval (a client without decoded responses)."""

    def __init__(self, client: aioredis.Redis, namespace: str) -> None:
        self.client = client
        self.prefix = f"pl:{namespace}:evals:"

    async def put(self, result: loop_pb2.VersionEval) -> None:
        await self.client.hset(self.prefix + result.run_id, str(result.version), result.SerializeToString())

    async def get(self, run_id: str, version: int) -> loop_pb2.VersionEval | None:
        raw = await self.client.hget(self.prefix + run_id, str(version))
        return loop_pb2.VersionEval.FromString(raw) if raw is not None else None

    async def newest(self, run_id: str, count: int) -> list[loop_pb2.VersionEval]:
        """The run's `count` newest results, oldest first (only those are read and parsed: GetRun
        and WatchRun ask for them on every poll)."""
        versions = sorted(int(v) for v in await self.client.hkeys(self.prefix + run_id))[-count:]
        if not versions:
            return []
        raw = await self.client.hmget(self.prefix + run_id, [str(v) for v in versions])
        return [loop_pb2.VersionEval.FromString(r) for r in raw if r is not None]

    async def all(self, run_id: str) -> list[loop_pb2.VersionEval]:
        """The run's results, oldest version first."""
        raw = await self.client.hgetall(self.prefix + run_id)
        return sorted((loop_pb2.VersionEval.FromString(v) for v in raw.values()), key=lambda e: e.version)


async def record_eval(store: EvalStore, bus: Bus, result: loop_pb2.VersionEval) -> None:
    """Stores a result in Redis and on EVALS (the same result again is deduplicated)."""
    await store.put(result)
    await bus.publish(evals_subject(result.run_id), result, f"{result.run_id}:{result.version}")
