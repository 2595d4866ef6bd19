"""A learner of many LoRA runs over one frozen base (the many-runs mode).

Trajectories are held per run, unacknowledged, as the single-run learner holds them. Whenever
runs hold a full batch (their own groups_per_step), the fair share (learner.fair) picks one; its
adapter takes a step, and the version goes in the write-ahead order of the single-run learner —
LEDGER, then the publisher (under the run's adapter name, as an exact XOR delta of the adapter
tensors alone), then the version registry, then the samples' acks. Each run has its own version
sequence, staleness bound and drops; a run that is slow, or has no batch, holds up no other. A
run removed while it holds samples records them as dropped (reason `run_stopped`) before they
are acked, so every trajectory stays accounted for.

A run resumes as the single-run learner does, on its own: when it is added, its newest
checkpoint (every `checkpoint_every` of its versions) is loaded and the steps LEDGER recorded for
it after that are replayed from TRAJECTORIES, each reproducing its recorded manifest hash, so its
versions go on with no gap and no reuse.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from redis.exceptions import RedisError

from policyloop.bus import Bus, Delivery
from policyloop.contracts.v1 import bus_pb2, loop_pb2
from policyloop.learner.fair import FairShare
from policyloop.learner.held import (
    Groups,
    HeldTrajectories,
    refuse_unscored,
    refuse_untrainable,
    standings,
)
from policyloop.learner.start import VersionBehind
from policyloop.learner.tracking import NullTracker, RunTrackerOpener, Tracker, TrackerUnavailable, step_statistics
from policyloop.ledger import record_dropped
from policyloop.rl.batching import Admission, RecentSteps
from policyloop.rl.lora import RUN_FILE, AdapterTrainer, LoraSpec, RunTrainer, adapter_model_name, run_directory
from policyloop.rl.recovery import Resumed, ResumeError, resume
from policyloop.state.catalog import ENDED_STATES
from policyloop.state.outcomes import RUN_STOPPED, STALE
from policyloop.state.progress import record_progress
from policyloop.telemetry.logging import get_logger
from policyloop.weights.publication import Version, VersionPublication
from policyloop.weights.push import VersionPusher

if TYPE_CHECKING:
    from policyloop.state import VersionRegistry
    from policyloop.state.catalog import RunRegistry
    from policyloop.state.progress import RunProgressStore
    from policyloop.weights.client import WeightClient

log = get_logger(__name__)

class RunNotServed(Exception):
    """A trajectory of a run this learner has no adapter for (yet): handed back, retried later."""


@dataclass
class RunSlot:
    run_id: str
    model: str                 # its adapter versions' name in the publisher, LEDGER and the registry
    held: HeldTrajectories
    max_lag: int
    publication: VersionPublication
    dropped: int = 0
    resumed: Resumed | None = None
    tracker: Tracker = field(default_factory=NullTracker)  # the run's own tracker run


class AdapterLearner:
    def __init__(self, model: str, instance_id: str, trainer: AdapterTrainer, bus: Bus, *,
                 versions: VersionRegistry, publisher: WeightClient, dedupe_steps: int = 1000,
                 checkpoint_root: Path | None = None, checkpoint_every: int = 0, checkpoint_keep: int = 2,
                 progress: RunProgressStore, leftovers_check_s: float = 1.0,
                 turns: asyncio.Lock | None = None, open_tracker: RunTrackerOpener | None = None) -> None:
        """`open_tracker`: opens each run's tracker as the run is added (tracking.lora_run_trackers;
        None: no tracker)."""
        self.model, self.instance_id = model, instance_id
        self.open_tracker = open_tracker
        self.progress, self.leftovers_check_s = progress, leftovers_check_s
        self.checkpoint_root, self.checkpoint_every, self.checkpoint_keep = checkpoint_root, checkpoint_every, \
            checkpoint_keep
        self.trainer, self.bus, self.versions, self.publisher = trainer, bus, versions, publisher
        self.dedupe_steps = dedupe_steps
        self.slots: dict[str, RunSlot] = {}
        self.removed: set[str] = set()  # runs stopped here: what still arrives for them is dropped
        self.fair = FairShare()
        self._batch_ready = asyncio.Event()
        # The peft model changes under no step; the device is taken in turn with the other kinds
        # of run this process trains.
        self._trainer_lock = turns or asyncio.Lock()

    async def add_run(self, run_id: str, spec: LoraSpec, *, groups_per_step: int, max_lag: int,
                      weight: float = 1.0) -> RunSlot:
        """Serves a new run from now on: its adapter starts at the base (version 0)."""
        if run_id in self.slots:
            raise ValueError(f"run {run_id!r} is served already")
        name = adapter_model_name(self.model, run_id)
        checkpoints = None if self.checkpoint_root is None else self.checkpoint_root / run_directory(run_id)
        async with self._trainer_lock:
            await asyncio.to_thread(self.trainer.add_run, run_id, spec)
            try:
                resumed = await resume(RunTrainer(self.trainer, run_id), self.bus, name, checkpoints, RUN_FILE)
            except BaseException:
                await asyncio.to_thread(self.trainer.remove_run, run_id)
                raise
        held = HeldTrajectories(groups_per_step, RecentSteps(self.dedupe_steps, resumed.recent_steps))
        publication = VersionPublication(self.bus, name, run_id, self.instance_id,
                                         pusher=VersionPusher(self.publisher, name, run_id=run_id),
                                         versions=self.versions, progress=self.progress, release=held.release,
                                         sequence=held.sequence)
        publication.ledger_seq = resumed.ledger_seq
        slot = RunSlot(run_id, name, held, max_lag, publication, resumed=resumed,
                       tracker=await self._run_tracker(run_id, spec, groups_per_step, max_lag))
        await self._publish_resumed(slot, resumed)
        self.removed.discard(run_id)
        self.slots[run_id] = slot
        self.fair.add(run_id, weight)
        log.info("run_added", run=run_id, adapter=name, rank=spec.rank, groups_per_step=groups_per_step)
        return slot

    async def _run_tracker(self, run_id: str, spec: LoraSpec, groups_per_step: int, max_lag: int) -> Tracker:
        """The run's tracker, open; a NullTracker without one, or when it cannot open (a tracker
        never stops training: the learner checked its backend when it started)."""
        if self.open_tracker is None:
            return NullTracker()
        run_settings = {"lora.rank": spec.rank, "lora.alpha": spec.alpha, "groups_per_step": groups_per_step,
                        "lora.target_modules": ",".join(spec.target_modules), "max_lag": max_lag}
        try:
            return await asyncio.to_thread(self.open_tracker, run_id, run_settings)
        except TrackerUnavailable as exc:
            log.warning("run_tracker_unavailable", run=run_id, error=str(exc))
            return NullTracker()

    async def _publish_resumed(self, slot: RunSlot, resumed: Resumed) -> None:
        """The newest replayed version may not have reached the publisher before the crash (LEDGER
        is written first): it is pushed again (a copy the publisher holds is recognised)."""
        version = self.trainer.run(slot.run_id).version
        registered = await self.versions.get(slot.model)
        if registered > version:  # training an older adapter under a later number would publish a regression
            raise VersionBehind(f"{slot.model} is at version {registered} but run {slot.run_id!r} resumes only to "
                                f"version {version}: is another learner serving it, or were checkpoints lost?")
        await slot.publication.republish(resumed.weights, self.trainer.run(slot.run_id).steps,
                                         replayed=bool(resumed.replayed))
        if version > registered:
            await self.versions.advance(slot.model, version)

    async def remove_run(self, run_id: str) -> None:
        """Stops serving a run: what it holds is recorded as dropped and acked; its adapter is freed."""
        slot = self.slots.pop(run_id)
        self.removed.add(run_id)
        self.fair.remove(run_id)
        held = slot.held.collector
        groups = list(held.complete.values()) + [list(members.values()) for members in held.groups.values()]
        await self._drop(slot, groups, RUN_STOPPED)
        await slot.publication.figures()
        async with self._trainer_lock:
            await asyncio.to_thread(self.trainer.remove_run, run_id)
        await asyncio.to_thread(slot.tracker.close)
        log.info("run_removed", run=run_id, dropped_samples=sum(len(g) for g in groups))

    async def admit(self, delivery: Delivery[bus_pb2.TrajectoryGroup]) -> None:
        """Handles one group's delivery (the pull worker acks when this returns): held until its
        run's step made a stored version, or it was dropped, or recognised as a copy of one that was."""
        group = delivery.message.trajectories
        refuse_unscored(group)
        run_id = group[0].run_id  # every member's (validate_group)
        slot = self.slots.get(run_id)
        if slot is None and run_id in self.removed:
            await record_dropped(self.bus, adapter_model_name(self.model, run_id), run_id, self.instance_id,
                                 RUN_STOPPED, [(t.trajectory_id, delivery.stream_seq) for t in group])
            await record_progress(self.progress.record_dropped(group, RUN_STOPPED))
            return
        if slot is None:
            raise RunNotServed(f"run {run_id!r} has no adapter on this learner")
        refuse_untrainable(group, self.trainer.limits)
        admissions = [slot.held.add(traj, delivery.stream_seq) for traj in group]
        if Admission.COMPLETE in admissions:
            self._batch_ready.set()
        await slot.held.until_all_released([t.trajectory_id for t in group])

    def ready(self) -> list[str]:
        return [run_id for run_id, slot in self.slots.items()
                if slot.held.collector.has_batch(slot.held.groups_per_step)]

    async def run(self, stop: asyncio.Event) -> None:
        """Steps the run the fair share picks whenever one holds a full batch — or its last groups,
        which fill none — until `stop`."""
        stopping = asyncio.ensure_future(stop.wait())
        try:
            while not stop.is_set():
                self._batch_ready.clear()
                chosen = self.fair.pick(self.ready())
                if chosen is not None:
                    await self.step(chosen)
                    continue
                waiting = asyncio.ensure_future(self._batch_ready.wait())
                await asyncio.wait({waiting, stopping}, timeout=self.leftovers_check_s,
                                   return_when=asyncio.FIRST_COMPLETED)
                waiting.cancel()
                if not waiting.done() and not stop.is_set():
                    for run_id in await self.leftovers():
                        await self.step(run_id, last=True)
        finally:
            stopping.cancel()
            for slot in self.slots.values():
                await asyncio.to_thread(slot.tracker.close)

    async def leftovers(self) -> list[str]:
        """The runs whose every task not yet accounted for is held here, complete (their last
        groups, which fill no batch)."""
        held = {run_id: slot.held.collector.complete_groups for run_id, slot in self.slots.items()}
        held = {run_id: complete for run_id, complete in held.items() if complete}
        return [run_id for run_id, standing in (await standings(self.progress.outcomes, held)).items()
                if standing.all_held(held[run_id])]

    async def step(self, run_id: str, *, last: bool = False) -> int:
        """One step of `run_id`'s adapter on its oldest full batch (`last`: on what it holds, its
        last groups); returns its new version (the current one when every group of the batch was
        stale). The batch is of one kind: demonstrations or policy samples (GroupCollector.take)."""
        slot = self.slots[run_id]
        run = self.trainer.run(run_id)
        fresh, stale = slot.held.take(run.version, slot.max_lag, {run_id} if last else None)
        await self._drop(slot, stale, STALE)
        if fresh:
            await self._train(slot, fresh)
        return run.version

    async def _train(self, slot: RunSlot, groups: Groups) -> None:
        """One step of the run's adapter on `groups`, in the write-ahead order (learner.publication)."""
        from policyloop.weights.torch_io import weight_set

        run_id, run = slot.run_id, self.trainer.run(slot.run_id)
        samples = [t for group in groups for t in group]
        started_ns = time.time_ns()
        async with self._trainer_lock:
            report = await asyncio.to_thread(self.trainer.step, run_id, groups)
            tensors = await asyncio.to_thread(self.trainer.export_adapter, run_id)
        weights = await asyncio.to_thread(weight_set, run.version, tensors)
        trained_ns = time.time_ns()
        await slot.publication.record(report.step, run.version, weights, samples)
        pushed = await slot.publication.publish(Version(run.version, report.step, started_ns, trained_ns, samples),
                                                weights)
        if self.checkpoint_root is not None and self.checkpoint_every and run.version % self.checkpoint_every == 0:
            async with self._trainer_lock:
                await asyncio.to_thread(self.trainer.save, self.checkpoint_root, run_id,
                                        list(slot.held.trained.steps), {"ledger_seq": slot.publication.ledger_seq},
                                        self.checkpoint_keep)
        slot.tracker.log_step(report.step, step_statistics(report, (time.time_ns() - started_ns) / 1e9, samples,
                                                           run.version - 1))
        log.info("run_step", run=run_id, step=report.step, version=run.version, loss=round(report.loss, 5),
                 mean_reward=round(report.mean_reward, 4), pushed=pushed.kind, payload_bytes=pushed.payload_bytes)

    async def _drop(self, slot: RunSlot, groups: Groups, reason: str) -> None:
        for group in groups:
            if not group:
                continue
            await record_dropped(self.bus, slot.model, slot.run_id, self.instance_id, reason,
                                 [(t.trajectory_id, slot.held.sequence(t.trajectory_id)) for t in group])
            slot.dropped += len(group)
            await record_progress(self.progress.record_dropped(group, reason))
            slot.held.release(group)


SERVED_STATES = (loop_pb2.RUN_STATE_RUNNING, loop_pb2.RUN_STATE_FINISHED)  # finished: a copy may still come


async def follow_runs(learner: AdapterLearner, runs: RunRegistry, stop: asyncio.Event, *, groups_per_step: int,
                      max_lag: int, poll_s: float = 1.0) -> None:
    """Serves the cluster's LoRA runs as the gateway starts and stops them (its run registry):
    a running run with a LoRA spec is added (resumed, if it trained before), a stopped or failed
    one removed. A run whose adapter cannot be made is marked failed, with the reason."""
    while not stop.is_set():
        try:
            await _follow_once(learner, runs, groups_per_step=groups_per_step, max_lag=max_lag)
        except RedisError as exc:
            log.warning("runs_not_read", error=repr(exc))
        try:
            await asyncio.wait_for(stop.wait(), timeout=poll_s)
        except TimeoutError:
            pass


async def _follow_once(learner: AdapterLearner, runs: RunRegistry, *, groups_per_step: int, max_lag: int) -> None:
    for run_id in await runs.run_ids():
        state = await runs.state(run_id)
        if run_id in learner.slots:
            if state in ENDED_STATES:
                await learner.remove_run(run_id)
            continue
        if state not in SERVED_STATES or run_id in learner.removed:
            continue
        definition = await runs.definition(run_id)
        if definition is None or not definition.HasField("lora"):
            continue
        try:
            await learner.add_run(run_id, LoraSpec.from_proto(definition.lora), groups_per_step=groups_per_step,
                                  max_lag=definition.max_lag if definition.HasField("max_lag") else max_lag)
        except (ValueError, VersionBehind, ResumeError) as exc:
            log.error("run_not_served", run=run_id, error=str(exc))
            learner.removed.add(run_id)
            await runs.set_state(run_id, loop_pb2.RUN_STATE_FAILED, f"the learner cannot train it: {exc}")
