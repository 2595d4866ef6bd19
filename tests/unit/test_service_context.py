"""A service's policy version: who waits for it to move is woken when it does."""

from __future__ import annotations

import asyncio

from policyloop.runtime.service import ServiceContext
from policyloop.runtime.settings import ServiceSettings


async def test_waiting_for_the_version_to_move() -> None:
    ctx = ServiceContext(name="rollout", settings=ServiceSettings(), bus=None, redis=None)  # type: ignore[arg-type]
    assert not await ctx.version_moved(0, timeout_s=0.01)       # nothing moved: the wait runs out
    assert await ctx.version_moved(5, timeout_s=0.01)           # already other than 5: no wait
    waiting = asyncio.create_task(ctx.version_moved(0, timeout_s=60))
    await asyncio.sleep(0)
    assert not waiting.done()
    ctx.policy_version = 0                                       # the same version wakes nobody
    await asyncio.sleep(0)
    assert not waiting.done()
    ctx.policy_version = 1
    assert await asyncio.wait_for(waiting, timeout=5)
    assert not await ctx.version_moved(1, timeout_s=0.01)       # a fresh wait after the move
