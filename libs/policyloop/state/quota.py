"""Per-run concurrency quotas shared by replicas through Redis: at most `limit` holders per run
at once. Each slot is a lease (a sorted-set member scored by its expiry), so the slots of a
replica that died come back by themselves. RunningSlots pairs a replica's own running slots with
them, so a job waiting for its run's quota does not hold a running slot."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import redis.asyncio as aioredis

from policyloop.common.clock import now_ms

# KEYS[1] = the run's leases. ARGV: [1] now (ms), [2] this lease's expiry (ms), [3] holder,
# [4] limit, [5] key TTL (ms). Returns 1 when the holder has a slot.
_ACQUIRE = """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[1])
if redis.call('ZSCORE', KEYS[1], ARGV[3]) == false and redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[4]) then
  return 0
end
redis.call('ZADD', KEYS[1], ARGV[2], ARGV[3])
if redis.call('PTTL', KEYS[1]) < tonumber(ARGV[5]) then
  redis.call('PEXPIRE', KEYS[1], ARGV[5])  -- the key lives as long as its longest lease
end
return 1
"""


class RunQuota:
    def __init__(self, client: aioredis.Redis, namespace: str, limit: int, *, scope: str = "sandbox") -> None:
        if limit < 1:
            raise ValueError("limit must be >= 1")
        self.client, self.limit = client, limit
        self.prefix = f"pl:{namespace}:quota:{scope}:"
        self._acquire = client.register_script(_ACQUIRE)

    async def acquire(self, run_id: str, holder: str, lease_s: float) -> bool:
        now = now_ms()
        lease_ms = max(1, int(lease_s * 1000))
        return bool(await self._acquire(keys=[self.prefix + run_id],
                                        args=[now, now + lease_ms, holder, self.limit, lease_ms]))

    async def release(self, run_id: str, holder: str) -> None:
        await self.client.zrem(self.prefix + run_id, holder)

    async def holders(self, run_id: str) -> int:
        await self.client.zremrangebyscore(self.prefix + run_id, "-inf", now_ms())
        return int(await self.client.zcard(self.prefix + run_id))


class RunningSlots:
    """This replica's running slots, taken only together with a slot of the job's run quota: a job
    whose run is at its quota gives the running slot back while it waits."""

    def __init__(self, concurrency: int, quota: RunQuota | None, poll_s: float) -> None:
        self.free = asyncio.Semaphore(concurrency)
        self.quota, self.poll_s = quota, poll_s
        self.held = 0  # jobs waiting for their run's quota (refused at least once)

    @asynccontextmanager
    async def slot(self, run_id: str, holder: str, lease_s: float) -> AsyncIterator[None]:
        quota = self.quota if run_id else None
        refused = False
        try:
            while True:
                await self.free.acquire()
                try:
                    if quota is None or await quota.acquire(run_id, holder, lease_s):
                        break
                except BaseException:
                    self.free.release()  # Redis down, or cancelled: the job is handed back, the slot kept
                    raise
                self.free.release()
                if not refused:
                    refused, self.held = True, self.held + 1
                await asyncio.sleep(self.poll_s)
        finally:
            if refused:
                self.held -= 1
        try:
            yield
        finally:
            self.free.release()
            if quota is not None:
                await quota.release(run_id, holder)
