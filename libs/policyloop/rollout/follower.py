"""Following WEIGHTS: the newest announced version is fetched (a delta from the held one when
possible), verified tensor by tensor, and loaded into the engine, one load at a time. Versions
announced meanwhile are skipped, never applied out of order. A serving replica follows its run's
PROMOTIONS instead: the version the newest promotion names, older or newer (a rollback)."""

from __future__ import annotations

import asyncio
import shutil
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from policyloop.bus import promotions_subject, weights_subject
from policyloop.bus.newest import NewestPerSubject
from policyloop.common.clock import now_ms
from policyloop.contracts.v1 import bus_pb2, loop_pb2, status_pb2
from policyloop.engines.embedded_client import EmbeddedEngineClient
from policyloop.engines.sglang_client import EngineUnavailable, SGLangClient
from policyloop.rollout.engine_process import engine_version, name_base_version
from policyloop.rollout.settings import RolloutSettings
from policyloop.runtime import ServiceContext
from policyloop.telemetry.logging import get_logger
from policyloop.telemetry.metrics import (
    VERSION_LOAD_PHASE_SECONDS,
    WEIGHT_ACTIVATION_PAUSE_SECONDS,
    WEIGHT_PAYLOAD_BYTES,
    WEIGHT_SYNC_FALLBACKS,
    WEIGHT_SYNC_SECONDS,
    WEIGHTS_SERVING_DELAY,
    WEIGHTS_STEP_TO_SERVING,
)
from policyloop.telemetry.phases import PhaseClock
from policyloop.weights.client import WeightClient
from policyloop.weights.codec import WeightSet
from policyloop.weights.relay import RelayHoldings
from policyloop.weights.sync import sync_weights
from policyloop.weights.tree import TreeSync, sync_through_tree

log = get_logger(__name__)


@dataclass(frozen=True)
class Announcements:
    """What a follower loads: a model's newest version (WEIGHTS), or whichever version the newest
    of a run's promotions names (PROMOTIONS: a rollback goes back)."""

    subject: str
    parse: Callable[[bytes], bus_pb2.WeightsPublished]
    newest_only: bool


def newest_versions(model: str) -> Announcements:
    return Announcements(weights_subject(model), bus_pb2.WeightsPublished.FromString, newest_only=True)


def promoted_versions(run_id: str) -> Announcements:
    return Announcements(promotions_subject(run_id), lambda data: loop_pb2.Promotion.FromString(data).weights,
                         newest_only=False)


class WeightFollower:
    """Loads the announced version into the engine, one load at a time."""

    def __init__(self, ctx: ServiceContext, settings: RolloutSettings, client: SGLangClient,
                 status: status_pb2.RolloutStatus, announcements: Announcements | None = None, *,
                 base_dir: Path | None = None, relay: RelayHoldings | None = None, relay_endpoint: str = "") -> None:
        self.ctx, self.settings, self.client, self.status = ctx, settings, client, status
        # Relayed fan-out (settings.relay): what this replica serves its children, and where.
        self.relay, self.relay_endpoint = relay, relay_endpoint
        self._trees: dict[str, TreeSync] = {}
        self._joining: list[asyncio.Task[None]] = []  # each tree's membership, renewed between versions
        # The base policy's directory (settings.model_path as the service resolved it): its config
        # goes beside each version written for the engine.
        self.base_dir = base_dir if base_dir is not None else Path(settings.model_path)
        self.announcements = announcements or newest_versions(settings.model)
        self.latest: bus_pb2.WeightsPublished | None = None
        self.announced = asyncio.Event()
        self.loaded_dir: Path | None = None
        self.held: WeightSet | None = None  # the served version's bytes: the base of the next delta
        self._publishers: dict[str, WeightClient] = {}
        self._resyncing = asyncio.Lock()  # the health loop and waiting samples may all ask at once

    def publisher(self, endpoint: str) -> WeightClient:
        """One channel per publisher endpoint, kept across versions (one fetch per step)."""
        if endpoint not in self._publishers:
            self._publishers[endpoint] = WeightClient(endpoint, bearer_token=self.settings.publisher_token)
        return self._publishers[endpoint]

    def tree(self, endpoint: str) -> TreeSync:
        """This replica's place in the fan-out tree of the publisher at `endpoint`."""
        if endpoint not in self._trees:
            relay = self.settings.relay
            tree = self._trees[endpoint] = TreeSync(
                self.publisher(endpoint), model=self.settings.model, replica=self.settings.instance_id,
                relay_endpoint=self.relay_endpoint, node=relay.node, zone=relay.zone,
                parent_deadline_s=relay.parent_deadline_s, bearer_token=self.settings.publisher_token)
            self._joining.append(asyncio.create_task(tree.keep_joined(self.ctx.stop)))
        return self._trees[endpoint]

    async def on_event(self, msg) -> None:  # type: ignore[no-untyped-def]
        event = self.announcements.parse(msg.data)
        if self.latest is None or not self.announcements.newest_only or event.version > self.latest.version:
            self.latest = event
            self.status.announced_version = event.version
            log.info("weights_announced", version=event.version, endpoint=event.fetch_endpoint)
            self.announced.set()

    async def run(self) -> None:
        announcements = NewestPerSubject(self.ctx.bus, self.announcements.subject, self.on_event)
        try:
            while not self.ctx.stop.is_set():
                await announcements.ensure()
                waiter = asyncio.create_task(self.announced.wait())
                stopper = asyncio.create_task(self.ctx.stop.wait())
                await asyncio.wait({waiter, stopper}, return_when=asyncio.FIRST_COMPLETED, timeout=1.0)
                waiter.cancel()
                stopper.cancel()
                if not self.announced.is_set():
                    continue
                self.announced.clear()
                event = self.latest
                if event is None or not self.wants(event) or self.ctx.stop.is_set():
                    continue
                try:
                    await self.load(event)
                except Exception as exc:  # noqa: BLE001 - keep serving the current version, retry
                    log.error("weights_load_failed", version=event.version, error=repr(exc))
                    await asyncio.sleep(1.0)
                    self.announced.set()
        finally:
            await announcements.close()
            for task in self._joining:
                task.cancel()
            for tree in self._trees.values():
                await tree.close()
            for client in self._publishers.values():
                await client.close()

    def wants(self, event: bus_pb2.WeightsPublished) -> bool:
        """Whether the engine must load the announced version."""
        if self.announcements.newest_only:
            return event.version > self.ctx.policy_version
        return event.version != self.ctx.policy_version

    async def resync(self) -> None:
        """After the engine answered again: it may have restarted on its base weights, so the
        newest version is loaded again before the engine counts as recovered, and nothing is
        sampled on stale weights. Raises EngineUnavailable when that takes too long."""
        async with self._resyncing:
            served = await name_base_version(self.client)
            if served != self.ctx.policy_version:
                log.warning("engine_version_lost", was=self.ctx.policy_version, now=served)
                self.ctx.policy_version = served
                self.announced.set()
            deadline = time.monotonic() + self.settings.engine_start_timeout_s
            while self.behind() and time.monotonic() < deadline and not self.ctx.stop.is_set():
                await asyncio.sleep(0.1)
            if self.behind():
                raise EngineUnavailable(f"the restarted engine did not load version {self.latest.version} in time")

    def behind(self) -> bool:
        return self.latest is not None and self.wants(self.latest)

    async def load(self, event: bus_pb2.WeightsPublished) -> None:
        await self._load(event)
        if self.ctx.policy_version != event.version:
            return
        served = now_ms()
        if event.published_unix_ms:
            WEIGHTS_SERVING_DELAY.observe(max(0.0, (served - event.published_unix_ms) / 1000))
        if event.trained_unix_ms:
            WEIGHTS_STEP_TO_SERVING.observe(max(0.0, (served - event.trained_unix_ms) / 1000))

    async def _load(self, event: bus_pb2.WeightsPublished) -> None:
        if self.settings.weight_source == "colocated":
            if await self.wait_for_broadcast(event.version):
                return
            log.warning("weights_broadcast_missing", version=event.version, waited_s=self.settings.colocated_wait_s)
            await self.fetch_and_load(event)
            await self.client.continue_generation()  # a failed broadcast leaves the engine paused
            return
        await self.fetch_and_load(event)

    async def wait_for_broadcast(self, version: int) -> bool:
        """Whether the engine reports `version` (or a later one) within colocated_wait_s."""
        started = time.monotonic()
        while time.monotonic() - started < self.settings.colocated_wait_s and not self.ctx.stop.is_set():
            served = engine_version(await self.client.model_info())
            if served >= version:
                self.held = None  # the engine's bytes came by broadcast: a later fetch starts from a keyframe
                self.ctx.policy_version = served
                log.info("weights_loaded", version=served, kind="colocated",
                         seconds=round(time.monotonic() - started, 3))
                return True
            await asyncio.sleep(0.05)
        return False

    async def _into_engine(self, weights: WeightSet, clock: PhaseClock) -> None:
        """The verified weights into the engine: made into the request's safetensors bytes or
        written as a directory (phase "write"); then staged beside the served weights while the
        engine generates and swapped in between two steps (weight_activation swap: phases "stage",
        "activate"), or pause → update → continue, as SGLang wants it (phases "pause", "load",
        "continue"). Either way the update is checked against /model_info afterwards."""
        from policyloop.weights import torch_io  # torch, which only loading needs

        version = str(weights.version)
        payload: bytes | None = None
        directory: Path | None = None
        if self.settings.weight_load == "tensors":
            payload = await asyncio.to_thread(torch_io.safetensors_bytes, weights)
        else:
            directory = await asyncio.to_thread(torch_io.write_version_dir, self.settings.weights_dir /
                                                self.settings.instance_id, self.base_dir, weights)
        clock.lap("write")
        if self.settings.activation == "swap":
            await self._swap(payload, directory, version, clock)
        else:
            await self._pause_and_load(payload, directory, version, clock)
        previous, self.loaded_dir = self.loaded_dir, directory
        if previous is not None and previous != directory:
            shutil.rmtree(previous, ignore_errors=True)

    async def _swap(self, payload: bytes | None, directory: Path | None, version: str, clock: PhaseClock) -> None:
        engine = self.client
        if not isinstance(engine, EmbeddedEngineClient):
            raise TypeError("weight_activation swap needs the embedded engine's client "
                            "(rollout.engine_process.engine_client makes it)")
        if payload is not None:
            await engine.stage_weights_from_tensor(payload, version)
        else:
            await engine.stage_weights_from_disk(str(directory), version)
        clock.lap("stage")
        activated = await engine.activate_staged_weights(version)
        clock.lap("activate")
        WEIGHT_ACTIVATION_PAUSE_SECONDS.observe(activated.pause_s)

    async def _pause_and_load(self, payload: bytes | None, directory: Path | None, version: str,
                              clock: PhaseClock) -> None:
        mode = self.settings.weight_update_mode
        update: Callable[[], Awaitable[object]]
        if payload is not None:
            update = partial(self.client.update_weights_from_tensor, payload, version, flush_cache=mode == "abort")
        else:
            update = partial(self.client.update_weights_from_disk, str(directory), version,
                             flush_cache=mode == "abort")
        await self.client.pause_generation(mode)
        clock.lap("pause")
        try:
            await update()
        finally:
            clock.lap("load")
            await self.client.continue_generation()
            clock.lap("continue")

    async def fetch_and_load(self, event: bus_pb2.WeightsPublished) -> None:
        """Fetch (a delta from the held version when possible), verify every tensor, load into
        the engine. Until the engine confirms the new version, the old one keeps serving."""
        started, clock, source = time.monotonic(), PhaseClock(), "publisher"
        if self.held is not None and self.held.version == event.version:
            # The engine lost a version this replica still holds verified (it restarted on its
            # base weights): load it again, nothing to fetch.
            weights, report = self.held, None
        else:
            if self.settings.relay.enabled:
                tree = self.tree(event.fetch_endpoint)
                weights, report, parent = await sync_through_tree(tree, self.relay, event.model, self.held,
                                                                  event.version)
                source = parent or source
                self.status.tree_depth = tree.current.depth if tree.current is not None else 0
            else:
                weights, report = await sync_weights(self.publisher(event.fetch_endpoint), event.model, self.held,
                                                     event.version)
            self.held = weights  # verified: the next delta applies to these bytes
            if report.fallback_reason:
                WEIGHT_SYNC_FALLBACKS.inc()
        clock.lap("sync")
        loading = time.monotonic()
        await self._into_engine(weights, clock)
        self.ctx.policy_version = weights.version
        if report is None:
            log.info("weights_loaded", version=weights.version, kind="held",
                     seconds=round(time.monotonic() - started, 3))
            return
        WEIGHT_SYNC_SECONDS.labels("fetch").observe(report.transfer_s)
        WEIGHT_SYNC_SECONDS.labels("apply").observe(report.apply_s + time.monotonic() - loading)
        phases = {"fetch": report.transfer_s, "decode_verify": max(0.0, clock.seconds.pop("sync") - report.transfer_s),
                  **clock.seconds}
        for phase, seconds in phases.items():
            VERSION_LOAD_PHASE_SECONDS.labels(phase).inc(seconds)
        WEIGHT_PAYLOAD_BYTES.labels(report.kind).inc(report.payload_bytes)
        self.status.last_fetch.CopyFrom(status_pb2.WeightFetch(kind=report.kind, bytes=report.payload_bytes,
                                                               raw_bytes=report.raw_bytes, source=source))
        log.info("weights_loaded", version=weights.version, kind=report.kind, bytes=report.payload_bytes,
                 fallback=report.fallback_reason or None, seconds=round(time.monotonic() - started, 3))

