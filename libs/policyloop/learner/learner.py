"""The learner: TRAJECTORIES → GRPO steps → policy versions, pushed to the publisher.

Trajectories are held (unacknowledged) until the step that trains on them has made a version
the publisher stored; then they are acked. Each step is recorded in LEDGER before its version
is published, so a learner that dies anywhere in a step loses nothing: the step was recorded
(and is replayed on resume, policyloop.rl.recovery) or not (and its trajectories, never acked,
are redelivered). Redeliveries of what is held or trained are recognised by trajectory id and
acked without training. The rules are in docs/recovery.md.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from policyloop.bus import Bus, Delivery, PullWorker
from policyloop.contracts.v1 import bus_pb2, status_pb2
from policyloop.contracts.validate import validate_group
from policyloop.learner.figures import (
    ON_STEP,
    OVERLAPPED,
    LearnerFigures,
    advertised_status,
    publish_phases,
    trainer_phases,
)
from policyloop.learner.held import (
    Groups,
    HeldTrajectories,
    refuse_unscored,
    refuse_untrainable,
    standings,
)
from policyloop.learner.traces import Interval, LearnerTraces
from policyloop.learner.tracking import NullTracker, Tracker, step_statistics
from policyloop.ledger import record_dropped
from policyloop.rl.batching import Admission, RecentSteps
from policyloop.rl.checkpoint import CheckpointCadence, checkpoint_path, commit_checkpoint, write_snapshot
from policyloop.state.outcomes import RUN_STOPPED, STALE
from policyloop.state.progress import record_progress
from policyloop.telemetry.logging import get_logger
from policyloop.telemetry.phases import PhaseClock
from policyloop.weights.publication import Version, VersionPublication

if TYPE_CHECKING:
    import torch

    from policyloop.learner.colocated import ColocatedEngines
    from policyloop.learner.settings import LearnerSettings
    from policyloop.rl.checkpoint import Snapshot
    from policyloop.rl.recovery import Resumed
    from policyloop.rl.trainer import PolicyTrainer, StepReport
    from policyloop.state import VersionRegistry
    from policyloop.state.progress import RunProgressStore
    from policyloop.weights.codec import WeightSet
    from policyloop.weights.push import VersionPusher

log = get_logger(__name__)


class Learner:
    """One learner rank 0: holds trajectories, takes steps, publishes versions. `on_version` is
    told each version the learner stands at (the service reports it in health and logs); `tracker`
    gets each step's statistics (learner/tracking.py: it never blocks or raises); `turns` is the
    device's lock, taken in turn with the other kinds of run this process trains."""

    def __init__(self, settings: LearnerSettings, trainer: PolicyTrainer, bus: Bus, *, versions: VersionRegistry,
                 pusher: VersionPusher, colocated: ColocatedEngines, progress: RunProgressStore,
                 resumed: Resumed, on_version: Callable[[int], None] = lambda _: None,
                 tracker: Tracker | None = None, turns: asyncio.Lock | None = None) -> None:
        self.settings, self.trainer, self.bus = settings, trainer, bus
        self.turns = turns or asyncio.Lock()  # the device, shared with other kinds of run in this process
        self.tracker = tracker if tracker is not None else NullTracker()
        self.progress = progress
        self.held = HeldTrajectories(settings.groups_per_step, RecentSteps(settings.dedupe_steps, resumed.recent_steps))
        self.publication = VersionPublication(
            bus, settings.model, settings.run_id, settings.instance_id, pusher=pusher, versions=versions,
            progress=progress, colocated=colocated, release=self.held.release, sequence=self.held.sequence,
            on_version=on_version)
        self.publication.ledger_seq = resumed.ledger_seq
        self.checkpointed = resumed.checkpoint_version  # the newest checkpoint committed
        self.cadence = CheckpointCadence(settings.checkpoint.every, settings.checkpoint.every_s,
                                         resumed.checkpoint_version, time.monotonic())
        self.saving: asyncio.Future[Any] | None = None  # a checkpoint being copied or written
        self.publishing: asyncio.Future[None] | None = None  # the newest version's overlapping publication
        self.status = advertised_status(settings)
        self.status.MergeFrom(status_pb2.LearnerStatus(
            step=trainer.steps, checkpoint_version=resumed.checkpoint_version,
            resumed_checkpoint_version=resumed.checkpoint_version, replayed_steps=len(resumed.replayed)))
        self.figures = LearnerFigures(self.status)
        self.traces = LearnerTraces()
        self.worker: PullWorker[bus_pb2.TrajectoryGroup] | None = None

    def pull_worker(self, handler: Callable[[Delivery[bus_pb2.TrajectoryGroup]], Awaitable[None]] | None = None
                    ) -> PullWorker[bus_pb2.TrajectoryGroup]:
        """The consumer of TRAJECTORIES: it must hold a whole step's groups (unacked) plus those
        still arriving, so its concurrency is the consumer's max_ack_pending. `handler`: another
        than `admit` (a process that trains other kinds too routes each group to its kind)."""
        consumer = self.bus.topology.consumers["learner"]
        self.worker = PullWorker(self.bus, consumer, bus_pb2.TrajectoryGroup, handler or self.admit,
                                 service="learner", validator=validate_group, concurrency=consumer.max_ack_pending)
        return self.worker

    async def publish_resumed(self, resumed: Resumed) -> None:
        """After a resume: the newest replayed version may not have reached the publisher before
        the crash (the ledger is written first), so it is pushed again (a copy the publisher holds
        is recognised); the next version then goes as a delta from the resumed weights."""
        if resumed.weights is None:
            return
        pushed = await self.publication.republish(resumed.weights, self.trainer.steps, replayed=bool(resumed.replayed))
        if pushed is not None:
            self.figures.pushed(pushed)
        # A step's tasks are accounted for after its acks, off the step's path: the newest steps'
        # may not have been before the crash (recording them again changes nothing).
        await record_progress(self.progress.record_trained_ids(
            trajectory_id for step in resumed.recent_steps for trajectory_id in step))

    def current_status(self) -> status_pb2.LearnerStatus:
        """The status as of now (the heartbeat asks before each beat)."""
        if self.worker is not None:
            self.figures.dead_lettered(self.worker.dead_lettered["invalid"])
        return self.status

    async def admit(self, delivery: Delivery[bus_pb2.TrajectoryGroup]) -> None:
        """Handles one group's delivery; returns (and the worker acks) once its samples are trained
        into a published version, dropped, or recognised as copies of ones that were."""
        group = delivery.message.trajectories
        refuse_unscored(group)
        refuse_untrainable(group, self.trainer.limits)
        self.figures.saw_trajectories(len(group))
        duplicates = []
        for traj in group:
            self.traces.admitted(traj.trajectory_id)
            admission = self.held.add(traj, delivery.stream_seq)
            if admission is Admission.COMPLETE:
                self.status.groups_complete += 1
            duplicates.append(admission is Admission.DUPLICATE)
        # A copy of a sample still held or in the step under way (an ack wait that lapsed, a
        # reconnect) waits for it: acking now would ack the message before its step is durable.
        # A copy of one no longer held (trained) is acked at once, as a dropped duplicate.
        waited = await self.held.until_all_released([t.trajectory_id for t in group])
        copies = sum(1 for duplicate, held in zip(duplicates, waited, strict=True) if duplicate and not held)
        if copies:
            self.figures.dropped("duplicate", copies)

    async def run(self, stop: asyncio.Event) -> None:
        """Steps whenever a batch is held, or a run's last groups that fill none, until `stop`;
        then checkpoints the last step."""
        clock = PhaseClock()  # from one step's end to the next's: waiting for a batch
        try:
            while not stop.is_set():
                runs = None
                if not await self.held.wait_for_batch(stop, self.settings.leftovers_check_s):
                    runs = await self.leftovers() if not stop.is_set() else set()
                    if not runs:
                        continue
                groups, stale = self.held.take(self.trainer.version, self.settings.max_lag, runs)
                await self.drop(stale, STALE)
                if groups:  # of one kind: demonstrations or policy samples (GroupCollector.take)
                    clock.lap("wait_for_batch")
                    await self.step(groups, clock)
                    clock = PhaseClock()
            await self.published()
        finally:
            if self.publishing is not None:  # cut short: as a step cut short (recorded, so replayed)
                self.publishing.cancel()
        await self.publication.figures()
        await self.checkpoint()  # the next learner then replays nothing

    async def step(self, groups: Groups, clock: PhaseClock | None = None) -> None:
        """One optimizer step, in the write-ahead order that makes a crash anywhere safe
        (learner.publication): train → record in LEDGER → broadcast to colocated engines → push
        to the publisher → advance the version registry → release the trajectories (acks). With overlap_publication
        the publication (broadcast to release) runs while the next step trains; the next step is
        recorded only once it is done. `clock` times the phases (policyloop_learner_phase_seconds_total)."""
        clock = clock or PhaseClock()
        started, started_ns = time.monotonic(), time.time_ns()
        samples = [t for group in groups for t in group]
        report, tensors, weights = await self._train(groups, clock)
        trained_ns = clock.ended_ns["hash"]  # the version is computed
        await self.published()  # so at most one recorded version is unpublished at any time
        clock.lap("publish_wait")
        await self._record(report, weights, samples)
        clock.lap("ledger")
        version = Version(self.trainer.version, report.step, started_ns, trained_ns, samples)
        # The step is counted before its version is (no await between): a status read never sees
        # a version pushed by a step not yet counted.
        if self.settings.overlap_publication:
            self.figures.stepped(report, time.monotonic() - started)
            self.publishing = asyncio.ensure_future(self._publish(version, tensors, weights, PhaseClock(), OVERLAPPED))
        else:
            await self._publish(version, tensors, weights, clock, ON_STEP)
            self.figures.stepped(report, time.monotonic() - started)
        if self.cadence.due(self.trainer.version, time.monotonic()):
            await self.snapshot()  # the step waits for the copy; the write goes on beside the next steps
        clock.lap("checkpoint")
        self.figures.phases(trainer_phases(clock.seconds, report), ON_STEP)
        if not isinstance(self.tracker, NullTracker):
            self.tracker.log_step(report.step, step_statistics(report, time.monotonic() - started, samples,
                                                               version.number - 1, self.status))
        critic = {name: round(report.statistics[name], 5) for name in ("value_loss", "explained_variance")
                  if name in report.statistics}  # PPO with a critic: how its values fit
        log.info("step", step=report.step, version=version.number, mean_reward=round(report.mean_reward, 4),
                 loss=round(report.loss, 5), samples=report.samples, grad_norm=round(report.grad_norm, 4),
                 step_s=round(time.monotonic() - started, 3), **critic)

    async def published(self) -> None:
        """Waits for the newest version's publication, when it overlaps; raises its failure."""
        if self.publishing is not None:
            try:
                await self.publishing
            finally:
                self.publishing = None

    async def _publish(self, version: Version, tensors: dict[str, torch.Tensor], weights: WeightSet,
                       clock: PhaseClock, path: str) -> None:
        """A recorded version published (learner.publication), then its traces and figures."""
        pushed = await self.publication.publish(version, weights, tensors=tensors, clock=clock)
        self.traces.trained(version.samples, step=version.step, version=version.number,
                            train=Interval(version.started_ns, version.trained_ns),
                            publish=Interval(version.trained_ns, clock.ended_ns["registry"]), publish_kind=pushed.kind)
        self.figures.trained(list(version.samples), version.number - 1)
        phases = publish_phases(clock.seconds, pushed)
        self.figures.pushed(pushed)
        if path == OVERLAPPED:
            self.figures.phases(phases, OVERLAPPED)
        else:  # filed with the step's own phases
            clock.seconds.update(phases)

    async def _train(self, groups: Groups, clock: PhaseClock) -> tuple[StepReport, dict[str, torch.Tensor], WeightSet]:
        from policyloop.weights.torch_io import weight_set

        async with self.turns:
            report = await asyncio.to_thread(self.trainer.step, groups)
            clock.lap("trainer")
            tensors = await asyncio.to_thread(self.trainer.export_tensors)
            clock.lap("export")
        weights = await asyncio.to_thread(weight_set, self.trainer.version, tensors)
        clock.lap("hash")
        return report, tensors, weights

    async def _record(self, report: StepReport, weights: WeightSet, samples: list[bus_pb2.Trajectory]) -> None:
        """The write-ahead record: the step is in LEDGER before anyone can see its version."""
        await self.publication.record(report.step, self.trainer.version, weights, samples)
        if report.step == self.settings.crash_after_recording_step:
            log.warning("crashing_on_purpose", step=report.step, version=self.trainer.version)
            os._exit(70)  # no cleanup, no acks, no checkpoint: what SIGKILL would leave

    async def drop(self, groups: Groups, reason: str) -> None:
        """Groups acked untrained (beyond the lag bound, or of a run that ended): recorded in LEDGER
        and in their run's progress first."""
        for group in groups:
            await record_dropped(self.bus, self.settings.model, self.settings.run_id, self.settings.instance_id,
                                 reason, [(t.trajectory_id, self.held.sequence(t.trajectory_id)) for t in group])
            self.figures.dropped(reason, len(group))
            self.traces.dropped(group, reason)
            await record_progress(self.progress.record_dropped(group, reason))
            self.held.release(group)

    async def leftovers(self) -> set[str]:
        """The runs whose every task not yet accounted for is held here, complete: their last groups,
        which fill no batch, are trained as one of their own. A run that ended (stopped) gives up
        its groups that will not complete."""
        final = set()
        held = self.held.collector.runs()
        for run_id, standing in (await standings(self.progress.outcomes, held)).items():
            complete = held[run_id]
            if standing.ended:
                await self.drop(self.held.discard_incomplete(run_id), RUN_STOPPED)
            if complete and standing.all_held(complete):
                final.add(run_id)
        return final

    async def checkpoint(self) -> None:
        """Checkpoints the newest version now and waits until it is written (a stopping learner
        leaves nothing to replay). Its version must be published: run() calls it last."""
        if self.saving is not None:
            await asyncio.wait({self.saving})  # one write at a time, in version order
        if self.trainer.version == self.checkpointed:
            return
        await self.snapshot()
        await asyncio.shield(self.saving)  # type: ignore[arg-type]

    async def snapshot(self) -> None:
        """Copies the state of the version just trained (model, optimizer, RNG, LEDGER position,
        recently trained ids: one step's) and hands the copy to a writer, which commits it once
        that version is published (a resumed learner takes what its checkpoint holds as published).
        One write at a time: while one is under way, the next due step tries again. A write that
        failed stops the learner here, as a failed step does."""
        if self.saving is not None:
            if not self.saving.done():
                return
            self.saving.result()
        version, started = self.trainer.version, time.monotonic()
        # Shielded and kept in `saving`: a stop that cancels the training loop must not close the
        # trainer under a copy still running in its thread (the service waits for `saving`).
        self.saving = asyncio.ensure_future(asyncio.to_thread(
            self.trainer.snapshot, list(self.held.trained.steps), {"ledger_seq": self.publication.ledger_seq}))
        snapshot = await asyncio.shield(self.saving)
        self.cadence.taken(version, started)
        self.saving = asyncio.ensure_future(self._write_checkpoint(snapshot, self.publishing, started))

    async def _write_checkpoint(self, snapshot: Snapshot, publication: asyncio.Future[None] | None,
                                started: float) -> None:
        version, root = snapshot.state.version, self.settings.checkpoint.dir
        tmp = await asyncio.to_thread(write_snapshot, root, snapshot)
        if publication is not None:
            await asyncio.wait({publication})
            if publication.cancelled() or publication.exception() is not None:
                log.warning("checkpoint_not_committed", version=version, reason="its version was not published")
                return
        final = checkpoint_path(root, version)
        await asyncio.to_thread(commit_checkpoint, tmp, final, self.settings.checkpoint.kept)
        self.checkpointed = self.status.checkpoint_version = version
        log.info("checkpoint_written", version=version, path=str(final), seconds=round(time.monotonic() - started, 3))

    async def wait_for_checkpoint(self, timeout_s: float) -> None:
        if self.saving is not None and not self.saving.done():
            log.info("waiting_for_checkpoint")
            await asyncio.wait({self.saving}, timeout=timeout_s)
