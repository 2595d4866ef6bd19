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
from policyloop.state.store import SCAN_BATCH
from tests.conftest import Server
from tests.helpers import eventually, until


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


async def test_version_advances_forward_only(redis_client) -> None:  # type: ignore[no-untyped-def]
    versions = VersionRegistry(redis_client, "ns")
    assert await versions.advance("policy", 3) == 0  # from nothing (a Redis that lost its data)
    assert await versions.advance("policy", 5) == 3
    with pytest.raises(VersionConflict) as conflict:
        await versions.advance("policy", 5)
    assert conflict.value.actual == 5
    with pytest.raises(VersionConflict):
        await versions.advance("policy", 4)
    assert await versions.get("policy") == 5


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
    await registry.beat(Heartbeat(service="rollout", instance="r-0", healthy=True, policy_version=3), ttl_s=30)
    await registry.beat(Heartbeat(service="reward", instance="w-0", healthy=False), ttl_s=30)
    alive = await registry.alive()
    assert [(b.service, b.instance, b.healthy, b.policy_version) for b in alive] == [
        ("reward", "w-0", False, 0), ("rollout", "r-0", True, 3),
    ]
    assert alive[1].beat_unix_ms > 0
    assert [b.instance for b in await registry.alive("rollout")] == ["r-0"]
    last = Heartbeat(service="rollout", instance="r-0", healthy=True, policy_version=3)
    await registry.beat(last, ttl_s=0.2)  # a last, short beat

    async def only_reward_left() -> bool:
        return [b.instance for b in await registry.alive()] == ["w-0"]

    await eventually(only_reward_left, timeout_s=10, interval_s=0.05, what="r-0's heartbeat expiring")
    await registry.remove("reward", "w-0")
    assert await registry.alive() == []


async def test_heartbeats_are_found_among_thousands_of_keys_in_a_few_scans(redis_client) -> None:  # type: ignore[no-untyped-def]
    # A busy namespace holds a pacing slot per task in flight: reading heartbeats every few
    # seconds must not take a round trip per ten keys.
    registry = HeartbeatRegistry(redis_client, "ns")
    await registry.beat(Heartbeat(service="learner", instance="l-0", healthy=True), ttl_s=30)
    async with redis_client.pipeline(transaction=False) as pipe:
        for i in range(5000):
            pipe.set(f"pl:ns:pace:policy:task:{i}", "1", ex=60)
        await pipe.execute()
    await redis_client.config_resetstat()
    assert [b.instance for b in await registry.alive("learner")] == ["l-0"]
    scans = (await redis_client.info("commandstats")).get("cmdstat_scan", {}).get("calls", 0)
    assert 1 <= scans <= 2 * (5001 // SCAN_BATCH + 1)


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

    async def lapsed() -> bool:
        return await keys.owner("job-1") is None

    await eventually(lapsed, timeout_s=10, interval_s=0.05, what="the claim lapsing")
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


async def test_run_progress_adds_up_by_run_and_environment(redis_client) -> None:  # type: ignore[no-untyped-def]
    from policyloop.contracts.v1 import bus_pb2
    from policyloop.state.progress import RunProgressStore

    def sample(run: str, env: str, reward: float, version: int, task: str) -> bus_pb2.Trajectory:
        return bus_pb2.Trajectory(run_id=run, environment=env, reward=reward, loss_mask=[True, True, False],
                                  task_id=f"{run}:{task}", trajectory_id=f"{run}:{task}/{version}",
                                  version_spans=[bus_pb2.VersionSpan(version=version, start=0, end=3)])

    store = RunProgressStore(redis_client, "ns")
    first = [sample("a", "add@v1", 1.0, 0, "1"), sample("a", "code@v1", 0.0, 0, "2"),
             sample("b", "add@v1", 0.5, 0, "1")]
    await store.record_step(1, 0, first)
    await store.record_step(2, 1, [sample("a", "add@v1", 0.0, 0, "3"), sample("a", "add@v1", 0.5, 1, "3")])
    await store.record_step(1, 0, first)  # a step replayed after a restart: counted when first taken
    await store.record_dropped([sample("a", "add@v1", 0.0, 0, "4")], "stale")
    await store.record_dropped([sample("a", "add@v1", 0.0, 0, "3")], "stale")  # a copy of a trained task
    await store.record_generated("a", 40)
    a = await store.get("a")
    assert a.learner_step == 2 and a.trained_samples == 4 and a.dropped_samples == 1 and a.trained_tokens == 8
    assert (a.tasks_trained, a.tasks_dropped, dict(a.tasks_dropped_by_reason)) == (3, 1, {"stale": 1})
    assert a.environments["add@v1"].trained_samples == 3
    assert a.environments["add@v1"].mean_reward == pytest.approx(0.5)
    assert a.environments["add@v1"].last_step_reward == pytest.approx(0.25)
    assert a.environments["code@v1"].mean_reward == 0.0 and dict(a.lag_histogram) == {0: 3, 1: 1}
    assert a.generated_tokens == 40
    b = await store.get("b")
    assert b.trained_samples == 1 and set(b.environments) == {"add@v1"} and b.learner_step == 1
    assert (await store.get("nothing")).trained_samples == 0


async def test_a_run_finishes_when_its_last_task_is_accounted_for(redis_client) -> None:  # type: ignore[no-untyped-def]
    """Each task counts once, by its first outcome; the record that accounts for the last of a
    running run's tasks makes it FINISHED, and a stopped run stays stopped."""
    from policyloop.contracts.ids import task_id
    from policyloop.contracts.v1 import loop_pb2
    from policyloop.state.catalog import RunRegistry
    from policyloop.state.outcomes import DEAD_LETTERED, TRAINED, TaskCount, TaskOutcomes, dropped

    runs, outcomes = RunRegistry(redis_client, "ns"), TaskOutcomes(redis_client, "ns")
    await runs.create("r", loop_pb2.StartRunRequest(run_id="r"), tasks_total=3)
    tasks = [TaskCount(task_id("r", i), 4) for i in range(3)]
    assert await outcomes.record("r", TRAINED, tasks[:1]) == [tasks[0].task_id]
    assert await outcomes.record("r", DEAD_LETTERED, tasks[:2]) == [tasks[1].task_id]  # the first outcome stands
    standing = await outcomes.standing("r")
    assert (standing.state, standing.tasks_total, standing.accounted) == (loop_pb2.RUN_STATE_RUNNING, 3, 2)
    assert standing.all_held(1) and not standing.all_held(0) and not standing.ended
    assert await runs.state("r") == loop_pb2.RUN_STATE_RUNNING
    await outcomes.record("r", dropped("stale"), tasks[2:])
    assert await runs.state("r") == loop_pb2.RUN_STATE_FINISHED

    # A learner that resumed accounts again for the steps it knows by their samples' ids: once.
    from policyloop.state.progress import RunProgressStore

    await runs.create("q", loop_pb2.StartRunRequest(run_id="q"), tasks_total=2)
    progress = RunProgressStore(redis_client, "ns")
    ids = [f"{task_id('q', i)}/{j}" for i in range(2) for j in range(3)] + ["by-hand/0"]
    for _ in range(2):
        await progress.record_trained_ids(ids)
    q = await progress.get("q")
    assert (q.tasks_trained, q.trained_samples) == (2, 6) and await runs.state("q") == loop_pb2.RUN_STATE_FINISHED

    # Many tasks at once go in several script calls (Redis serves no one else during one): all count.
    await runs.create("big", loop_pb2.StartRunRequest(run_id="big"), tasks_total=2500)
    many = [TaskCount(task_id("big", i), 1) for i in range(2500)]
    assert len(await outcomes.record("big", TRAINED, many)) == 2500
    assert (await progress.get("big")).tasks_trained == 2500 and await runs.state("big") == loop_pb2.RUN_STATE_FINISHED

    # A stopped run's last held groups are those of the tasks it fed and has not accounted for.
    await runs.create("s", loop_pb2.StartRunRequest(run_id="s"), tasks_total=3)
    await runs.set_enqueued("s", 2)
    await runs.set_state("s", loop_pb2.RUN_STATE_STOPPED)
    await outcomes.record("s", dropped("run_stopped"), [TaskCount(task_id("s", 0), 0)])
    stopped = await outcomes.standing("s")
    assert await runs.state("s") == loop_pb2.RUN_STATE_STOPPED and stopped.ended
    assert stopped.all_held(1) and not stopped.all_held(0)


async def test_run_quota_leases(redis_client) -> None:  # type: ignore[no-untyped-def]
    from policyloop.state.quota import RunQuota

    quota = RunQuota(redis_client, "ns", limit=2)
    assert await quota.acquire("r", "a", lease_s=30) and await quota.acquire("r", "b", lease_s=30)
    assert not await quota.acquire("r", "c", lease_s=30)
    assert await quota.acquire("s", "c", lease_s=30)  # another run has its own slots
    assert await quota.acquire("r", "a", lease_s=30)  # a holder renews its own lease
    await quota.release("r", "a")
    assert await quota.acquire("r", "c", lease_s=0.2) and await quota.holders("r") == 2
    await asyncio.sleep(0.3)  # c's lease lapsed (its replica died): the slot comes back
    assert await quota.holders("r") == 1 and await quota.acquire("r", "d", lease_s=30)
    with pytest.raises(ValueError):
        RunQuota(redis_client, "ns", limit=0)


async def test_running_slots_are_not_held_by_a_job_waiting_for_its_runs_quota(redis_client) -> None:  # type: ignore[no-untyped-def]
    from policyloop.state.quota import RunningSlots, RunQuota

    slots = RunningSlots(2, RunQuota(redis_client, "ns", limit=1), poll_s=0.01)
    entered: list[str] = []
    release_r1 = asyncio.Event()

    async def job(run_id: str, name: str, hold: asyncio.Event | None = None) -> None:
        async with slots.slot(run_id, name, lease_s=30):
            entered.append(name)
            if hold is not None:
                await hold.wait()

    r1 = asyncio.create_task(job("r", "r1", release_r1))
    await until(lambda: entered == ["r1"])
    r2 = asyncio.create_task(job("r", "r2"))  # run r is at its quota: r2 waits...
    await until(lambda: slots.held == 1)
    # ...without the replica's second running slot, which a job of another run takes while r1 runs.
    await asyncio.wait_for(job("s", "s1"), timeout=5)
    assert entered == ["r1", "s1"] and not r2.done()
    release_r1.set()
    await asyncio.wait_for(asyncio.gather(r1, r2), timeout=5)
    assert entered == ["r1", "s1", "r2"] and not slots.free.locked()


async def test_a_running_slot_comes_back_when_the_quota_cannot_be_asked(redis_server: Server) -> None:
    from policyloop.state.quota import RunningSlots, RunQuota

    client = await connect_redis(redis_server.url)
    slots = RunningSlots(1, RunQuota(client, "ns", limit=1), poll_s=0.01)
    redis_server.stop()
    try:
        with pytest.raises(Exception):  # noqa: B017 - whatever Redis raises, the slot comes back
            async with slots.slot("r", "a", lease_s=30):
                pass
        assert not slots.free.locked()
    finally:
        await client.aclose()
