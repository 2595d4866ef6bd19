"""The Redis state layer against a real redis-server."""

from __future__ import annotations

import asyncio

import pytest

from policyloop.cluster.local import free_port
from policyloop.state import (
    Heartbeat,
    HeartbeatRegistry,
    IdempotencyKeys,
    StateUnavailable,
    VersionConflict,
    VersionRegistry,
    connect_redis,
)
from tests.conftest import Server


async def test_version_compare_and_set(redis_client) -> None:  # type: ignore[no-untyped-def]
    versions = VersionRegistry(redis_client, "ns")
    assert await versions.get("policy") == 0
    assert await versions.compare_and_set("policy", 0, 1) == 1
    assert await versions.compare_and_set("policy", 1, 2) == 2
    with pytest.raises(VersionConflict, match="is 2, not the expected 1") as conflict:
        await versions.compare_and_set("policy", 1, 2)
    assert conflict.value.actual == 2
    with pytest.raises(ValueError, match="greater"):
        await versions.compare_and_set("policy", 2, 2)
    assert await versions.get("policy") == 2
    assert (await versions.all())["policy"][0] == 2
    # Namespaces do not see each other.
    assert await VersionRegistry(redis_client, "other").get("policy") == 0


async def test_only_one_of_racing_writers_wins(redis_client) -> None:  # type: ignore[no-untyped-def]
    versions = VersionRegistry(redis_client, "ns")

    async def attempt() -> bool:
        try:
            await versions.compare_and_set("m", 0, 1)
            return True
        except VersionConflict:
            return False

    results = await asyncio.gather(*(attempt() for _ in range(20)))
    assert results.count(True) == 1
    assert await versions.get("m") == 1


async def test_heartbeats_expire_with_their_ttl(redis_client) -> None:  # type: ignore[no-untyped-def]
    registry = HeartbeatRegistry(redis_client, "ns")
    await registry.beat(Heartbeat("rollout", "r-0", True, policy_version=3), ttl_s=0.5)
    await registry.beat(Heartbeat("reward", "w-0", False), ttl_s=30)
    alive = await registry.alive()
    assert [(b.service, b.instance, b.healthy, b.policy_version) for b in alive] == [
        ("reward", "w-0", False, 0), ("rollout", "r-0", True, 3),
    ]
    assert alive[1].beat_unix_ms > 0
    assert [b.instance for b in await registry.alive("rollout")] == ["r-0"]
    await asyncio.sleep(0.8)
    assert [b.instance for b in await registry.alive()] == ["w-0"]
    await registry.remove("reward", "w-0")
    assert await registry.alive() == []


async def test_idempotency_keys_claim_once_and_lease(redis_client) -> None:  # type: ignore[no-untyped-def]
    keys = IdempotencyKeys(redis_client, "ns")
    assert await keys.claim("job-1", ttl_s=30, owner="a")
    assert not await keys.claim("job-1", ttl_s=30, owner="b")
    assert await keys.owner("job-1") == "a"
    assert not await keys.extend("job-1", 30, owner="b")
    assert await keys.extend("job-1", 30, owner="a")
    assert not await keys.release("job-1", owner="b")
    assert await keys.release("job-1", owner="a")
    assert await keys.claim("job-1", ttl_s=0.3, owner="b")
    await asyncio.sleep(0.5)
    assert await keys.claim("job-1", ttl_s=30, owner="c")  # the lapsed claim is free again


async def test_connect_fails_clearly_within_its_deadline() -> None:
    port = free_port()
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    with pytest.raises(StateUnavailable, match=f"no Redis at redis://127.0.0.1:{port}"):
        await connect_redis(f"redis://127.0.0.1:{port}/0", connect_timeout_s=1.0)
    assert loop.time() - t0 < 5


async def test_client_survives_a_redis_restart(redis_server: Server) -> None:
    client = await connect_redis(redis_server.url)
    try:
        versions = VersionRegistry(client, "ns")
        await versions.compare_and_set("m", 0, 1)
        redis_server.restart()  # append-only file: the version survives
        assert await versions.get("m") == 1
    finally:
        await client.aclose()
