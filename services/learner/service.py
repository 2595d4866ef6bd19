"""learner service: TRAJECTORIES → GRPO steps → policy versions (policyloop.learner).

One rank by default. For more, launch it with torchrun
(`torchrun --nproc_per_node N -m policyloop.services.learner`): rank 0 is the service (bus,
Redis, health, publishing) and leads every step; the other ranks hold their FSDP2 shards.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine
from contextlib import AsyncExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Any

from policyloop.learner.colocated import ColocatedEngines
from policyloop.learner.figures import advertised_status
from policyloop.learner.follow import follow_rank, is_follower_rank
from policyloop.learner.settings import LearnerSettings
from policyloop.learner.tracking import Tracker, TrackerUnavailable, require_tracker, start_learner_tracker
from policyloop.runtime import ServiceCannotStart, ServiceContext, model_directory, run_loops, run_main
from policyloop.state.progress import RunProgressStore
from policyloop.telemetry.logging import get_logger
from policyloop.weights.client import WeightClient
from policyloop.weights.push import VersionPusher

if TYPE_CHECKING:
    from policyloop.learner.adapters import AdapterLearner
    from policyloop.learner.learner import Learner
    from policyloop.rl.lora import AdapterTrainer

log = get_logger(__name__)
# How long a stopping learner waits for a checkpoint still being written before it closes the
# trainer (an orchestrator's SIGKILL before then is safe: checkpoints are renamed into place).
CHECKPOINT_WAIT_S = 600.0


async def body(ctx: ServiceContext) -> None:
    """The kinds of run the settings name, in one process (learner.combined): the full model's,
    LoRA runs, the Tinker API's models."""
    import os

    from policyloop.learner.combined import TrajectoryRouter, combined_status
    from policyloop.rl.lora import AdapterTrainer

    settings: LearnerSettings = ctx.settings  # type: ignore[assignment]
    # What runs are checked against, advertised at once: also while the model loads and the
    # ledger replays.
    starting = advertised_status(settings)
    ctx.status = lambda: starting
    problem = settings.kinds_problem(int(os.environ.get("WORLD_SIZE", "1")))
    if problem:
        raise ServiceCannotStart(problem)
    check_device_and_tracker(settings)
    model_dir = await model_directory(settings.model_path)
    turns = asyncio.Lock()  # the device: each kind's steps take it in turn (first come, first served)
    publisher = WeightClient(settings.publisher_endpoint, bearer_token=settings.publisher_token,
                             deadline_s=settings.publish_deadline_s)
    async with AsyncExitStack() as stack:
        stack.push_async_callback(publisher.close)
        loops: dict[str, Coroutine[Any, Any, None]] = {}
        full = await start_full_model(ctx, settings, model_dir, publisher, turns, stack) \
            if settings.full_model else None
        if full is not None:
            loops["train_loop"] = full.run(ctx.stop)
        # LoRA runs and Tinker models: adapters over one frozen base (their names never meet: a
        # Tinker model id holds ':', which a run id cannot).
        adapters = await asyncio.to_thread(AdapterTrainer, model_dir, settings.trainer_config()) \
            if settings.lora_runs or settings.tinker else None
        lora = await start_lora_runs(ctx, settings, adapters, publisher, turns, stack, loops) \
            if adapters is not None and settings.lora_runs else None
        if adapters is not None and settings.tinker:
            loops["tinker"] = start_tinker(ctx, settings, adapters, publisher, turns)
        ctx.status = lambda: combined_status(starting, full, lora)
        worker = None
        if full is not None or lora is not None:
            router = TrajectoryRouter(full, lora, await run_kinds(settings, stack) if full and lora else None)
            worker = full.pull_worker(router.admit) if full is not None else lora_pull_worker(ctx, lora)  # type: ignore[arg-type]
        # The training loops finish their step (the full model's checkpoints) while the worker
        # drains; one cut short is safe too (a step is recorded before it is published, and replayed).
        await run_loops(ctx, loops, *([worker] if worker is not None else []),
                        after_stop=(lambda: full.wait_for_checkpoint(CHECKPOINT_WAIT_S)) if full is not None else None)


def check_device_and_tracker(settings: LearnerSettings) -> None:
    from policyloop.common.device import DeviceUnavailable, resolve_device

    try:
        resolve_device(settings.device)
        require_tracker(settings.tracker.kind)  # a missing extra: refused before the model loads
    except (DeviceUnavailable, TrackerUnavailable) as exc:
        raise ServiceCannotStart(str(exc)) from exc


async def start_full_model(ctx: ServiceContext, settings: LearnerSettings, model_dir: Path, publisher: WeightClient,
                           turns: asyncio.Lock, stack: AsyncExitStack) -> Learner:
    """The full model's learner, resumed to the loop's version."""
    from policyloop.learner.learner import Learner
    from policyloop.learner.start import reclaim_held, start_version
    from policyloop.rl.trainer import PolicyTrainer

    loading = time.monotonic()
    trainer = await asyncio.to_thread(PolicyTrainer, model_dir, settings.trainer_config(), 0)
    stack.callback(trainer.close)
    log.info("trainer_loaded", seconds=round(time.monotonic() - loading, 3))
    colocated = ColocatedEngines(settings.colocated)
    stack.push_async_callback(colocated.close)
    tracker: Tracker = await start_learner_tracker(settings)
    stack.push_async_callback(asyncio.to_thread, tracker.close)
    resumed = await start_version(settings, trainer, ctx.bus, ctx.versions)
    ctx.policy_version = trainer.version
    learner = Learner(settings, trainer, ctx.bus, versions=ctx.versions,
                      pusher=VersionPusher(publisher, settings.model, run_id=settings.run_id),
                      colocated=colocated, progress=RunProgressStore(ctx.redis, settings.namespace),
                      resumed=resumed, on_version=lambda v: setattr(ctx, "policy_version", v), tracker=tracker,
                      turns=turns)
    await learner.publish_resumed(resumed)
    await reclaim_held(ctx.bus)  # a dead predecessor's batch, now rather than after the ack wait
    return learner


async def start_lora_runs(ctx: ServiceContext, settings: LearnerSettings, trainer: AdapterTrainer,
                          publisher: WeightClient, turns: asyncio.Lock, stack: AsyncExitStack,
                          loops: dict[str, Coroutine[Any, Any, None]]) -> AdapterLearner:
    """The LoRA runs' learner (an adapter per run the gateway starts, each its own tracker run),
    and the loop that follows the gateway's runs."""
    from policyloop.learner.adapters import AdapterLearner, follow_runs
    from policyloop.learner.tracking import lora_run_trackers
    from policyloop.state.catalog import RunRegistry

    checkpoints = settings.checkpoint.dir if settings.checkpoint.resume else None
    learner = AdapterLearner(settings.model, settings.instance_id, trainer, ctx.bus, versions=ctx.versions,
                             publisher=publisher, dedupe_steps=settings.dedupe_steps, checkpoint_root=checkpoints,
                             checkpoint_every=settings.checkpoint.every, checkpoint_keep=settings.checkpoint.kept,
                             progress=RunProgressStore(ctx.redis, settings.namespace),
                             leftovers_check_s=settings.leftovers_check_s, turns=turns,
                             open_tracker=lora_run_trackers(settings))
    loops["lora_runs"] = learner.run(ctx.stop)
    loops["follow_runs"] = follow_runs(learner, RunRegistry(await raw_redis(settings, stack), settings.namespace),
                                       ctx.stop, groups_per_step=settings.groups_per_step, max_lag=settings.max_lag)
    return learner


def start_tinker(ctx: ServiceContext, settings: LearnerSettings, trainer: AdapterTrainer, publisher: WeightClient,
                 turns: asyncio.Lock) -> Coroutine[Any, Any, None]:
    """The Tinker API's learner: applies TINKER's requests to LoRA adapters over the frozen base."""
    from policyloop.tinker.settings import TinkerSettings
    from policyloop.tinker.trainer import TinkerTrainer
    from policyloop.tinker.worker import TinkerWorker

    base_model = TinkerSettings(model_path=settings.model_path).model_name()
    worker = TinkerWorker(ctx.bus, TinkerTrainer(trainer, settings.checkpoint.dir / "tinker", base_model),
                          publisher=publisher, fetch_endpoint=settings.publisher_endpoint,
                          weights_model=settings.model, turns=turns)
    return worker.run(ctx.stop)


async def raw_redis(settings: LearnerSettings, stack: AsyncExitStack):  # type: ignore[no-untyped-def]
    """A Redis client that returns bytes: run definitions are protobuf."""
    from policyloop.state import connect_redis

    raw = await connect_redis(settings.redis_url, pool=settings.redis_pool, decode_responses=False)
    stack.push_async_callback(raw.aclose)
    return raw


async def run_kinds(settings: LearnerSettings, stack: AsyncExitStack):  # type: ignore[no-untyped-def]
    from policyloop.learner.combined import RunKinds
    from policyloop.state.catalog import RunRegistry

    return RunKinds(RunRegistry(await raw_redis(settings, stack), settings.namespace))


def lora_pull_worker(ctx: ServiceContext, learner: AdapterLearner):  # type: ignore[no-untyped-def]
    from policyloop.bus import PullWorker
    from policyloop.contracts.v1 import bus_pb2
    from policyloop.contracts.validate import validate_group

    consumer = ctx.bus.topology.consumers["learner"]
    return PullWorker(ctx.bus, consumer, bus_pb2.TrajectoryGroup, learner.admit, service="learner",
                      validator=validate_group, concurrency=consumer.max_ack_pending)


def main(argv: list[str] | None = None) -> int:
    if is_follower_rank():
        from policyloop.runtime.settings import load_settings

        return follow_rank(load_settings(LearnerSettings, list(argv or [])))
    return run_main("learner", LearnerSettings, body, argv)
