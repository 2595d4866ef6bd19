"""Following the newest message of each subject of a stream (WEIGHTS announcements, a run's
PROMOTIONS): an ordered consumer that delivers the last message per subject, then each new one,
and that is made again after every reconnect (maybe to another server of a cluster) rather than
trusting the old one's recovery."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import nats.errors
from nats.js import api

from policyloop.telemetry.logging import get_logger

if TYPE_CHECKING:
    from policyloop.bus.connection import Bus

log = get_logger(__name__)


class NewestPerSubject:
    """`ensure()` (called often: each turn of the owner's loop) keeps the subscription current;
    `on_message` gets each message. When the consumer cannot be made (a server restarting; in a
    cluster, making one needs the meta leader), the newest message is read directly, which needs
    only the stream's leader: a follower that missed its subscription would otherwise never see a
    new version. `subject` must be a single subject for that read; a wildcard subject skips it."""

    def __init__(self, bus: Bus, subject: str, on_message: Callable[[Any], Awaitable[None]]) -> None:
        self.bus, self.subject, self.on_message = bus, subject, on_message
        self.sub: Any = None
        self.generation = -1  # the bus's reconnect count when the subscription was made

    async def ensure(self) -> None:
        if self.sub is not None and self.generation == self.bus.reconnects:
            return
        self.generation = self.bus.reconnects
        await self.close()
        try:
            self.sub = await self.bus.js.subscribe(self.subject, cb=self.on_message, ordered_consumer=True,
                                                   deliver_policy=api.DeliverPolicy.LAST_PER_SUBJECT)
            return
        except (TimeoutError, nats.errors.Error) as exc:
            log.warning("subscribe_failed", subject=self.subject, error=repr(exc))
        if "*" in self.subject or ">" in self.subject:
            return
        try:
            stream = self.bus.topology.stream_for_subject(self.subject).name
            await self.on_message(await self.bus.js.get_last_msg(stream, self.subject))
        except (TimeoutError, nats.errors.Error):
            pass

    async def close(self) -> None:
        if self.sub is None:
            return
        sub, self.sub = self.sub, None
        try:
            await sub.unsubscribe()
        except (TimeoutError, nats.errors.Error):
            pass
