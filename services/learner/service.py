"""learner service: TRAJECTORIES → GRPO steps → new policy versions, pushed to the publisher.

One rank by default. For more, launch it with torchrun
(`torchrun --nproc_per_node N -m policyloop.services.learner`): rank 0 is the service (bus,
Redis, health, publishing) and leads every step; the other ranks hold their FSDP2 shards and
train their share of each batch.

Trajectories are held (unacknowledged, with in-progress heartbeats) until the step that trains
on them has produced a version the publisher stored durably; then they are acked. Each step is
recorded in LEDGER before its version is published, and checkpoints are written every
`checkpoint_every` steps and on SIGTERM; a learner that starts again loads the newest checkpoint
and replays the recorded steps after it (policyloop.rl.recovery), so the version sequence goes
on with no gap and no reuse. A learner that dies mid-step loses nothing: the step was either
recorded (and is replayed) or not (and its trajectories, never acked, are redelivered).
Redeliveries of what is already held or trained are recognised by trajectory id and acked
without training. The rules are in docs/recovery.md.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import Field
from redis.exceptions import RedisError

from policyloop.bus import Delivery, PermanentError, PullWorker
from policyloop.contracts.v1 import bus_pb2
from policyloop.contracts.validate import validate_trajectory
from policyloop.engines.sglang_client import EngineError, SGLangClient
from policyloop.envs.validation import RUN_LOSS_SETTINGS
from policyloop.ledger import StepRecord, record_dropped, record_trained
from policyloop.rl.batching import Admission, GroupCollector, RecentSteps, sample_lag, split_stale
from policyloop.runtime import ServiceCannotStart, ServiceContext, ServiceSettings, run_main, run_pull_workers
from policyloop.state.progress import RunProgressStore
from policyloop.telemetry.logging import get_logger
from policyloop.telemetry.metrics import (
    LEARNER_DROPPED,
    LEARNER_STEP_SECONDS,
    LEARNER_STEP_STAT,
    LEARNER_TOKENS,
    VERSION_LAG,
    WEIGHT_PAYLOAD_BYTES,
    WEIGHT_SYNC_SECONDS,
)
from policyloop.weights.client import PushReport, VersionPusher, WeightClient

if TYPE_CHECKING:
    from collections.abc import Awaitable, Mapping

    import torch

    from policyloop.rl.objective import LossConfig
    from policyloop.rl.recovery import Resumed
    from policyloop.rl.trainer import PolicyTrainer, TrainerConfig
    from policyloop.weights.distributed import DistributedWeightSender

log = get_logger(__name__)
# How long a stopping learner waits for a checkpoint still being written before it closes the
# trainer (an orchestrator's SIGKILL before then is safe: checkpoints are renamed into place).
CHECKPOINT_WAIT_S = 600.0


class LearnerSettings(ServiceSettings):
    model: str = Field("policy", description="Name of the model this learner trains (WEIGHTS subject, versions).")
    model_path: Path = Field(Path("model"), description="Hugging Face directory of the base policy.")
    publisher_endpoint: str = Field("127.0.0.1:50052", description="host:port of the publisher's WeightService.")
    publisher_token: str = Field("", description="Bearer token for the publisher, if it wants one.")
    publish_deadline_s: float = Field(60.0, description="Deadline of one Push of a version to the publisher.")
    groups_per_step: int = Field(32, description="Complete groups (prompts) per optimizer step.")
    lr: float = Field(1e-4, description="AdamW learning rate (the peak, with a schedule).")
    lr_warmup_steps: int = Field(0, ge=0, description="Steps of linear warmup from 0 to lr (0: none).")
    lr_schedule: Literal["constant", "cosine"] = Field(
        "constant", description="After warmup: constant lr, or cosine decay to lr × lr_min_ratio at lr_decay_steps.")
    lr_decay_steps: int = Field(0, ge=0, description="Step at which the cosine schedule reaches its floor.")
    lr_min_ratio: float = Field(0.0, ge=0, le=1, description="Floor of the cosine schedule, as a fraction of lr.")
    loss: Literal["ppo", "gspo", "cispo"] = Field(
        "ppo", description="Policy loss: ppo (PPO-clip, GRPO/DAPO/Dr.GRPO by normalization and advantages), "
                           "gspo (sequence-level ratio) or cispo (clipped, detached IS weight).")
    normalization: Literal["token", "sequence", "constant"] = Field(
        "token", description="Loss normalisation: token (DAPO), sequence (GRPO), constant (Dr.GRPO).")
    loss_constant: float = Field(0.0, description="Normaliser of normalization=constant (0: the batch's width).")
    advantages: Literal["group", "group_no_std", "leave_one_out", "none"] = Field(
        "group", description="Advantages: group mean/std (GRPO), group mean only (Dr.GRPO), leave-one-out, none.")
    clip_low: float = Field(0.2, description="PPO clip range below 1 for the importance ratio.")
    clip_high: float = Field(0.2, description="PPO clip range above 1 (clip-higher when larger than clip_low); "
                                              "CISPO's upper bound on its IS weight.")
    gspo_clip_low: float = Field(3e-4, description="GSPO clip range below 1 of the sequence ratio.")
    gspo_clip_high: float = Field(4e-4, description="GSPO clip range above 1 of the sequence ratio.")
    off_policy: Literal["none", "tis", "decoupled"] = Field(
        "none", description="Off-policy correction: none (ratio to behaviour), tis (truncated IS weight "
                            "proximal/behaviour), decoupled (trust region at the proximal policy).")
    tis_cap: float = Field(2.0, description="Cap of the IS weight (tis; decoupled when > 0).")
    kl_coef: float = Field(0.0, description="Weight of the KL penalty to the base (reference) policy; 0: none.")
    kl_estimator: Literal["k1", "k2", "k3"] = Field("k3", description="Estimator of the KL penalty.")
    max_lag: int = Field(
        1, description="Samples whose oldest token is more than max_lag versions behind the version being "
                       "trained are dropped with their group (counted as stale); -1: no bound.")
    max_grad_norm: float = Field(1.0, description="Gradient norm clipping threshold.")
    checkpoint_dir: Path = Field(
        Path("runs/local/checkpoints"), description="Where checkpoints (model, optimizer, RNG, version, LEDGER "
                                                    "position, recently trained ids) are written.")
    checkpoint_every: int = Field(
        50, description="Steps between checkpoints (one is also written on SIGTERM); 0: only on SIGTERM. Steps "
                        "after the newest checkpoint are replayed from the ledger on resume, so this trades "
                        "checkpoint time against replay time, never data.")
    checkpoints_kept: int = Field(2, description="Newest checkpoints kept on disk.")
    resume: bool = Field(
        True, description="Start from the newest checkpoint and replay the steps LEDGER recorded after it, "
                          "continuing the version sequence. --no-resume: start from the base weights, refused "
                          "unless the model's version is 0.")
    dedupe_steps: int = Field(
        1000, description="Steps whose trajectory ids are remembered to recognise redelivered samples (later ones "
                          "exceed max_lag and are dropped as stale).")
    torch_threads: int = Field(1, description="torch intra-op threads of this process.")
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="Where the policy trains: auto (CUDA when this torch sees a GPU, else CPU), cpu, or "
                            "cuda — which refuses to start on a CPU-only torch or a node without a visible GPU "
                            "instead of training on the CPU unnoticed (GPU images and overlays set it).")
    crash_after_recording_step: int = Field(
        0, description="Fault injection for recovery drills: exit at once (as if killed) right after step N is "
                       "recorded in LEDGER and before its version is published — the narrowest window of the "
                       "write-ahead rule. 0: never.")
    colocated_engines: list[str] = Field(
        default_factory=list,
        description="Base URLs of engines on this node that take every version straight from the learner by "
                    "broadcast (SGLang init_weights_update_group / update_weights_from_distributed), as a JSON "
                    "list; their replicas run with weight_source=colocated. Versions still go to the publisher.")
    colocated_backend: Literal["nccl", "gloo"] = Field(
        "nccl", description="torch.distributed backend of the colocated broadcast (gloo: CPU engines).")
    colocated_master_address: str = Field(
        "127.0.0.1", description="Address the colocated engines reach this learner at (it hosts the group).")
    colocated_tp_size: int = Field(1, description="Tensor-parallel ranks of each colocated engine.")
    colocated_bucket_mb: int = Field(512, description="Most bytes per broadcast bucket, in MiB.")
    colocated_retry_s: float = Field(
        60.0, description="After a failed broadcast, versions go by the publisher only for this long before the "
                          "weight-update group is formed again.")


def loss_config(settings: LearnerSettings) -> LossConfig:
    from policyloop.rl.objective import LossConfig

    return LossConfig(
        kind=settings.loss, normalization=settings.normalization, constant=settings.loss_constant,
        clip_low=settings.clip_low, clip_high=settings.clip_high, gspo_clip_low=settings.gspo_clip_low,
        gspo_clip_high=settings.gspo_clip_high, advantages=settings.advantages, off_policy=settings.off_policy,
        tis_cap=settings.tis_cap, kl_coef=settings.kl_coef, kl_estimator=settings.kl_estimator,
    )


def trainer_config(settings: LearnerSettings) -> TrainerConfig:
    from policyloop.rl.trainer import TrainerConfig

    return TrainerConfig(lr=settings.lr, loss=loss_config(settings), warmup_steps=settings.lr_warmup_steps,
                         schedule=settings.lr_schedule, decay_steps=settings.lr_decay_steps,
                         min_lr_ratio=settings.lr_min_ratio, max_grad_norm=settings.max_grad_norm,
                         threads=settings.torch_threads, device=settings.device)


class ColocatedEngines:
    """The engines that take each version by broadcast. A failed broadcast is logged and the
    group rebuilt at the next version; meanwhile the replicas load the version from the
    publisher (they wait for the broadcast only so long), so a version is never lost."""

    def __init__(self, settings: LearnerSettings) -> None:
        self.settings = settings
        self.sender: DistributedWeightSender | None = None  # formed at the first version
        self.clients: list[SGLangClient] = []
        self.retry_at = 0.0  # monotonic time before which no new group is formed

    async def send(self, tensors: Mapping[str, torch.Tensor], version: int) -> None:
        if not self.settings.colocated_engines or (self.sender is None and time.monotonic() < self.retry_at):
            return
        from policyloop.weights.distributed import WeightGroupError

        try:
            if self.sender is None:
                await self._connect()
            assert self.sender is not None
            stats = await self.sender.send(tensors, weight_version=str(version))
        except (EngineError, WeightGroupError, OSError) as exc:
            log.error("weights_broadcast_failed", version=version, error=str(exc),
                      retry_in_s=self.settings.colocated_retry_s)
            await self.close()
            # A group that could not form leaves its rendezvous waiting in a thread until its
            # timeout: forming one at every version would pile them up.
            self.retry_at = time.monotonic() + self.settings.colocated_retry_s
            return
        WEIGHT_SYNC_SECONDS.labels("broadcast").observe(stats.seconds)
        log.info("weights_broadcast", version=version, engines=len(self.clients), buckets=stats.buckets,
                 bytes=stats.nbytes, seconds=round(stats.seconds, 3))

    async def _connect(self) -> None:
        from policyloop.weights.distributed import DistributedWeightSender, EngineTarget

        self.clients = [SGLangClient(url, timeout_s=600) for url in self.settings.colocated_engines]
        sender = DistributedWeightSender(backend=self.settings.colocated_backend,
                                         master_address=self.settings.colocated_master_address,
                                         bucket_bytes=self.settings.colocated_bucket_mb * 1024 * 1024)
        try:
            await sender.init([EngineTarget(c, self.settings.colocated_tp_size) for c in self.clients])
        except BaseException:
            await self._close_clients()
            raise
        self.sender = sender

    async def close(self) -> None:
        from policyloop.weights.distributed import WeightGroupError

        sender, self.sender = self.sender, None
        if sender is not None:
            try:
                await sender.close()
            except (EngineError, WeightGroupError) as exc:
                log.warning("weights_group_close_failed", error=str(exc))
        await self._close_clients()

    async def _close_clients(self) -> None:
        for client in self.clients:
            await client.close()
        self.clients = []


async def start_version(ctx: ServiceContext, settings: LearnerSettings, trainer: PolicyTrainer) -> Resumed:
    """Brings the fresh trainer to the loop's version: resumed from checkpoint and ledger, or
    the base weights at version 0. The registry follows the learner (it may be behind after a
    Redis restart); a registry ahead of what can be resumed means the learner must not train."""
    from policyloop.rl.recovery import Resumed, resume

    registered = await ctx.versions.get(settings.model)
    if settings.resume:
        resumed = await resume(trainer, ctx.bus, settings.model, settings.checkpoint_dir)
    else:
        resumed = Resumed(checkpoint=None, checkpoint_version=0)
    if registered > trainer.version:
        # Training the base weights (or an old checkpoint) under a later version number would
        # publish a regression.
        how = "from checkpoint and ledger" if settings.resume else "with --no-resume (the base weights)"
        raise RuntimeError(f"{settings.model} is at version {registered} but this learner reaches only version "
                           f"{trainer.version} {how}; is another learner running, or were checkpoints lost?")
    if trainer.version > registered:
        await ctx.versions.advance(settings.model, trainer.version)
    log.info("learner_resumed", version=trainer.version, checkpoint=str(resumed.checkpoint or ""),
             checkpoint_version=resumed.checkpoint_version, replayed=len(resumed.replayed))
    return resumed


async def body(ctx: ServiceContext) -> None:
    settings: LearnerSettings = ctx.settings  # type: ignore[assignment]
    # What runs are checked against (the gateway refuses a run asking for something else); set
    # first, so that it is advertised while the model loads and the ledger replays too.
    ctx.detail["config"] = {"model": settings.model, "max_lag": settings.max_lag,
                            "loss": {key: getattr(settings, key) for key in RUN_LOSS_SETTINGS}}
    from policyloop.rl.trainer import DeviceUnavailable, PolicyTrainer, resolve_device
    from policyloop.weights.torch_io import weight_set

    try:
        resolve_device(settings.device)
    except DeviceUnavailable as exc:
        raise ServiceCannotStart(str(exc)) from exc
    config = trainer_config(settings)
    trainer = await asyncio.to_thread(PolicyTrainer, settings.model_path, config, 0)
    try:
        resumed = await start_version(ctx, settings, trainer)
    except BaseException:
        trainer.close()
        raise
    ctx.policy_version = trainer.version
    ctx.detail["resumed"] = {"checkpoint_version": resumed.checkpoint_version, "replayed": len(resumed.replayed)}
    publisher = WeightClient(settings.publisher_endpoint, bearer_token=settings.publisher_token,
                             deadline_s=settings.publish_deadline_s)
    pusher = VersionPusher(publisher, settings.model, run_id=settings.run_id)
    colocated = ColocatedEngines(settings)
    weight_bytes: Counter[str] = Counter()
    progress = RunProgressStore(ctx.redis, settings.namespace)

    def record_push(pushed: PushReport) -> None:
        WEIGHT_SYNC_SECONDS.labels("encode").observe(pushed.encode_s)
        WEIGHT_SYNC_SECONDS.labels("push").observe(pushed.push_s)
        WEIGHT_PAYLOAD_BYTES.labels(pushed.kind).inc(pushed.payload_bytes)
        weight_bytes["raw"] += pushed.raw_bytes
        weight_bytes[pushed.kind] += pushed.payload_bytes
        weight_bytes[f"{pushed.kind}_versions"] += 1
        # What a replica that follows every version fetches, against the full weights each time.
        ctx.detail["weights"] = {
            "versions_pushed": weight_bytes["delta_versions"] + weight_bytes["keyframe_versions"],
            "keyframes": weight_bytes["keyframe_versions"], "full_bytes": weight_bytes["raw"],
            "pushed_bytes": weight_bytes["delta"] + weight_bytes["keyframe"], "delta_bytes": weight_bytes["delta"],
            "last_changed_fraction": round(pushed.changed_fraction, 4),
        }

    if resumed.weights is not None:
        if resumed.replayed:
            # The newest replayed version may not have reached the publisher before the crash
            # (the ledger is written first); a push it already holds is recognised.
            pusher.confirmed = None
            record_push(await pusher.push(resumed.weights, trainer.steps))
        pusher.confirmed = resumed.weights  # the next version goes as a delta from it
    collector = GroupCollector(trained=RecentSteps(settings.dedupe_steps, resumed.recent_steps))
    ledger_seq = resumed.ledger_seq          # LEDGER position of the newest recorded step
    checkpointed = resumed.checkpoint_version
    sequences: dict[str, int] = {}           # trajectory id -> TRAJECTORIES sequence, while held
    waiting: dict[str, asyncio.Future[None]] = {}
    enough = asyncio.Event()
    lag_histogram: Counter[int] = Counter()
    dropped: Counter[str] = Counter()
    # For the idle fraction: wall time from the first trajectory to the last step, against the
    # time spent stepping and publishing (busy_s). Unix seconds, so harnesses can read them.
    ctx.detail.update(step=trainer.steps, mean_reward=0.0, trajectories_seen=0, groups_complete=0,
                      dropped={}, lag_histogram={}, trained_samples=0, trained_tokens=0, busy_s=0.0,
                      first_trajectory_at=0.0, last_step_at=0.0, checkpoint_version=checkpointed)

    def drop(reason: str, count: int = 1) -> None:
        LEARNER_DROPPED.labels(reason).inc(count)
        dropped[reason] += count
        report_dropped()

    def report_dropped() -> None:
        # Invalid trajectories are dead-lettered by the worker (failed validation, unscored).
        invalid = worker.dead_lettered["invalid"]
        LEARNER_DROPPED.labels("invalid").inc(invalid - dropped["invalid"])
        dropped["invalid"] = invalid
        ctx.detail["dropped"] = {k: v for k, v in dropped.items() if v}

    async def handle(delivery: Delivery[bus_pb2.Trajectory]) -> None:
        traj = delivery.message
        if not traj.scored:
            raise PermanentError("trajectory was not scored by the reward service")
        admission = collector.add(traj)
        if not ctx.detail["first_trajectory_at"]:
            ctx.detail["first_trajectory_at"] = time.time()
        ctx.detail["trajectories_seen"] = int(ctx.detail["trajectories_seen"]) + 1
        if admission is Admission.DUPLICATE:
            held = waiting.get(traj.trajectory_id)
            if held is not None:
                # Still held or in the step under way (an ack wait that lapsed, or a reconnect):
                # acking this copy would ack the message itself before its step is durable.
                await asyncio.shield(held)
                return
            drop("duplicate")
            return
        sequences[traj.trajectory_id] = delivery.stream_seq
        future = asyncio.get_running_loop().create_future()
        waiting[traj.trajectory_id] = future
        if admission is Admission.COMPLETE:
            ctx.detail["groups_complete"] = int(ctx.detail["groups_complete"]) + 1
            if collector.complete_groups >= settings.groups_per_step:
                enough.set()
        await future  # resolved once a published version contains this sample

    def release(trajectory_id: str) -> None:
        """Lets the handler holding this trajectory return (and the worker ack it)."""
        sequences.pop(trajectory_id, None)
        future = waiting.pop(trajectory_id, None)
        if future is not None and not future.done():
            future.set_result(None)

    async def drop_stale(stale: list[list[bus_pb2.Trajectory]]) -> None:
        """Beyond the lag bound: recorded and acked (never trained)."""
        for group in stale:
            await record_dropped(ctx.bus, settings.model, settings.run_id, settings.instance_id, "stale",
                                 [(t.trajectory_id, sequences.get(t.trajectory_id, 0)) for t in group])
            drop("stale", len(group))
            await record_progress(progress.record_dropped(group))
            for traj in group:
                release(traj.trajectory_id)

    async def record_progress(update: Awaitable[None]) -> None:
        # Figures for GetRun/WatchRun: never worth stopping training for.
        try:
            await update
        except RedisError as exc:
            log.warning("progress_not_recorded", error=repr(exc))

    saving: asyncio.Future[Path] | None = None

    async def checkpoint() -> None:
        nonlocal checkpointed, saving
        if trainer.version == checkpointed:
            return
        started = time.monotonic()
        # Shielded: a stop that cancels the training loop must not close the trainer under a
        # save still writing in its thread (the shutdown below waits for it).
        saving = asyncio.ensure_future(asyncio.to_thread(
            trainer.save, settings.checkpoint_dir, list(collector.trained.steps), {"ledger_seq": ledger_seq},
            settings.checkpoints_kept))
        directory = await asyncio.shield(saving)
        checkpointed = trainer.version
        ctx.detail["checkpoint_version"] = checkpointed
        log.info("checkpoint_written", version=checkpointed, path=str(directory),
                 seconds=round(time.monotonic() - started, 3))

    async def train_step(groups: list[list[bus_pb2.Trajectory]]) -> None:
        nonlocal ledger_seq
        started = time.monotonic()
        samples = [t for group in groups for t in group]
        report = await asyncio.to_thread(trainer.step, groups)
        tensors = await asyncio.to_thread(trainer.export_tensors)
        weights = await asyncio.to_thread(weight_set, trainer.version, tensors)
        # Write-ahead: the step is in the ledger before anyone can see its version.
        ledger_seq = await record_trained(ctx.bus, settings.model, settings.run_id, settings.instance_id, StepRecord(
            step=report.step, version=trainer.version, manifest_hash=weights.manifest_hash,
            trajectory_ids=tuple(t.trajectory_id for t in samples),
            stream_sequences=tuple(sequences[t.trajectory_id] for t in samples)))
        if report.step == settings.crash_after_recording_step:
            log.warning("crashing_on_purpose", step=report.step, version=trainer.version)
            os._exit(70)  # no cleanup, no acks, no checkpoint: what SIGKILL would leave
        await colocated.send(tensors, trainer.version)
        pushed = await pusher.push(weights, report.step)
        record_push(pushed)
        await ctx.versions.advance(settings.model, trainer.version)
        ctx.policy_version = trainer.version
        for traj in samples:
            lag = sample_lag(traj, trainer.version - 1)
            lag_histogram[lag] += 1
            VERSION_LAG.observe(lag)
            release(traj.trajectory_id)
        await record_progress(progress.record_step(report.step, trainer.version - 1, samples))
        if settings.checkpoint_every and trainer.version % settings.checkpoint_every == 0:
            await checkpoint()
        LEARNER_TOKENS.inc(report.trained_tokens)
        LEARNER_STEP_SECONDS.observe(time.monotonic() - started)
        ctx.detail.update(busy_s=round(float(ctx.detail["busy_s"]) + time.monotonic() - started, 3),
                          last_step_at=time.time(),
                          trained_tokens=int(ctx.detail["trained_tokens"]) + report.trained_tokens)
        ctx.detail.update(step=report.step, mean_reward=round(report.mean_reward, 4),
                          lag_histogram={str(k): v for k, v in sorted(lag_histogram.items())},
                          trained_samples=int(ctx.detail["trained_samples"]) + report.samples,
                          clip_fraction=round(report.clip_fraction, 4), approx_kl=round(report.approx_kl, 6),
                          entropy=round(report.entropy, 4), kl_reference=round(report.kl_reference, 6),
                          is_weight_mean=round(report.is_weight_mean, 4),
                          is_weight_max=round(report.is_weight_max, 4),
                          is_truncated_fraction=round(report.is_truncated_fraction, 4))
        report_dropped()
        for stat in ("entropy", "clip_fraction", "kl_reference", "ratio_mean", "is_weight_mean", "is_weight_max",
                     "is_truncated_fraction", "loss", "grad_norm"):
            LEARNER_STEP_STAT.labels(stat).set(getattr(report, stat))
        LEARNER_STEP_STAT.labels("kl_behaviour").set(report.approx_kl)
        log.info("step", step=report.step, version=trainer.version, mean_reward=round(report.mean_reward, 4),
                 loss=round(report.loss, 5), samples=report.samples, grad_norm=round(report.grad_norm, 4),
                 step_s=round(time.monotonic() - started, 3))

    async def train_loop() -> None:
        while not ctx.stop.is_set():
            waiter = asyncio.create_task(enough.wait())
            stopper = asyncio.create_task(ctx.stop.wait())
            await asyncio.wait({waiter, stopper}, return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
            stopper.cancel()
            if ctx.stop.is_set():
                break
            enough.clear()
            groups, stale = split_stale(collector.take(settings.groups_per_step), trainer.version, settings.max_lag)
            # Remembered at once: a redelivery arriving during the step is a duplicate.
            collector.trained.add_step(t.trajectory_id for group in groups for t in group)
            await drop_stale(stale)
            if groups:
                await train_step(groups)
            if collector.complete_groups >= settings.groups_per_step:
                enough.set()
        # Stopping (SIGTERM): the step under way was finished above; checkpoint it, so the
        # next learner replays nothing.
        await checkpoint()

    # The worker must hold a whole step's samples (unacked) plus the groups still filling.
    worker = PullWorker(
        ctx.bus, ctx.bus.topology.consumers["learner"], bus_pb2.Trajectory, handle,
        service="learner", validator=validate_trajectory,
        concurrency=ctx.bus.topology.consumers["learner"].max_ack_pending,
    )

    def on_trainer_done(task: asyncio.Task[None]) -> None:
        # A learner that cannot train must not keep holding trajectories: stop, so the held
        # messages are handed back and a supervisor restarts it.
        if not task.cancelled() and task.exception() is not None:
            log.error("train_loop_failed", error=repr(task.exception()))
            ctx.stop.set()

    trainer_task = asyncio.create_task(train_loop())
    trainer_task.add_done_callback(on_trainer_done)
    try:
        await run_pull_workers(ctx, worker)
    finally:
        # The training loop finished its step and checkpointed while the workers drained; one
        # cut short is safe too (a step is recorded before it is published, and replayed).
        done, _ = await asyncio.wait({trainer_task}, timeout=5)
        if not done:
            trainer_task.cancel()
            await asyncio.gather(trainer_task, return_exceptions=True)
        if saving is not None and not saving.done():
            log.info("waiting_for_checkpoint")
            await asyncio.wait({saving}, timeout=CHECKPOINT_WAIT_S)
        await publisher.close()
        await colocated.close()
        trainer.close()
    if not trainer_task.cancelled() and trainer_task.exception() is not None:
        raise RuntimeError("the training loop failed") from trainer_task.exception()


def follow_rank(settings: LearnerSettings) -> int:
    """A rank other than 0 under torchrun: no bus, no Redis — it trains its share of each step
    rank 0 leads, until rank 0 closes."""
    import os
    import signal

    from policyloop.rl.trainer import PolicyTrainer
    from policyloop.telemetry.logging import configure_logging

    # torchrun forwards SIGTERM to every rank; rank 0 stops gracefully and then releases the
    # others (close() broadcasts the end), which must still be there to take part.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    configure_logging(service="learner", run_id=settings.run_id,
                      instance=f"{settings.instance_id}-rank{os.environ['RANK']}", level=settings.log_level)
    config = trainer_config(settings)
    trainer = PolicyTrainer(settings.model_path, config, version=0)
    log.info("follower_ready", rank=trainer.rank, world_size=trainer.world_size)
    steps = trainer.follow()
    trainer.close()
    log.info("follower_stopped", steps=steps)
    return 0


def main(argv: list[str] | None = None) -> int:
    import os

    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and int(os.environ.get("RANK", "0")) != 0:
        from policyloop.runtime.settings import load_settings

        return follow_rank(load_settings(LearnerSettings, list(argv or [])))
    return run_main("learner", LearnerSettings, body, argv)
