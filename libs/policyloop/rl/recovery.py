"""Resuming a learner: the newest checkpoint, then the steps the ledger recorded after it.

The learner records every step in LEDGER (which TRAJECTORIES sequences, which version, which
manifest hash) before it publishes the version, and checkpoints only every few steps. A learner
that starts again therefore loads its newest checkpoint and replays the steps recorded after it
from the same trajectories, read straight from TRAJECTORIES. A step is deterministic given the
weights, the optimizer state and the batch, so each replayed version must come out with the
manifest hash it was published under; the version sequence goes on with no gap and no reuse.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from policyloop.ledger import StepRecord, regroup, stored_trajectories, trained_steps
from policyloop.rl.checkpoint import latest_checkpoint
from policyloop.telemetry.logging import get_logger
from policyloop.weights.codec import WeightSet

if TYPE_CHECKING:
    import torch

    from policyloop.bus import Bus
    from policyloop.contracts.v1 import bus_pb2
    from policyloop.rl.trainer import PolicyTrainer

log = get_logger(__name__)


class ResumeError(RuntimeError):
    """The learner cannot reach the version the loop is at: it must not train on."""


@dataclass
class Resumed:
    checkpoint: Path | None
    checkpoint_version: int
    replayed: list[int] = field(default_factory=list)      # versions replayed from the ledger
    ledger_seq: int = 0                                       # LEDGER position of the newest step
    recent_steps: list[list[str]] = field(default_factory=list)  # trained ids per step, oldest first
    weights: WeightSet | None = None                          # the resumed version's weights (None: base)


class Replayable(Protocol):
    """What a resume steps: a trainer of one policy version sequence (PolicyTrainer, or one LoRA
    run of an AdapterTrainer, rl.lora.RunTrainer)."""

    @property
    def version(self) -> int: ...

    def restore(self, directory: Path) -> Any: ...

    def step(self, groups: Sequence[Sequence[bus_pb2.Trajectory]]) -> Any: ...

    def export_tensors(self) -> dict[str, torch.Tensor]: ...


async def resume(trainer: PolicyTrainer | Replayable, bus: Bus, model: str, checkpoint_dir: Path | None,
                 checkpoint_record: str = "trainer.json") -> Resumed:
    """Brings `trainer` (fresh, at the base weights) to the newest version the ledger recorded
    for `model`: its newest checkpoint under `checkpoint_dir`, then the steps recorded after it."""
    from policyloop.weights.torch_io import weight_set

    directory = latest_checkpoint(checkpoint_dir, checkpoint_record) if checkpoint_dir is not None else None
    resumed = Resumed(checkpoint=directory, checkpoint_version=0)
    if directory is not None:
        state = await asyncio.to_thread(trainer.restore, directory)
        resumed.checkpoint_version = state.version
        resumed.ledger_seq = int(state.extra.get("ledger_seq", 0))
        resumed.recent_steps = state.trained_ids
    records = [r for r in await trained_steps(bus, model, resumed.ledger_seq) if r.version > trainer.version]
    for record in records:
        resumed.weights = await replay_step(trainer, bus, record)
        resumed.replayed.append(record.version)
        resumed.recent_steps.append(list(record.trajectory_ids))
        resumed.ledger_seq = record.ledger_seq
    if resumed.weights is None and trainer.version > 0:
        resumed.weights = await asyncio.to_thread(weight_set, trainer.version, await asyncio.to_thread(
            trainer.export_tensors))
    return resumed


async def replay_step(trainer: PolicyTrainer | Replayable, bus: Bus, record: StepRecord) -> WeightSet:
    """Takes the recorded step again on the same trajectories; the result must be the version
    that was recorded (and maybe published) bit for bit."""
    from policyloop.weights.torch_io import weight_set

    if record.version != trainer.version + 1:
        raise ResumeError(f"the ledger's next step makes version {record.version}, but the trainer is at "
                          f"{trainer.version}: a step is missing from LEDGER")
    try:
        samples = await stored_trajectories(bus, record.trajectory_ids, record.stream_sequences)
    except (LookupError, ValueError) as exc:
        raise ResumeError(f"cannot replay step {record.step}: {exc}") from exc
    await asyncio.to_thread(trainer.step, regroup(samples))
    weights = await asyncio.to_thread(weight_set, trainer.version, await asyncio.to_thread(trainer.export_tensors))
    if weights.manifest_hash != record.manifest_hash:
        raise ResumeError(f"replaying step {record.step} made version {record.version} with manifest "
                          f"{weights.manifest_hash}, not the recorded {record.manifest_hash}: the step is not "
                          "deterministic here")
    log.info("step_replayed", step=record.step, version=record.version)
    return weights
