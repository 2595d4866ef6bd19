"""Checking a service's shared loop settings (model, max_lag, groups_per_step) against what the
running learner advertises in its heartbeat: a replica started with another max_lag would pace
against the wrong bound, one following another model would never see a version."""

from __future__ import annotations

import asyncio

from redis.exceptions import RedisError

from policyloop.contracts.v1 import status_pb2
from policyloop.runtime.settings import ServiceSettings
from policyloop.state import HeartbeatRegistry
from policyloop.telemetry.logging import get_logger

log = get_logger(__name__)


async def advertised_learner(heartbeats: HeartbeatRegistry) -> status_pb2.LearnerStatus | None:
    """The status of a running learner (None: none is up)."""
    for beat in await heartbeats.alive("learner"):
        if beat.WhichOneof("status") == "learner":
            return beat.learner
    return None


class LoopAgreement:
    """A health probe: unhealthy (and so taking no work) while a running learner advertises
    other shared settings than this service's. No learner up counts as agreement."""

    def __init__(self, settings: ServiceSettings, heartbeats: HeartbeatRegistry) -> None:
        self.settings, self.heartbeats = settings, heartbeats
        self.disagreement: str | None = None

    def probe(self) -> tuple[bool, str]:
        return self.disagreement is None, f"the learner's loop settings differ: {self.disagreement}"

    def agrees(self) -> bool:
        return self.disagreement is None

    async def check(self) -> None:
        try:
            learner = await advertised_learner(self.heartbeats)
        except RedisError as exc:
            log.warning("learner_status_unknown", error=repr(exc))
            return
        disagreement = None if learner is None else self.settings.loop_disagreement(learner.loop)
        if disagreement != self.disagreement:
            log.warning("loop_settings_differ" if disagreement else "loop_settings_agree", detail=disagreement)
        self.disagreement = disagreement

    async def run(self, stop: asyncio.Event, interval_s: float) -> None:
        while not stop.is_set():
            await self.check()
            try:
                await asyncio.wait_for(stop.wait(), interval_s)
            except TimeoutError:
                pass
