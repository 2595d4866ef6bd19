"""Kill services with SIGKILL and check the ledger: nothing lost, nothing trained twice, the
version sequence without gap or reuse (issue 6)."""

from __future__ import annotations

import asyncio

import pytest

from policyloop.bus import Bus, tasks_subject, trajectories_subject
from policyloop.contracts.v1 import bus_pb2
from policyloop.ledger import Audit, audit_bus, record_generated, trained_steps
from policyloop.state import VersionRegistry
from tests.conftest import ServiceLauncher, ServiceProcess, fast_limits
from tests.helpers import eventually, publish_group, scored_group


async def publish_groups(bus: Bus, tasks: list[str], **shape: int) -> None:
    """What rollout and reward do for a group: record it generated, store it scored."""
    for task in tasks:
        group = scored_group(task, **shape)
        await publish_group(bus, trajectories_subject("e"), *group)
        await record_generated(bus, group, "test")


async def clean_audit(bus: Bus) -> Audit:
    report = await audit_bus(bus)
    assert report.lost == 0, report.lost_ids
    assert report.trained_twice == 0, report.twice_ids
    assert report.versions_monotonic
    return report


# Slow (a learner started twice, seven steps): the default run covers the same resume — checkpoint,
# bit-exact replay from the ledger, the next step — in
# test_a_killed_learner_replays_only_the_steps_since_its_checkpoint_cadence.
@pytest.mark.slow
async def test_learner_killed_between_steps_resumes_from_checkpoint_and_ledger(
        bus: Bus, services: ServiceLauncher, redis_client) -> None:  # type: ignore[no-untyped-def]
    """Checkpoints every 2 steps; killed at version 5, the next learner loads checkpoint 4,
    replays step 5 from the ledger (bit-exact: the manifest hash must match) and goes on at 6."""
    versions = VersionRegistry(redis_client, "default")
    publisher = services.start("publisher")
    await services.wait_healthy(publisher)
    env = _every_steps(publisher, 2)
    first = services.start("learner", env=env)
    await services.wait_healthy(first, timeout_s=60)
    for n in range(5):  # one at a time: each step trains one known group
        await publish_groups(bus, [f"g{n}"])
        await eventually(lambda n=n: _at(versions, n + 1), timeout_s=60, what=f"version {n + 1}")
    # Checkpoint 4 is written beside step 5: killed once it is in place.
    await eventually(lambda: _checkpointed(first, 4), timeout_s=60, what="checkpoint 4 written")
    first.kill()
    assert [r.version for r in await trained_steps(bus, "policy")] == [1, 2, 3, 4, 5]

    second = services.start("learner", env=env)
    await services.wait_healthy(second, timeout_s=60)
    resumed = [e for e in second.log_events() if e["event"] == "learner_resumed"]
    assert resumed and resumed[0]["checkpoint_version"] == 4 and resumed[0]["replayed"] == 1
    assert [e["version"] for e in second.log_events() if e["event"] == "step_replayed"] == [5]
    await publish_groups(bus, ["g5", "g6"])
    await eventually(lambda: _at(versions, 7), timeout_s=60, what="version 7")
    await eventually(lambda: _settled(bus), what="every trajectory acked")
    report = await clean_audit(bus)
    assert report.generated == report.trained == 14 and report.steps == 7 and report.pending == 0

    # SIGTERM checkpoints the newest version: the next learner replays nothing.
    assert second.terminate() == 0
    third = services.start("learner", env=env)
    await services.wait_healthy(third, timeout_s=60)
    [resumed] = [e for e in third.log_events() if e["event"] == "learner_resumed"]
    assert resumed["checkpoint_version"] == 7 and resumed["replayed"] == 0 and resumed["version"] == 7
    # Without resume, the learner refuses to train the base weights under version 7.
    third.kill()
    fourth = services.start("learner", env={**env, "POLICYLOOP_CHECKPOINT__RESUME": "false"})
    assert await asyncio.to_thread(fourth.proc.wait, 60) == 1


async def test_learner_dead_between_recording_a_step_and_publishing_it(
        bus: Bus, services: ServiceLauncher, redis_client) -> None:  # type: ignore[no-untyped-def]
    """The narrowest window of the write-ahead rule, hit on purpose: step 3 is in LEDGER but its
    version was never published and its trajectories never acked. The next learner replays it
    from checkpoint 2 (bit-exact), publishes version 3, recognises the redelivered samples as
    trained, and goes on at 4: no gap, no reuse, nothing trained twice."""
    versions = VersionRegistry(redis_client, "default")
    publisher = services.start("publisher")
    await services.wait_healthy(publisher)
    env = _every_steps(publisher, 2)
    first = services.start("learner", env={**env, "POLICYLOOP_CRASH_AFTER_RECORDING_STEP": "3"})
    await services.wait_healthy(first, timeout_s=60)
    for n in range(2):
        await publish_groups(bus, [f"g{n}"])
        await eventually(lambda n=n: _at(versions, n + 1), timeout_s=60, what=f"version {n + 1}")
    await eventually(lambda: _checkpointed(first, 2), timeout_s=60, what="checkpoint 2 written")
    await publish_groups(bus, ["g2"])
    assert await asyncio.to_thread(first.proc.wait, 60) == 70
    assert [r.version for r in await trained_steps(bus, "policy")] == [1, 2, 3]
    assert await versions.get("policy") == 2  # recorded, never published

    second = services.start("learner", env=env)
    await services.wait_healthy(second, timeout_s=60)
    [resumed] = [e for e in second.log_events() if e["event"] == "learner_resumed"]
    assert (resumed["checkpoint_version"], resumed["replayed"], resumed["version"]) == (2, 1, 3)
    assert await versions.get("policy") == 3
    await publish_groups(bus, ["g3"])
    await eventually(lambda: _at(versions, 4), timeout_s=60, what="version 4")
    await eventually(lambda: _settled(bus), what="every trajectory acked")
    report = await clean_audit(bus)
    assert report.generated == report.trained == 8 and report.steps == 4 and report.pending == 0


async def test_learner_killed_mid_step_trains_nothing_twice(
        bus: Bus, services: ServiceLauncher, redis_client) -> None:  # type: ignore[no-untyped-def]
    """A step big enough to take a while is interrupted by SIGKILL: whether or not it reached
    the ledger, the next learner ends at the same place with every sample trained once."""
    versions = VersionRegistry(redis_client, "default")
    publisher = services.start("publisher")
    await services.wait_healthy(publisher)
    env = {"POLICYLOOP_GROUPS_PER_STEP": "24", "POLICYLOOP_MAX_LAG": "-1", "POLICYLOOP_CHECKPOINT__EVERY": "0",
           "POLICYLOOP_PUBLISHER_ENDPOINT": f"127.0.0.1:{publisher.ports['grpc']}"}
    shape = {"size": 8, "response_len": 96}  # a step of a second or so
    first = services.start("learner", env=env)
    await services.wait_healthy(first, timeout_s=60)
    interrupted = 0
    for attempt in range(6):
        await publish_groups(bus, [f"a{attempt}g{n}" for n in range(24)], **shape)
        before = await versions.get("policy")
        await eventually(lambda: _holds(bus, 24), interval_s=0.02, what="the step's groups delivered")
        first.kill()  # the step starts once all are held; it has not published yet
        if await versions.get("policy") == before:
            interrupted += 1
            break
        # The step finished before the kill: start again and try with the next batch.
        first = services.start("learner", env=env)
        await services.wait_healthy(first, timeout_s=60)
    assert interrupted, ("no kill landed inside a step", [
        (e.get("step"), e.get("step_s")) for e in first.log_events() if e["event"] == "step"])
    second = services.start("learner", env=env)
    await services.wait_healthy(second, timeout_s=60)
    target = before + 1
    await eventually(lambda: _at(versions, target), timeout_s=90, what=f"version {target}")
    await eventually(lambda: _settled(bus), timeout_s=30, what="every trajectory acked")
    report = await clean_audit(bus)
    assert report.steps == target and report.trained == report.generated == 24 * 8 * target
    assert report.pending == 0 and report.dropped == {}


async def test_a_killed_learner_replays_only_the_steps_since_its_checkpoint_cadence(
        bus: Bus, services: ServiceLauncher, redis_client) -> None:  # type: ignore[no-untyped-def]
    """Checkpoints are written beside the steps every 3 versions, so however many steps a learner
    took, its successor replays fewer than 3 (the write of the newest due one may be under way
    when it dies: then one write's worth more). After 11 steps: checkpoint 9, replay 10 and 11,
    bit-exact, and the next step is 12; the old cadence of the default every=50 would replay 11."""
    versions = VersionRegistry(redis_client, "default")
    publisher = services.start("publisher")
    await services.wait_healthy(publisher)
    env = _every_steps(publisher, 3)
    first = services.start("learner", env=env)
    await services.wait_healthy(first, timeout_s=60)
    steps = 11
    for version in range(1, steps + 1):
        await publish_groups(bus, [f"g{version - 1}"])
        await eventually(lambda v=version: _at(versions, v), timeout_s=60, what=f"version {version}")
        if version % 3 == 0:  # each written before the next is due, so none is skipped as busy
            await eventually(lambda v=version: _checkpointed(first, v), timeout_s=60, what=f"checkpoint {version}")
    first.kill()
    assert sorted({e["version"] for e in first.log_events() if e["event"] == "checkpoint_written"}) == [3, 6, 9]

    second = services.start("learner", env=env)
    await services.wait_healthy(second, timeout_s=60)
    [resumed] = [e for e in second.log_events() if e["event"] == "learner_resumed"]
    assert (resumed["checkpoint_version"], resumed["replayed"], resumed["version"]) == (9, 2, steps)
    assert [e["version"] for e in second.log_events() if e["event"] == "step_replayed"] == [10, 11]
    await publish_groups(bus, [f"g{steps}"])
    await eventually(lambda: _at(versions, steps + 1), timeout_s=60, what=f"version {steps + 1}")
    await eventually(lambda: _settled(bus), what="every trajectory acked")
    report = await clean_audit(bus)
    assert report.steps == steps + 1 and report.generated == report.trained == 2 * (steps + 1)


async def test_a_killed_learner_with_a_critic_resumes_it_and_replays_bit_exactly(
        bus: Bus, services: ServiceLauncher, redis_client, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """PPO with a critic (advantages gae): the checkpoint written beside step 2 holds the critic
    and its optimizer; killed after step 3, the next learner restores both and replays step 3 —
    whose advantages are the critic's values, so a critic restored other than it was would give
    other weights, which the replay's manifest check refuses — and goes on at step 4."""
    import json

    versions = VersionRegistry(redis_client, "default")
    publisher = services.start("publisher")
    await services.wait_healthy(publisher)
    env = {**_every_steps(publisher, 2), "POLICYLOOP_LOSS__ADVANTAGES": "gae",
           "POLICYLOOP_CHECKPOINT__DIR": str(tmp_path / "checkpoints")}
    first = services.start("learner", env=env)
    await services.wait_healthy(first, timeout_s=60)
    for version in range(1, 4):
        await publish_groups(bus, [f"g{version - 1}"])
        await eventually(lambda v=version: _at(versions, v), timeout_s=60, what=f"version {version}")
        if version == 2:
            await eventually(lambda: _checkpointed(first, 2), timeout_s=60, what="checkpoint 2")
    first.kill()
    steps = [e for e in first.log_events() if e["event"] == "step"]
    assert len(steps) == 3 and all(e["value_loss"] > 0 for e in steps), steps
    [record] = [json.loads(p.read_text()) for p in (tmp_path / "checkpoints").rglob("trainer.json")]
    assert record["version"] == 2 and record["critic"] is True

    second = services.start("learner", env=env)
    await services.wait_healthy(second, timeout_s=60)
    [resumed] = [e for e in second.log_events() if e["event"] == "learner_resumed"]
    assert (resumed["checkpoint_version"], resumed["replayed"], resumed["version"]) == (2, 1, 3)
    await publish_groups(bus, ["g3"])
    await eventually(lambda: _at(versions, 4), timeout_s=60, what="version 4")
    await eventually(lambda: _settled(bus), what="every trajectory acked")
    report = await clean_audit(bus)
    assert report.steps == 4 and report.generated == report.trained == 8


async def test_a_restarted_learner_takes_back_what_its_killed_predecessor_held(
        bus: Bus, services: ServiceLauncher, redis_client) -> None:  # type: ignore[no-untyped-def]
    """A group held by a learner that was killed comes back to the next learner when it starts
    (it naks what its predecessor held), not after the consumer's ack wait — here ten minutes,
    far beyond what this test waits — and is trained once with a new group in one batch."""
    versions = VersionRegistry(redis_client, "default")
    publisher = services.start("publisher")
    await services.wait_healthy(publisher)
    env = {"POLICYLOOP_GROUPS_PER_STEP": "2", "POLICYLOOP_MAX_LAG": "-1",
           "POLICYLOOP_PUBLISHER_ENDPOINT": f"127.0.0.1:{publisher.ports['grpc']}"}
    limits = fast_limits(learner_ack_wait_s=600.0)
    first = services.start("learner", env=env, limits=limits)
    await services.wait_healthy(first, timeout_s=60)
    await publish_groups(bus, ["g0"])
    await eventually(lambda: _holds(bus, 1), what="the first group held")
    first.kill()  # half a batch held, unacked

    second = services.start("learner", env=env, limits=limits)
    await services.wait_healthy(second, timeout_s=60)
    [reclaimed] = [e for e in second.log_events() if e["event"] == "held_reclaimed"]
    assert reclaimed["pending"] == 1
    await publish_groups(bus, ["g1"])
    await eventually(lambda: _at(versions, 1), timeout_s=60, what="a step on the held group and the new one")
    await eventually(lambda: _settled(bus), what="every trajectory acked")
    report = await clean_audit(bus)
    assert report.steps == 1 and report.generated == report.trained == 4 and report.pending == 0


async def test_rollout_killed_mid_generation_loses_nothing(
        bus: Bus, services: ServiceLauncher) -> None:
    """A replica killed while sampling: its tasks are redelivered to another replica and every
    trajectory is generated, scored and stored once under its id."""
    first = services.start("rollout", "rollout-a", env={"POLICYLOOP_MAX_LAG": "-1", "POLICYLOOP_CONCURRENCY": "2"})
    reward = services.start("reward")
    await services.wait_healthy(first, reward, timeout_s=60)
    tasks = [f"t{n}" for n in range(12)]
    for task_id in tasks:
        await bus.publish(tasks_subject("addition@v1"), bus_pb2.Task(
            task_id=task_id, run_id="r", environment="addition@v1", prompt_text="12+34=", group_size=4,
            scorer=bus_pb2.Scorer(builtin=bus_pb2.BuiltinVerifier(kind=bus_pb2.BuiltinVerifier.KIND_EXACT_ANSWER),
                                  answer="46"),
            sampling=bus_pb2.SamplingParams(max_new_tokens=48, temperature=1.0, seed=3)), task_id)

    async def generating() -> bool:
        backlog = await bus.backlog("rollout")
        return backlog.ack_pending > 0 and backlog.pending < len(tasks) - 2

    await eventually(generating, timeout_s=60, what="tasks being sampled")
    first.kill()  # mid-generation: it holds tasks it has not finished
    second = services.start("rollout", "rollout-b", env={"POLICYLOOP_MAX_LAG": "-1"})
    await services.wait_healthy(second, timeout_s=60)

    async def all_scored() -> bool:
        report = await audit_bus(bus)
        return report.generated == report.scored == len(tasks) * 4

    await eventually(all_scored, timeout_s=90, what="every task generated and scored")
    report = await audit_bus(bus)
    assert report.lost == 0 and report.pending == report.generated  # the learner would take them all
    replicas = {t.rollout_replica async for t in _stored_trajectories(bus)}
    assert replicas == {"rollout-a", "rollout-b"} or replicas == {"rollout-b"}
    assert (await bus.js.stream_info("TRAJECTORIES")).state.messages == len(tasks)  # each group stored once


async def _stored_trajectories(bus: Bus):  # type: ignore[no-untyped-def]
    async for _, msg in bus.read("TRAJECTORIES", "pl.traj.>"):
        for traj in bus_pb2.TrajectoryGroup.FromString(msg.data).trajectories:
            yield traj


async def _at(versions: VersionRegistry, version: int) -> bool:
    return await versions.get("policy") >= version


def _every_steps(publisher: ServiceProcess, every: int) -> dict[str, str]:
    """A learner of one group per step that checkpoints every `every` versions (never by time)."""
    return {"POLICYLOOP_GROUPS_PER_STEP": "1", "POLICYLOOP_MAX_LAG": "-1",
            "POLICYLOOP_CHECKPOINT__EVERY": str(every), "POLICYLOOP_CHECKPOINT__EVERY_S": "0",
            "POLICYLOOP_PUBLISHER_ENDPOINT": f"127.0.0.1:{publisher.ports['grpc']}"}


async def _checkpointed(learner: ServiceProcess, version: int) -> bool:
    return any(e["event"] == "checkpoint_written" and e["version"] == version for e in learner.log_events())


async def _holds(bus: Bus, count: int) -> bool:
    return (await bus.backlog("learner")).ack_pending >= count


async def _settled(bus: Bus) -> bool:
    backlog = await bus.backlog("learner")
    return backlog.pending == 0 and backlog.ack_pending == 0


async def test_a_learner_refuses_a_ledger_it_cannot_replay(bus: Bus, services: ServiceLauncher) -> None:
    """A step record that is not a LedgerEvent, or whose replay gives other weights than it
    records, stops the learner with the reason instead of training on (or reusing a version)."""
    from policyloop.bus import ledger_subject
    from policyloop.bus.connection import MSG_ID_HEADER
    from policyloop.ledger import TRAINED, StepRecord, record_trained

    subject = ledger_subject(TRAINED, "policy")
    await bus.publish_bytes(subject, b"\xff\x00 not a ledger event", {MSG_ID_HEADER: "garbage"})
    learner = services.start("learner")
    assert await asyncio.to_thread(learner.proc.wait, 60) == 1
    [failure] = [e for e in learner.log_events() if e["event"] == "service_failed"]
    assert "LEDGER message 1 on pl.ledger.trained.policy is not a LedgerEvent" in failure["error"]

    await bus.js.purge_stream("LEDGER")
    group = scored_group("g")
    sequence = await publish_group(bus, trajectories_subject("e"), *group)
    await record_trained(bus, "policy", "r", "test", StepRecord(
        step=1, version=1, manifest_hash="0" * 32, trajectory_ids=tuple(t.trajectory_id for t in group),
        stream_sequences=(sequence,) * len(group)))
    replaying = services.start("learner")
    assert await asyncio.to_thread(replaying.proc.wait, 60) == 1
    [failure] = [e for e in replaying.log_events() if e["event"] == "service_failed"]
    assert "not the recorded " + "0" * 32 in failure["error"] and "not deterministic" in failure["error"]


async def test_a_version_number_is_recorded_for_one_step_only(bus: Bus) -> None:
    """Recording a step again (a retry, a replay) is fine; another step under a used version
    number is refused, though JetStream would silently keep the first within its duplicate window."""
    from policyloop.ledger import StepRecord, VersionReused, record_trained, trained_steps

    step = StepRecord(step=1, version=1, manifest_hash="a" * 32, trajectory_ids=("g/0",), stream_sequences=(1,))
    first = await record_trained(bus, "policy", "r", "test", step)
    assert await record_trained(bus, "policy", "r", "test", step) == first
    with pytest.raises(VersionReused, match="version 1 is already recorded"):
        await record_trained(bus, "policy", "r", "test", StepRecord(
            step=1, version=1, manifest_hash="b" * 32, trajectory_ids=("h/0",), stream_sequences=(2,)))
    assert [s.manifest_hash for s in await trained_steps(bus, "policy")] == ["a" * 32]
