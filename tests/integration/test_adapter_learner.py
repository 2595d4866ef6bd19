"""Many LoRA runs on one learner (learner.adapters.AdapterLearner) against real NATS, Redis and an
in-process publisher on loopback gRPC: each run steps when it holds its own full batch, its
versions are recorded, pushed (adapter tensors only) and registered under its own name, a run
that is short of a batch holds up no other, a run added while others train steps too, and a
removed run's samples are recorded as dropped before they are acked."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import torch

from policyloop.bus import Bus
from policyloop.contracts.ids import task_id
from policyloop.contracts.v1 import bus_pb2, loop_pb2
from policyloop.learner.adapters import RUN_STOPPED, AdapterLearner
from policyloop.learner.tracking import RunTrackerOpener
from policyloop.ledger import DROPPED, trained_steps
from policyloop.rl.lora import AdapterTrainer, LoraSpec
from policyloop.rl.trainer import TrainerConfig
from policyloop.state import VersionRegistry
from policyloop.state.catalog import RunRegistry
from policyloop.state.progress import RunProgressStore
from policyloop.weights.client import WeightClient
from policyloop.weights.library import WeightLibrary
from policyloop.weights.server import WeightServicer, start_weight_server
from policyloop.weights.store import VersionStore
from tests.helpers import eventually, publish_run_group, stored

SPEC = LoraSpec(rank=4, target_modules=("q_proj", "v_proj"))


async def _announce(_: object) -> None:
    pass


@asynccontextmanager
async def running(bus: Bus, redis_client, model_dir: Path, root: Path,  # type: ignore[no-untyped-def]
                  checkpoint_every: int = 0, progress: RunProgressStore | None = None,
                  open_tracker: RunTrackerOpener | None = None) -> AsyncIterator[tuple[AdapterLearner, WeightServicer]]:
    publisher = WeightServicer(WeightLibrary(VersionStore(root / "store", retention=4), snapshot_every=4),
                               on_stored=_announce)
    server, port = await start_weight_server(publisher, host="127.0.0.1", port=0)
    client = WeightClient(f"127.0.0.1:{port}", deadline_s=60)
    trainer = await asyncio.to_thread(AdapterTrainer, model_dir, TrainerConfig(lr=1e-3, device="cpu"))
    learner = AdapterLearner("policy", "learner-0", trainer, bus, versions=VersionRegistry(redis_client, "default"),
                             publisher=client, checkpoint_root=root / "checkpoints", checkpoint_every=checkpoint_every,
                             progress=progress or RunProgressStore(redis_client, "default"), leftovers_check_s=0.2,
                             open_tracker=open_tracker)
    from policyloop.bus import PullWorker
    from policyloop.contracts.validate import validate_group

    consumer = bus.topology.consumers["learner"]
    worker = PullWorker(bus, consumer, bus_pb2.TrajectoryGroup, learner.admit, service="learner",
                        validator=validate_group, concurrency=consumer.max_ack_pending)
    stop = asyncio.Event()
    tasks = [asyncio.create_task(worker.run(stop)), asyncio.create_task(learner.run(stop))]
    try:
        yield learner, publisher
    finally:
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        await worker.drain(5)
        await client.close()
        await server.stop(None)



@pytest.mark.timeout(240)
async def test_runs_step_on_their_own_batches_and_never_hold_each_other_up(
        bus: Bus, redis_client, tiny_model_dir: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    versions = VersionRegistry(redis_client, "default")
    async with running(bus, redis_client, tiny_model_dir, tmp_path) as (learner, publisher):
        a = await learner.add_run("a", SPEC, groups_per_step=1, max_lag=-1)
        b = await learner.add_run("b", LoraSpec(rank=8), groups_per_step=2, max_lag=-1)
        assert a.model != b.model and a.model.startswith("policy.lora.a-")

        await publish_run_group(bus, "b", "b1")  # half of b's batch
        for i in range(3):
            await publish_run_group(bus, "a", f"a{i}")
        await eventually(lambda: _at(versions, a.model, 3), timeout_s=120)  # a never waited for b
        assert await versions.get(b.model) == 0 and learner.trainer.run("b").version == 0
        assert (await bus.backlog("learner")).ack_pending == 1  # b's group: held, unacked

        await publish_run_group(bus, "b", "b2")
        await eventually(lambda: _at(versions, b.model, 1), timeout_s=120)
        [record] = await trained_steps(bus, b.model)
        assert sorted(record.trajectory_ids) == ["b1/0", "b1/1", "b2/0", "b2/1"] and record.version == 1
        assert [r.version for r in await trained_steps(bus, a.model)] == [1, 2, 3]
        store = publisher.library.store
        assert (await asyncio.to_thread(store.get, a.model, 3)).manifest_hash == \
            (await trained_steps(bus, a.model))[-1].manifest_hash
        assert (await asyncio.to_thread(store.get, b.model, 1)).manifest_hash == record.manifest_hash

        # A third run joins while the others train (its first group came before it did: handed back
        # to the bus until then); b is removed with a group it holds.
        await publish_run_group(bus, "c", "c-early")
        await eventually(lambda: _redelivered(bus), timeout_s=60)
        c = await learner.add_run("c", SPEC, groups_per_step=1, max_lag=-1)
        await publish_run_group(bus, "b", "b3")
        await eventually(lambda: _held(learner, "b", 2), timeout_s=60)
        await publish_run_group(bus, "c", "c0")
        await publish_run_group(bus, "a", "a3")
        await eventually(lambda: _at(versions, c.model, 2), timeout_s=120)
        await eventually(lambda: _at(versions, a.model, 4), timeout_s=120)
        await learner.remove_run("b")
        await publish_run_group(bus, "b", "b4")  # arrives after the stop: dropped, not retried

        async def all_acked() -> bool:
            return (await bus.backlog("learner")).ack_pending == 0 and (await bus.backlog("learner")).pending == 0

        await eventually(all_acked, timeout_s=60)
        dropped = [e for e in await stored(bus, "LEDGER", bus_pb2.LedgerEvent) if e.kind == DROPPED]
        assert {(e.run_id, e.reason, tuple(sorted(e.trajectory_ids))) for e in dropped} == {
            ("b", RUN_STOPPED, ("b3/0", "b3/1")), ("b", RUN_STOPPED, ("b4/0", "b4/1"))}  # a group per event
        assert {e.model for e in dropped} == {b.model}
        assert "b" not in learner.trainer.runs and learner.trainer.run("a").version == 4


@pytest.mark.timeout(240)
async def test_each_run_is_a_tracker_run_of_its_own(bus: Bus, redis_client, tiny_model_dir: Path,  # type: ignore[no-untyped-def]
                                                     tmp_path: Path) -> None:
    """A learner of LoRA runs alone takes a tracker: each run is a tracker run named after it, its
    steps at its own versions, its configuration the learner's and its adapter's."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    from policyloop.learner.settings import LearnerSettings, TrackerSettings
    from policyloop.learner.tracking import lora_run_trackers

    settings = LearnerSettings(full_model=False, lora_runs=True, device="cpu",
                               tracker=TrackerSettings(kind="tensorboard", dir=tmp_path / "tracking"))
    assert settings.kinds_problem(world_size=1) is None
    versions = VersionRegistry(redis_client, "default")
    async with running(bus, redis_client, tiny_model_dir, tmp_path, open_tracker=lora_run_trackers(settings)) as (
            learner, _):
        a = await learner.add_run("a", SPEC, groups_per_step=1, max_lag=-1)
        b = await learner.add_run("b", LoraSpec(rank=8), groups_per_step=1, max_lag=-1)
        for group in ("a0", "a1"):
            await publish_run_group(bus, "a", group)
        await publish_run_group(bus, "b", "b0")
        await eventually(lambda: _at(versions, a.model, 2), timeout_s=120)
        await eventually(lambda: _at(versions, b.model, 1), timeout_s=120)
        await learner.remove_run("b")  # its tracker run ends with it; a's when the learner stops
    for run_id, steps, rank in (("a", [1, 2], 4), ("b", [1], 8)):
        events = EventAccumulator(str(tmp_path / "tracking" / "tensorboard" / run_id),
                                  size_guidance={"scalars": 0, "tensors": 0})
        events.Reload()
        assert [e.step for e in events.Scalars("train/loss")] == steps
        assert [e.value for e in events.Scalars("train/version")] == steps
        assert {"train/mean_reward", "train/grad_norm", "train/lag_max", "train/samples"} <= \
            set(events.Tags()["scalars"])
        content = events.PluginTagToContent("hparams")["_hparams_/session_start_info"]
        hparams = plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info.hparams
        assert hparams["run_id"].string_value == run_id and hparams["lora.rank"].number_value == rank
        assert hparams["loss.kind"].string_value == "ppo"


@pytest.mark.timeout(240)
async def test_a_runs_last_groups_that_fill_no_batch_are_trained_and_the_run_finishes(
        bus: Bus, redis_client, tiny_model_dir: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    versions, progress = VersionRegistry(redis_client, "default"), RunProgressStore(redis_client, "default")
    runs = RunRegistry(redis_client, "default")
    await runs.create("r", loop_pb2.StartRunRequest(run_id="r"), tasks_total=3)
    async with running(bus, redis_client, tiny_model_dir, tmp_path, progress=progress) as (learner, _):
        slot = await learner.add_run("r", SPEC, groups_per_step=2, max_lag=-1)
        for i in range(3):
            await publish_run_group(bus, "r", task_id("r", i))
        await eventually(lambda: _at(versions, slot.model, 2), timeout_s=120)  # a full batch, then the last group

        async def finished() -> bool:
            return await runs.state("r") == loop_pb2.RUN_STATE_FINISHED

        await eventually(finished, timeout_s=30)
    assert [len(r.trajectory_ids) for r in await trained_steps(bus, slot.model)] == [4, 2]
    done = await progress.get("r")
    assert (done.tasks_trained, done.trained_samples, done.tasks_dropped) == (3, 6, 0)


async def _at(versions: VersionRegistry, model: str, version: int) -> bool:
    return await versions.get(model) >= version


async def _redelivered(bus: Bus) -> bool:
    return (await bus.backlog("learner")).redelivered > 0


async def _held(learner: AdapterLearner, run_id: str, samples: int) -> bool:
    collector = learner.slots[run_id].held.collector
    return sum(len(m) for m in collector.groups.values()) + sum(len(g) for g in collector.complete.values()) >= samples


@pytest.mark.timeout(240)
async def test_a_run_resumes_from_its_checkpoint_and_ledger_with_no_gap_and_no_reuse(
        bus: Bus, redis_client, tiny_model_dir: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    versions = VersionRegistry(redis_client, "default")
    async with running(bus, redis_client, tiny_model_dir, tmp_path, checkpoint_every=2) as (learner, _):
        a = await learner.add_run("a", SPEC, groups_per_step=1, max_lag=-1)
        assert a.resumed is not None and a.resumed.replayed == [] and a.resumed.checkpoint is None
        for i in range(3):
            await publish_run_group(bus, "a", f"a{i}")
        await eventually(lambda: _at(versions, a.model, 3), timeout_s=120)
        first = learner.trainer.export_adapter("a")

    # A new learner (fresh adapter) takes the run up again: checkpoint of version 2, step 3 replayed.
    async with running(bus, redis_client, tiny_model_dir, tmp_path, checkpoint_every=2) as (learner, publisher):
        a = await learner.add_run("a", SPEC, groups_per_step=1, max_lag=-1)
        assert a.resumed is not None and a.resumed.checkpoint_version == 2 and a.resumed.replayed == [3]
        assert learner.trainer.run("a").version == 3
        for name, tensor in first.items():
            assert torch.equal(learner.trainer.export_adapter("a")[name], tensor), name
        await publish_run_group(bus, "a", "a0")  # published again: a trained sample is never trained twice
        await publish_run_group(bus, "a", "a3")
        await eventually(lambda: _at(versions, a.model, 4), timeout_s=120)
        records = await trained_steps(bus, a.model)
        assert [r.version for r in records] == [1, 2, 3, 4] and records[-1].trajectory_ids == ("a3/0", "a3/1")
        assert (await asyncio.to_thread(publisher.library.store.get, a.model, 4)).manifest_hash == \
            records[-1].manifest_hash
