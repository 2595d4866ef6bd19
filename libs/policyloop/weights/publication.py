"""The write-ahead path of a model's versions, in one place for every learner mode (docs/recovery.md):

1. `record`: the step goes into LEDGER — before anyone can see the version it made;
2. `publish`: the version goes to colocated engines (when there are), then to the publisher (an
   exact delta from the last version it confirmed), then the version registry advances;
3. only then are the step's samples released (their messages acked), and their runs' figures
   written, off the step's path and in order.

A learner that dies anywhere in it loses nothing: a step recorded is replayed on resume, one not
recorded has its samples redelivered. The full model's learner, each LoRA run and each Tinker
model's sampler weights go through one VersionPublication each (a Tinker model records no step
in LEDGER: the TINKER stream, stored before a request is applied, is its write-ahead record).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from policyloop.ledger import StepRecord, record_trained
from policyloop.state.progress import record_progress
from policyloop.telemetry.phases import PhaseClock

if TYPE_CHECKING:
    import torch

    from policyloop.bus import Bus
    from policyloop.contracts.v1 import bus_pb2
    from policyloop.state import VersionRegistry
    from policyloop.state.progress import RunProgressStore
    from policyloop.weights.codec import WeightSet
    from policyloop.weights.push import PushReport, VersionPusher


class Broadcast(Protocol):
    """Engines a version goes to before the publisher (learner.colocated.ColocatedEngines)."""

    async def send(self, tensors: Mapping[str, torch.Tensor], version: int) -> None: ...


@dataclass(frozen=True)
class Version:
    """A recorded step's version, on its way to the publisher."""

    number: int
    step: int
    started_ns: int   # when its step began
    trained_ns: int   # when its weights were computed
    samples: Sequence[bus_pb2.Trajectory]


class VersionPublication:
    """One model's versions (the full model, a LoRA run's adapter, a Tinker model's): `release`
    acks a version's samples (HeldTrajectories.release), `sequence` gives a sample's stream
    sequence for LEDGER, `on_version` hears each version published. `versions` None: the model's
    versions are asked for by number (a Tinker model's sampler paths), not followed through the
    version registry."""

    def __init__(self, bus: Bus, model: str, run_id: str, instance_id: str, *, pusher: VersionPusher,
                 versions: VersionRegistry | None, progress: RunProgressStore | None = None,
                 colocated: Broadcast | None = None,
                 release: Callable[[Sequence[bus_pb2.Trajectory]], None] = lambda _: None,
                 sequence: Callable[[str], int] = lambda _: 0,
                 on_version: Callable[[int], None] = lambda _: None) -> None:
        self.bus, self.model, self.run_id, self.instance_id = bus, model, run_id, instance_id
        self.pusher, self.versions, self.progress, self.colocated = pusher, versions, progress, colocated
        self.release, self.sequence, self.on_version = release, sequence, on_version
        self.ledger_seq = 0          # LEDGER position of the newest step recorded
        self.figures_written: asyncio.Task[None] | None = None  # the newest progress update, in order

    async def record(self, step: int, version: int, weights: WeightSet, samples: Sequence[bus_pb2.Trajectory]) -> int:
        """Step 1: the step in LEDGER (its samples by id and stream sequence, its version's
        manifest hash); returns its LEDGER sequence."""
        self.ledger_seq = await record_trained(self.bus, self.model, self.run_id, self.instance_id, StepRecord(
            step=step, version=version, manifest_hash=weights.manifest_hash,
            trajectory_ids=tuple(t.trajectory_id for t in samples),
            stream_sequences=tuple(self.sequence(t.trajectory_id) for t in samples)))
        return self.ledger_seq

    async def publish(self, version: Version, weights: WeightSet, *, tensors: dict[str, torch.Tensor] | None = None,
                      clock: PhaseClock | None = None) -> PushReport:
        """Steps 2 and 3 for a recorded version. `clock` gets the colocated, push, registry and
        progress phases."""
        clock = clock or PhaseClock()
        if self.colocated is not None and tensors is not None:
            await self.colocated.send(tensors, version.number)
            clock.lap("colocated")
        pushed = await self.pusher.push(weights, version.step, trained_unix_ms=version.trained_ns // 1_000_000)
        clock.lap("push")
        if self.versions is not None:
            await self.versions.advance(self.model, version.number)
        self.on_version(version.number)
        self.release(version.samples)
        clock.lap("registry")
        if self.progress is not None and version.samples:
            self.write_figures_later(self.progress.record_step(version.step, version.number - 1, version.samples))
        clock.lap("progress")
        return pushed

    async def republish(self, weights: WeightSet | None, step: int, *, replayed: bool) -> PushReport | None:
        """After a resume to `weights`: when steps were replayed from LEDGER, the newest version may
        not have reached the publisher before the crash (LEDGER is written first), so it is pushed
        again (a copy the publisher holds is recognised). The next version goes as a delta from it."""
        if weights is None:
            return None
        pushed = None
        if replayed:
            self.pusher.confirmed = None
            pushed = await self.pusher.push(weights, step)
        self.pusher.confirmed = weights
        return pushed

    def write_figures_later(self, update: Awaitable[None]) -> None:
        """Figures for GetRun/WatchRun, off the step's path: written in order, after the update
        before them (nothing waits for them; the ledger, not Redis, is the record)."""
        previous = self.figures_written

        async def in_order() -> None:
            if previous is not None:
                await asyncio.gather(previous, return_exceptions=True)  # its failure was logged there
            await record_progress(update)

        self.figures_written = asyncio.create_task(in_order())

    async def figures(self) -> None:
        """Waits until the figures of every version published are written."""
        if self.figures_written is not None:
            await asyncio.gather(self.figures_written, return_exceptions=True)
