"""Pacing: rollout replicas start a group only if it can be trained within the lag bound.

AReaL-style admission control, shared through Redis (no controller): the learner trains
`groups_per_step` groups per version: group k is trained on policy version k // groups_per_step.
A replica serving version v may therefore start group k only if k < (v + max_lag + 1) ×
groups_per_step — then its lag is at most max_lag. The version is the one the replica's engine
serves (not the learner's newest, which the engine may not have loaded yet). A replica asks for a
slot before sampling a task; a task that is redelivered (its replica died) keeps the slot it
had, so crashes do not eat capacity. Pace first; the learner still drops what exceeds the
bound.
"""

from __future__ import annotations

import redis.asyncio as aioredis

# KEYS: [1] started counter, [2] the task's admission key.
# ARGV: [1] groups per step, [2] max lag, [3] admission TTL (ms), [4] the replica's served version.
_ADMIT = """
if redis.call('EXISTS', KEYS[2]) == 1 then
  return 1
end
local started = tonumber(redis.call('GET', KEYS[1]) or '0')
local version = tonumber(ARGV[4])
local limit = (version + tonumber(ARGV[2]) + 1) * tonumber(ARGV[1])
if started >= limit then
  return 0
end
redis.call('INCR', KEYS[1])
redis.call('SET', KEYS[2], '1', 'PX', ARGV[3])
return 1
"""


class Pacer:
    def __init__(self, client: aioredis.Redis, namespace: str, model: str, *, groups_per_step: int,
                 max_lag: int, admission_ttl_s: float = 24 * 3600) -> None:
        if groups_per_step < 1 or max_lag < 0:
            raise ValueError("groups_per_step must be >= 1 and max_lag >= 0")
        self.client = client
        self.prefix = f"pl:{namespace}:"
        self.model = model
        self.groups_per_step = groups_per_step
        self.max_lag = max_lag
        self.ttl_ms = int(admission_ttl_s * 1000)
        self._admit = client.register_script(_ADMIT)

    async def try_admit(self, task_id: str, served_version: int) -> bool:
        keys = [f"{self.prefix}pace:{self.model}:started", f"{self.prefix}pace:{self.model}:task:{task_id}"]
        args = [self.groups_per_step, self.max_lag, self.ttl_ms, served_version]
        return bool(await self._admit(keys=keys, args=args))

    async def started(self) -> int:
        return int(await self.client.get(f"{self.prefix}pace:{self.model}:started") or 0)
