"""What the version store quarantines (see policyloop.weights.store) also goes to DLQ (origin
WEIGHTS, the model's weights subject; the payload is the quarantine's reason record). The store
finds damage in worker threads: `Reports` runs the dead-lettering on the service's loop."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

from policyloop.bus import Bus, weights_subject
from policyloop.bus.deadletter import publish_dead_letter
from policyloop.telemetry.logging import get_logger
from policyloop.weights.store import Quarantine

log = get_logger(__name__)


async def dead_letter_quarantine(bus: Bus, quarantine: Quarantine) -> None:
    """A quarantined store entry on DLQ. A stored file has no stream sequence: the incident
    number (unique per quarantine) stands in for it, which keeps the dead letter's id unique and
    a retried publish deduplicated."""
    try:
        await publish_dead_letter(
            bus, origin_stream="WEIGHTS", origin_subject=weights_subject(quarantine.model),
            stream_seq=quarantine.incident, consumer="", payload=quarantine.to_json().encode(),
            headers={"model": quarantine.model, "version": str(quarantine.version), "what": quarantine.what,
                     "quarantine": quarantine.directory},
            reason=f"version {quarantine.version} of {quarantine.model}: {quarantine.what} {quarantine.reason}",
            kind="weights_quarantined", delivery_count=0, service="publisher",
        )
    except Exception as exc:  # the quarantine itself is on disk, logged and counted already
        log.error("quarantine_dead_letter_failed", model=quarantine.model, version=quarantine.version,
                  error=repr(exc))


Report = Callable[[], Coroutine[Any, Any, None]]


class Reports:
    """Runs reports on the service's loop, whichever thread found what to report (the store
    checks files in worker threads)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.pending: set[asyncio.Task[None]] = set()

    def submit(self, report: Report) -> None:
        self.loop.call_soon_threadsafe(self._start, report)

    def _start(self, report: Report) -> None:
        task = self.loop.create_task(report())
        self.pending.add(task)
        task.add_done_callback(self.pending.discard)

    async def drain(self) -> None:
        while self.pending:
            await asyncio.gather(*self.pending, return_exceptions=True)


def quarantine_reporter(bus: Bus, reports: Reports) -> Callable[[Quarantine], None]:
    """The store's `on_quarantine` callback: dead-letters each quarantine from any thread."""

    def on_quarantine(quarantine: Quarantine) -> None:
        reports.submit(lambda: dead_letter_quarantine(bus, quarantine))

    return on_quarantine
