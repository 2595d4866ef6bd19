"""Whether the replica's engine answers, and bringing one that came back to a policy version."""

from __future__ import annotations

import asyncio
import subprocess
import time
from collections.abc import Awaitable, Callable

from policyloop.engines.sglang_client import EngineError, EngineUnavailable, SGLangClient
from policyloop.telemetry.logging import get_logger
from policyloop.telemetry.metrics import ENGINE_LOAD

log = get_logger(__name__)


class EngineHealth:
    """Whether the engine answers /health (and, when this replica started it, still runs). While
    it does not, the replica reports unhealthy and takes no new Task; a sample whose engine went
    away waits for it (`wait_recovered`). An engine that comes back is brought to a policy
    version again (`resync`): a restarted SGLang serves its base weights as "default"."""

    def __init__(self, client: SGLangClient, interval_s: float, proc: subprocess.Popen | None,
                 resync: Callable[[], Awaitable[None]]) -> None:
        self.client, self.interval_s, self.proc, self.resync = client, interval_s, proc, resync
        self.answering = True
        self.recovered = asyncio.Event()
        self.recovered.set()

    def probe(self) -> tuple[bool, str]:
        if self.proc is not None and self.proc.poll() is not None:
            return False, f"the embedded engine exited with {self.proc.returncode}"
        return self.answering, f"the engine at {self.client.base_url} does not answer /health"

    def ready(self) -> bool:
        return self.recovered.is_set() and self.probe()[0]

    async def check(self) -> None:
        answering = await self.client.health(timeout_s=max(1.0, self.interval_s))
        if answering != self.answering:
            log.warning("engine_health_changed", healthy=answering, engine=self.client.base_url)
        if not answering:
            self.recovered.clear()
        elif self.recovered.is_set() and not await self._has_a_version():
            # Restarted between two probes (or behind a load balancer): back at "default".
            log.warning("engine_restart_seen", engine=self.client.base_url)
            self.recovered.clear()
        if answering and not self.recovered.is_set():
            try:
                await self.resync()
            except EngineError as exc:
                log.warning("engine_resync_failed", error=repr(exc))
                answering = False
            else:
                self.recovered.set()
        self.answering = answering
        if answering:
            await self._report_load()

    async def _report_load(self) -> None:
        load = await self.client.load(timeout_s=max(1.0, self.interval_s))
        if load is None:
            return
        for figure in ("queued_requests", "running_requests", "kv_used_tokens", "kv_usage"):
            value = getattr(load, figure)
            if value is not None:
                ENGINE_LOAD.labels(figure).set(value)

    async def _has_a_version(self) -> bool:
        try:
            version = (await self.client.model_info()).weight_version
        except EngineError:
            return True  # unknown: /health answered, the next probe asks again
        return bool(version) and version.isdigit()

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            if self.proc is not None and self.proc.poll() is not None:
                # The replica's own engine died: the replica fails (and is restarted with a new one).
                stop.set()
                raise EngineUnavailable(f"the embedded engine exited with {self.proc.returncode}")
            await self.check()
            try:
                await asyncio.wait_for(stop.wait(), self.interval_s)
            except TimeoutError:
                pass

    async def wait_recovered(self, deadline: float, stop: asyncio.Event) -> bool:
        """After a call failed because the engine went away: whether it answers again (and was
        resynced) before `deadline` (monotonic). False at once when the engine still answers:
        then the request itself failed (e.g. timed out), which waiting does not mend."""
        if await self.client.health(timeout_s=max(1.0, self.interval_s)) and await self._has_a_version():
            return False
        self.recovered.clear()
        while not stop.is_set() and time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                return False  # the replica's own engine died: the replica fails and restarts
            await self.check()
            if self.recovered.is_set():
                return True
            await asyncio.sleep(self.interval_s)
        return False

