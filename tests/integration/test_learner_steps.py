"""The learner's step order, with the Learner class itself against real NATS, Redis and an
in-process publisher on loopback gRPC (no service processes): a step is in LEDGER before its
version can be seen, and its trajectories are acked only after the publisher stored it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from policyloop.bus import Bus, trajectories_subject
from policyloop.learner.colocated import ColocatedEngines
from policyloop.learner.learner import Learner
from policyloop.learner.settings import CheckpointSettings, LearnerSettings
from policyloop.learner.tracking import BackgroundTracker, Tracker
from policyloop.ledger import trained_steps
from policyloop.rl.recovery import Resumed
from policyloop.state import VersionRegistry
from policyloop.state.progress import RunProgressStore
from policyloop.weights.client import WeightClient
from policyloop.weights.library import WeightLibrary
from policyloop.weights.push import VersionPusher
from policyloop.weights.server import WeightServicer, start_weight_server
from policyloop.weights.store import VersionStore
from tests.helpers import eventually, publish_group, scored_group


class HeldPushes(WeightServicer):
    """A publisher whose Push waits until the test lets it through."""

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self.entered = asyncio.Event()
        self.let_through = asyncio.Event()

    async def Push(self, request_iterator, context):  # type: ignore[no-untyped-def]
        self.entered.set()
        await self.let_through.wait()
        return await super().Push(request_iterator, context)


async def _announce(_: object) -> None:
    pass


@asynccontextmanager
async def running_learner(bus: Bus, redis_client, model_dir: Path, root: Path,  # type: ignore[no-untyped-def]
                          servicer: type[WeightServicer], tracker: Tracker | None = None,
                          overlap_publication: bool = True) -> AsyncIterator[tuple[Learner, WeightServicer]]:
    from policyloop.rl.trainer import PolicyTrainer

    library = WeightLibrary(VersionStore(root / "store", retention=4), snapshot_every=2)
    publisher = servicer(library, on_stored=_announce)
    server, port = await start_weight_server(publisher, host="127.0.0.1", port=0)
    settings = LearnerSettings(model_path=model_dir, groups_per_step=1, max_lag=-1, device="cpu",
                               publisher_endpoint=f"127.0.0.1:{port}",
                               checkpoint=CheckpointSettings(dir=root / "checkpoints", every=0),
                               overlap_publication=overlap_publication)
    trainer = await asyncio.to_thread(PolicyTrainer, model_dir, settings.trainer_config(), 0)
    client = WeightClient(settings.publisher_endpoint, deadline_s=60)
    learner = Learner(settings, trainer, bus, versions=VersionRegistry(redis_client, "default"),
                      pusher=VersionPusher(client, settings.model), colocated=ColocatedEngines(settings.colocated),
                      progress=RunProgressStore(redis_client, "default"),
                      resumed=Resumed(checkpoint=None, checkpoint_version=0), tracker=tracker)
    stop = asyncio.Event()
    worker = learner.pull_worker()
    tasks = [asyncio.create_task(worker.run(stop)), asyncio.create_task(learner.run(stop))]
    try:
        yield learner, publisher
    finally:
        stop.set()
        if isinstance(publisher, HeldPushes):
            publisher.let_through.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        await worker.drain(5)
        await client.close()
        await server.stop(None)
        await library.drain()
        trainer.close()


async def publish_scored(bus: Bus, task: str) -> None:
    await publish_group(bus, trajectories_subject("e"), *scored_group(task))


@pytest.mark.timeout(180)
@pytest.mark.parametrize("overlap", [True, False], ids=["overlapped", "in-step"])
async def test_a_step_is_recorded_before_its_version_is_published_and_acked_after(
        bus: Bus, redis_client, tiny_model_dir: Path, tmp_path: Path, overlap: bool) -> None:  # type: ignore[no-untyped-def]
    versions = VersionRegistry(redis_client, "default")
    async with running_learner(bus, redis_client, tiny_model_dir, tmp_path, HeldPushes,
                               overlap_publication=overlap) as (learner, publisher):
        await publish_scored(bus, "a")
        assert isinstance(publisher, HeldPushes)
        await asyncio.wait_for(publisher.entered.wait(), 120)  # trained, now pushing: held there

        [record] = await trained_steps(bus, "policy")
        assert record.version == 1 and record.trajectory_ids == ("a/0", "a/1")  # write-ahead
        assert await versions.get("policy") == 0            # not advanced before the push
        assert (await bus.backlog("learner")).ack_pending == 1  # the group's message: held, not acked
        # Overlapped, the step counts once recorded; its version only once pushed.
        assert learner.status.trained_samples == (2 if overlap else 0)
        assert learner.status.weights.versions_pushed == 0

        publisher.let_through.set()

        async def published() -> bool:
            return await versions.get("policy") == 1 and (await bus.backlog("learner")).ack_pending == 0

        await eventually(published, timeout_s=60)
        assert learner.status.step == 1 and learner.status.trained_samples == 2
        assert dict(learner.status.lag_histogram) == {0: 2}
        assert learner.status.weights.versions_pushed == 1 and learner.status.weights.keyframes == 1
        stored = await asyncio.to_thread(publisher.library.store.get, "policy", 1)
        assert stored.manifest_hash == record.manifest_hash


@pytest.mark.timeout(180)
async def test_the_next_step_trains_while_a_version_publishes_and_is_recorded_only_after(
        bus: Bus, redis_client, tiny_model_dir: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    versions = VersionRegistry(redis_client, "default")
    async with running_learner(bus, redis_client, tiny_model_dir, tmp_path, HeldPushes) as (learner, publisher):
        assert isinstance(publisher, HeldPushes)
        await publish_scored(bus, "a")
        await asyncio.wait_for(publisher.entered.wait(), 120)  # version 1's push: held there
        await publish_scored(bus, "b")

        async def second_step_trained() -> bool:
            return learner.trainer.steps == 2

        await eventually(second_step_trained, timeout_s=120)
        # Step 2 is computed but not recorded while version 1 is unpublished: at most one recorded
        # version is ever unpublished, so a resume re-pushes no more than one.
        assert [r.version for r in await trained_steps(bus, "policy")] == [1]
        assert await versions.get("policy") == 0 and (await bus.backlog("learner")).ack_pending == 2

        publisher.let_through.set()

        async def both_published() -> bool:
            return await versions.get("policy") == 2 and (await bus.backlog("learner")).ack_pending == 0

        await eventually(both_published, timeout_s=60)
        assert [r.version for r in await trained_steps(bus, "policy")] == [1, 2]
        assert learner.status.weights.versions_pushed == 2


@pytest.mark.timeout(180)
async def test_a_copy_of_a_trained_sample_is_acked_without_training(
        bus: Bus, redis_client, tiny_model_dir: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    versions = VersionRegistry(redis_client, "default")
    async with running_learner(bus, redis_client, tiny_model_dir, tmp_path, WeightServicer) as (learner, _):
        await publish_scored(bus, "a")

        async def trained() -> bool:
            return await versions.get("policy") == 1 and (await bus.backlog("learner")).ack_pending == 0

        await eventually(trained, timeout_s=120)
        [first] = scored_group("a")[:1]
        await publish_group(bus, trajectories_subject("e"), first, msg_id="a/0-again")

        async def dropped() -> bool:
            backlog = await bus.backlog("learner")
            return learner.status.dropped.duplicate == 1 and backlog.pending == 0 and backlog.ack_pending == 0

        await eventually(dropped, timeout_s=30)
        assert learner.status.step == 1 and await versions.get("policy") == 1


class FailingTracker:
    """A tracker backend whose every step fails (a full disk, a server gone)."""

    def __init__(self) -> None:
        self.steps: list[int] = []

    def log_config(self, config: object) -> None:
        pass

    def log_step(self, step: int, stats: object) -> None:
        self.steps.append(step)
        raise OSError(28, "No space left on device")

    def log_evaluation(self, step: int, results: object) -> None:
        pass

    def close(self) -> None:
        pass


@pytest.mark.timeout(180)
async def test_a_tracker_that_fails_does_not_stop_the_steps(
        bus: Bus, redis_client, tiny_model_dir: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """The learner hands each step's statistics to its tracker; the tracker's first failure turns
    it off, and the learner goes on stepping and publishing."""
    versions = VersionRegistry(redis_client, "default")
    backend = FailingTracker()
    tracker = BackgroundTracker(backend, "failing")
    async with running_learner(bus, redis_client, tiny_model_dir, tmp_path, WeightServicer, tracker) as (learner, _):
        for task, version in (("a", 1), ("b", 2)):
            await publish_scored(bus, task)

            async def stepped(version: int = version) -> bool:
                return await versions.get("policy") == version and (await bus.backlog("learner")).ack_pending == 0

            await eventually(stepped, timeout_s=120)
        assert learner.status.step == 2 and learner.status.trained_samples == 4
    tracker.close()
    assert backend.steps == [1] and tracker.failed is not None and "No space left" in tracker.failed
