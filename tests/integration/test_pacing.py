"""Pacing through Redis: groups are admitted only within the lag bound."""

from __future__ import annotations

import asyncio

from policyloop.state.pacing import Pacer


async def test_admission_follows_the_learner_version(redis_client) -> None:  # type: ignore[no-untyped-def]
    pacer = Pacer(redis_client, "ns", "policy", groups_per_step=4, max_lag=1)
    # At version 0 with max_lag 1: groups for versions 0 and 1 -> 8 slots.
    admitted = [await pacer.try_admit(f"t{i}", served_version=0) for i in range(10)]
    assert admitted == [True] * 8 + [False] * 2
    assert await pacer.try_admit("t3", served_version=0)  # a redelivered task keeps its slot
    assert await pacer.started() == 8
    # Group k trains on version k // 4: a replica serving version 1 may start groups up to 11.
    assert [await pacer.try_admit(f"t{i}", served_version=1) for i in range(8, 14)] == [True] * 4 + [False] * 2


async def test_concurrent_replicas_never_exceed_the_bound(redis_client) -> None:  # type: ignore[no-untyped-def]
    replicas = [Pacer(redis_client, "ns", "policy", groups_per_step=8, max_lag=0) for _ in range(4)]
    results = await asyncio.gather(*(replicas[i % 4].try_admit(f"task-{i}", 0) for i in range(40)))
    assert sum(results) == 8
