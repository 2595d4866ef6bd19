"""The gateway's feeder against real NATS and Redis: a run's tasks go to TASKS with a few Redis
round trips per check interval, not three per task."""

from __future__ import annotations

import asyncio
import time

from policyloop.bus import Bus
from policyloop.contracts.v1 import bus_pb2, loop_pb2
from policyloop.gateway.feeder import RunFeeder
from policyloop.state import IdempotencyKeys, connect_redis
from policyloop.state.catalog import EnvironmentCatalog, RunRegistry
from tests.helpers import addition_environment, stored


async def test_a_run_is_fed_whole_with_its_lease_and_count_written_per_interval_not_per_task(
        bus: Bus, redis_server, redis_client) -> None:  # type: ignore[no-untyped-def]
    raw = await connect_redis(redis_server.url, decode_responses=False)
    envs, runs = EnvironmentCatalog(raw, "t"), RunRegistry(raw, "t")
    env = addition_environment(20)
    await envs.put("addition@v1", env)
    await runs.create("r", loop_pb2.StartRunRequest(run_id="r", num_tasks=400, environments=[
        loop_pb2.EnvironmentMix(environment="addition@v1", weight=1)]), 400)
    feeder = RunFeeder(bus, envs, runs, IdempotencyKeys(redis_client, "t"), owner="gateway-t", lease_s=10,
                       backpressure_wait_s=0.05, stop=asyncio.Event(), wake=asyncio.Event())
    await redis_client.config_resetstat()
    started = time.monotonic()
    await feeder.feed("r")
    elapsed = time.monotonic() - started
    stats = await redis_client.info("commandstats")
    tasks = await stored(bus, "TASKS", bus_pb2.Task)
    assert len({t.task_id for t in tasks}) == len(tasks) == 400
    assert (await runs.get("r")).tasks_enqueued == 400  # type: ignore[union-attr]
    # One write of the count per check interval, and one at the end: however long the feed took.
    writes = stats.get("cmdstat_hset", {}).get("calls", 0)
    assert 1 <= writes <= elapsed / feeder.check_every_s + 2, (writes, elapsed)
    assert stats.get("cmdstat_hgetall", {}).get("calls", 0) <= elapsed / feeder.check_every_s + 3
    await raw.aclose()
