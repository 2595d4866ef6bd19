"""learner service: TRAJECTORIES → GRPO steps → policy versions (policyloop.learner).

One rank by default. For more, launch it with torchrun
(`torchrun --nproc_per_node N -m policyloop.services.learner`): rank 0 is the service (bus,
Redis, health, publishing) and leads every step; the other ranks hold their FSDP2 shards.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import TYPE_CHECKING

from policyloop.learner.colocated import ColocatedEngines
from policyloop.learner.figures import advertised_status
from policyloop.learner.follow import follow_rank, is_follower_rank
from policyloop.learner.settings import LearnerSettings
from policyloop.learner.tracking import NullTracker, Tracker, TrackerUnavailable, require_tracker, start_learner_tracker
from policyloop.runtime import ServiceCannotStart, ServiceContext, model_directory, run_main, run_pull_workers
from policyloop.state.progress import RunProgressStore
from policyloop.telemetry.logging import get_logger
from policyloop.weights.client import WeightClient
from policyloop.weights.push import VersionPusher

if TYPE_CHECKING:
    from policyloop.learner.learner import Learner

log = get_logger(__name__)
# How long a stopping learner waits for a checkpoint still being written before it closes the
# trainer (an orchestrator's SIGKILL before then is safe: checkpoints are renamed into place).
CHECKPOINT_WAIT_S = 600.0


async def body(ctx: ServiceContext) -> None:
    from policyloop.learner.learner import Learner
    from policyloop.learner.start import reclaim_held, start_version
    from policyloop.rl.trainer import DeviceUnavailable, PolicyTrainer, resolve_device

    settings: LearnerSettings = ctx.settings  # type: ignore[assignment]
    # What runs are checked against, advertised at once: also while the model loads and the
    # ledger replays.
    starting = advertised_status(settings)
    ctx.status = lambda: starting
    try:
        resolve_device(settings.device)
        require_tracker(settings.tracker.kind)  # a missing extra: refused before the model loads
    except (DeviceUnavailable, TrackerUnavailable) as exc:
        raise ServiceCannotStart(str(exc)) from exc
    model_dir = await model_directory(settings.model_path)
    if settings.tinker:
        await serve_tinker(ctx, settings, model_dir)
        return
    if settings.lora_runs:
        await serve_lora_runs(ctx, settings, model_dir)
        return
    loading = time.monotonic()
    trainer = await asyncio.to_thread(PolicyTrainer, model_dir, settings.trainer_config(), 0)
    log.info("trainer_loaded", seconds=round(time.monotonic() - loading, 3))
    publisher = WeightClient(settings.publisher_endpoint, bearer_token=settings.publisher_token,
                             deadline_s=settings.publish_deadline_s)
    colocated = ColocatedEngines(settings.colocated)
    tracker: Tracker = NullTracker()
    try:
        tracker = await start_learner_tracker(settings)
        resumed = await start_version(settings, trainer, ctx.bus, ctx.versions)
        ctx.policy_version = trainer.version
        learner = Learner(settings, trainer, ctx.bus, versions=ctx.versions,
                          pusher=VersionPusher(publisher, settings.model, run_id=settings.run_id),
                          colocated=colocated, progress=RunProgressStore(ctx.redis, settings.namespace),
                          resumed=resumed, on_version=lambda v: setattr(ctx, "policy_version", v), tracker=tracker)
        ctx.status = learner.current_status
        await learner.publish_resumed(resumed)
        await reclaim_held(ctx.bus)  # a dead predecessor's batch, now rather than after the ack wait
        await serve_learner(ctx, learner)
    finally:
        await publisher.close()
        await colocated.close()
        await asyncio.to_thread(tracker.close)
        trainer.close()


async def serve_tinker(ctx: ServiceContext, settings: LearnerSettings, model_dir: Path) -> None:
    """The Tinker API's learner: applies TINKER's requests to LoRA adapters over the base."""
    from policyloop.rl.lora import AdapterTrainer
    from policyloop.tinker.settings import TinkerSettings
    from policyloop.tinker.trainer import TinkerTrainer
    from policyloop.tinker.worker import TinkerWorker

    if settings.lora_runs or settings.colocated.engines or settings.tracker.kind != "none":
        raise ServiceCannotStart("tinker: not with lora_runs, colocated engines or a tracker")
    trainer = await asyncio.to_thread(AdapterTrainer, model_dir, settings.trainer_config())
    publisher = WeightClient(settings.publisher_endpoint, bearer_token=settings.publisher_token,
                             deadline_s=settings.publish_deadline_s)
    base_model = TinkerSettings(model_path=settings.model_path).model_name()
    worker = TinkerWorker(ctx.bus, TinkerTrainer(trainer, settings.checkpoint.dir / "tinker", base_model),
                          publisher=publisher, fetch_endpoint=settings.publisher_endpoint,
                          weights_model=settings.model)
    ctx.ready = True
    try:
        await worker.run(ctx.stop)
    finally:
        await publisher.close()


async def serve_lora_runs(ctx: ServiceContext, settings: LearnerSettings, model_dir: Path) -> None:
    """The many-runs learner: one frozen base, an adapter per LoRA run the gateway starts."""
    from policyloop.bus import PullWorker
    from policyloop.contracts.v1 import bus_pb2
    from policyloop.contracts.validate import validate_group
    from policyloop.learner.adapters import AdapterLearner, follow_runs
    from policyloop.rl.lora import AdapterTrainer
    from policyloop.state import connect_redis
    from policyloop.state.catalog import RunRegistry

    if settings.colocated.engines or settings.tracker.kind != "none":
        raise ServiceCannotStart("lora_runs: colocated engines and trackers are not served with LoRA runs yet")
    trainer = await asyncio.to_thread(AdapterTrainer, model_dir, settings.trainer_config())
    publisher = WeightClient(settings.publisher_endpoint, bearer_token=settings.publisher_token,
                             deadline_s=settings.publish_deadline_s)
    checkpoints = settings.checkpoint.dir if settings.checkpoint.resume else None
    learner = AdapterLearner(settings.model, settings.instance_id, trainer, ctx.bus, versions=ctx.versions,
                             publisher=publisher, dedupe_steps=settings.dedupe_steps, checkpoint_root=checkpoints,
                             checkpoint_every=settings.checkpoint.every, checkpoint_keep=settings.checkpoint.kept,
                             progress=RunProgressStore(ctx.redis, settings.namespace),
                             leftovers_check_s=settings.leftovers_check_s)
    consumer = ctx.bus.topology.consumers["learner"]
    worker = PullWorker(ctx.bus, consumer, bus_pb2.TrajectoryGroup, learner.admit, service="learner",
                        validator=validate_group, concurrency=consumer.max_ack_pending)
    # Run definitions are protobuf bytes: a client that does not decode responses reads them.
    raw = await connect_redis(settings.redis_url, pool=settings.redis_pool, decode_responses=False)
    training = asyncio.create_task(learner.run(ctx.stop))
    following = asyncio.create_task(follow_runs(learner, RunRegistry(raw, settings.namespace), ctx.stop,
                                                groups_per_step=settings.groups_per_step, max_lag=settings.max_lag))

    def on_done(task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:  # hand the held messages back: stop
            log.error("lora_learner_failed", error=repr(task.exception()))
            ctx.stop.set()

    training.add_done_callback(on_done)
    following.add_done_callback(on_done)
    try:
        await run_pull_workers(ctx, worker)
    finally:
        for task in (training, following):
            task.cancel()
        await asyncio.gather(training, following, return_exceptions=True)
        await publisher.close()
        await raw.aclose()


async def serve_learner(ctx: ServiceContext, learner: Learner) -> None:
    worker = learner.pull_worker()
    training = asyncio.create_task(learner.run(ctx.stop))

    def on_training_done(task: asyncio.Task[None]) -> None:
        # A learner that cannot train must not keep holding trajectories: stop, so the held
        # messages are handed back and a supervisor restarts it.
        if not task.cancelled() and task.exception() is not None:
            log.error("train_loop_failed", error=repr(task.exception()))
            ctx.stop.set()

    training.add_done_callback(on_training_done)
    try:
        await run_pull_workers(ctx, worker)
    finally:
        # The training loop finished its step and checkpointed while the workers drained; one
        # cut short is safe too (a step is recorded before it is published, and replayed).
        done, _ = await asyncio.wait({training}, timeout=5)
        if not done:
            training.cancel()
            await asyncio.gather(training, return_exceptions=True)
        await learner.wait_for_checkpoint(CHECKPOINT_WAIT_S)
    if not training.cancelled() and training.exception() is not None:
        raise RuntimeError("the training loop failed") from training.exception()


def main(argv: list[str] | None = None) -> int:
    if is_follower_rank():
        from policyloop.runtime.settings import load_settings

        return follow_rank(load_settings(LearnerSettings, list(argv or [])))
    return run_main("learner", LearnerSettings, body, argv)
