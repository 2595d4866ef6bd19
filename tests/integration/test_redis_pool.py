"""Every Redis client the project makes (connect_redis) holds a bounded pool whose commands wait
for a free connection: a burst beyond it queues instead of failing (redis-py's own pool raised
MaxConnectionsError past 100, and 150 Tinker samples at once answered 107 HTTP 500s)."""

from __future__ import annotations

import asyncio

from policyloop.runtime.settings import ServiceSettings
from policyloop.state import RedisPool, connect_redis
from tests.conftest import Server
from tests.helpers import eventually


async def test_a_burst_beyond_the_pool_waits_for_connections_instead_of_failing(redis_server: Server) -> None:
    pool = RedisPool()
    burst = max(3 * pool.max_connections, 150)  # beyond the pool, and beyond redis-py's default of 100
    client, observer = await connect_redis(redis_server.url), await connect_redis(redis_server.url)
    try:
        counts = await asyncio.gather(*(client.incr("pl:test:burst") for _ in range(burst)))
        assert sorted(counts) == list(range(1, burst + 1))
        clients = await observer.info("clients")
        assert clients["connected_clients"] <= pool.max_connections + 1  # + the observer
    finally:
        await asyncio.gather(client.aclose(), observer.aclose())


async def test_commands_hold_no_more_connections_than_the_pool_and_the_rest_wait(redis_server: Server) -> None:
    """Twelve blocking pops through a pool of four: four wait in Redis, the others for a
    connection; each gets its item once the list is filled."""
    client = await connect_redis(redis_server.url, pool=RedisPool(max_connections=4, wait_timeout_s=60))
    observer = await connect_redis(redis_server.url)
    try:
        pops = [asyncio.create_task(client.blpop(["pl:test:queue"], timeout=0)) for _ in range(12)]

        async def four_blocked() -> bool:
            return (await observer.info("clients"))["blocked_clients"] == 4

        await eventually(four_blocked, what="four pops blocked in Redis")
        assert (await observer.info("clients"))["connected_clients"] == 4 + 1
        await observer.rpush("pl:test:queue", *range(12))
        popped = await asyncio.gather(*pops)
        assert sorted(int(value) for _, value in popped) == list(range(12))
    finally:
        await asyncio.gather(client.aclose(), observer.aclose())


def test_the_pool_is_a_setting_of_every_service(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("POLICYLOOP_REDIS_POOL__MAX_CONNECTIONS", "7")
    assert ServiceSettings().redis_pool == RedisPool(max_connections=7)
