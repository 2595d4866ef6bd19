"""Bringing a fresh trainer to the loop's version before it takes work."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from policyloop.rl.recovery import Resumed, resume
from policyloop.telemetry.logging import get_logger

if TYPE_CHECKING:
    from policyloop.bus import Bus
    from policyloop.learner.settings import LearnerSettings
    from policyloop.rl.trainer import PolicyTrainer
    from policyloop.state import VersionRegistry

log = get_logger(__name__)
# Most stream sequences named in one hand-back (what lies below them waits for the ack wait).
RECLAIM_SPAN = 100_000


class VersionBehind(RuntimeError):
    """The registry says the loop is past what this learner can resume: it must not train."""


async def start_version(settings: LearnerSettings, trainer: PolicyTrainer, bus: Bus,
                        versions: VersionRegistry) -> Resumed:
    """Resumed from checkpoint and ledger, or the base weights at version 0. The registry follows
    the learner (it may be behind after a Redis restart); a registry ahead of what can be
    resumed means another learner runs or checkpoints were lost."""
    registered = await versions.get(settings.model)
    started = time.monotonic()
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
             checkpoint_version=resumed.checkpoint_version, replayed=len(resumed.replayed),
             seconds=round(time.monotonic() - started, 3))
    return resumed


async def reclaim_held(bus: Bus, durable: str = "learner") -> int:
    """Hands back at once what the learner before this one held unacked when it died, instead of
    after the consumer's ack wait (its trajectories are a batch this learner could be training).

    A nak is honoured by JetStream from any connection that names the message in the ack
    subject (`$JS.ACK.<stream>.<consumer>.<deliveries>.<stream seq>.<consumer seq>.…`): a
    pending stream sequence, and a delivery sequence between the ack floor and the newest
    delivery. Every sequence above the ack floor is named; the server ignores those not pending.
    The effect is the ack wait lapsing early, which the in-flight rule already allows for at any
    moment (docs/recovery.md). Called before this learner pulls anything, so it names only its
    predecessors' messages. Returns how many messages were pending."""
    spec = bus.topology.consumers[durable]
    info = await bus.js.consumer_info(spec.stream, spec.durable)
    pending = info.num_ack_pending or 0
    if not pending or info.delivered is None or info.ack_floor is None:
        return 0
    last = info.delivered.stream_seq or 0
    first = max((info.ack_floor.stream_seq or 0) + 1, last - RECLAIM_SPAN + 1)
    delivery = info.delivered.consumer_seq or 0
    for sequence in range(first, last + 1):
        await bus.nc.publish(f"$JS.ACK.{spec.stream}.{spec.durable}.1.{sequence}.{delivery}.0.0", b"-NAK")
    await bus.nc.flush()
    log.info("held_reclaimed", pending=pending, first=first, last=last)
    return pending
