"""Per-run concurrency quotas shared by replicas through Redis: at most `limit` holders per run
at once. Each slot is a lease (a sorted-set member scored by its expiry), so the slots of a
replica that died come back by themselves."""

from __future__ import annotations

import time

import redis.asyncio as aioredis

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
        now = int(time.time() * 1000)
        lease_ms = max(1, int(lease_s * 1000))
        return bool(await self._acquire(keys=[self.prefix + run_id],
                                        args=[now, now + lease_ms, holder, self.limit, lease_ms]))

    async def release(self, run_id: str, holder: str) -> None:
        await self.client.zrem(self.prefix + run_id, holder)

    async def holders(self, run_id: str) -> int:
        await self.client.zremrangebyscore(self.prefix + run_id, "-inf", int(time.time() * 1000))
        return int(await self.client.zcard(self.prefix + run_id))
