"""Bringing a fresh trainer to the loop's version before it takes work."""

from __future__ import annotations

from typing import TYPE_CHECKING

from policyloop.rl.recovery import Resumed, resume
from policyloop.telemetry.logging import get_logger

if TYPE_CHECKING:
    from policyloop.bus import Bus
    from policyloop.learner.settings import LearnerSettings
    from policyloop.rl.trainer import PolicyTrainer
    from policyloop.state import VersionRegistry

log = get_logger(__name__)


class VersionBehind(RuntimeError):
    """The registry says the loop is past what this learner can resume: it must not train."""


async def start_version(settings: LearnerSettings, trainer: PolicyTrainer, bus: Bus,
                        versions: VersionRegistry) -> Resumed:
    """Resumed from checkpoint and ledger, or the base weights at version 0. The registry follows
    the learner (it may be behind after a Redis restart); a registry ahead of what can be
    resumed means another learner runs or checkpoints were lost."""
    registered = await versions.get(settings.model)
    if settings.checkpoint.resume:
        resumed = await resume(trainer, bus, settings.model, settings.checkpoint.dir)
    else:
        resumed = Resumed(checkpoint=None, checkpoint_version=0)
    if registered > trainer.version:
        # Training the base weights (or an old checkpoint) under a later version number would
        # publish a regression.
        how = "from checkpoint and ledger" if settings.checkpoint.resume else "without resume (the base weights)"
        raise VersionBehind(f"{settings.model} is at version {registered} but this learner reaches only version "
                            f"{trainer.version} {how}; is another learner running, or were checkpoints lost?")
    if trainer.version > registered:
        await versions.advance(settings.model, trainer.version)
    log.info("learner_resumed", version=trainer.version, checkpoint=str(resumed.checkpoint or ""),
             checkpoint_version=resumed.checkpoint_version, replayed=len(resumed.replayed))
    return resumed
