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


async def test_a_lora_runs_tasks_go_to_the_replicas_of_lora_runs_and_a_full_model_runs_to_the_others(
        bus: Bus, redis_server, redis_client) -> None:  # type: ignore[no-untyped-def]
    """Replicas of LoRA runs keep the base as loaded and the others follow the full model: each
    kind takes only its own runs' tasks, through a consumer of its own on TASKS."""
    from policyloop.bus import PullWorker

    raw = await connect_redis(redis_server.url, decode_responses=False)
    envs, runs = EnvironmentCatalog(raw, "k"), RunRegistry(raw, "k")
    await envs.put("addition@v1", addition_environment(20))
    mix = [loop_pb2.EnvironmentMix(environment="addition@v1", weight=1)]
    await runs.create("full", loop_pb2.StartRunRequest(run_id="full", num_tasks=3, environments=mix), 3)
    await runs.create("adapter", loop_pb2.StartRunRequest(run_id="adapter", num_tasks=2, environments=mix,
                                                          lora=loop_pb2.LoraSpec(rank=4)), 2)
    feeder = RunFeeder(bus, envs, runs, IdempotencyKeys(redis_client, "k"), owner="gateway-k", lease_s=10,
                       backpressure_wait_s=0.05, stop=asyncio.Event(), wake=asyncio.Event())
    await feeder.feed("full")
    await feeder.feed("adapter")
    taken: dict[str, list[str]] = {"rollout": [], "rollout-lora": []}
    stop = asyncio.Event()

    def worker(durable: str) -> PullWorker[bus_pb2.Task]:
        async def take(delivery) -> None:  # type: ignore[no-untyped-def]
            taken[durable].append(delivery.message.run_id)
            if sum(map(len, taken.values())) == 5:
                stop.set()

        return PullWorker(bus, bus.topology.consumers[durable], bus_pb2.Task, take, service="rollout")

    await asyncio.wait_for(asyncio.gather(*(worker(d).run(stop) for d in taken)), 60)
    await raw.aclose()
    assert taken == {"rollout": ["full"] * 3, "rollout-lora": ["adapter"] * 2}
