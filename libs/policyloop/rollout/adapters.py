"""The LoRA adapters a rollout replica's engine serves, one run each (the many-runs mode).

For every run it serves, the replica brings the run's adapter to each announced version the way
it brings the base — a verified delta from the version it holds, a keyframe when that fails —
and loads it into its engine under a name of its own, `<run>@<version>`. A request takes a lease
on the newest name of its run and samples with it (lora_path), so every token of the sample
carries that adapter's version; an older name is unloaded once the last request holding it is
done. Only the adapters of the runs it serves are fetched. The adapters themselves are kept by
policyloop.engines.adapters (ServedAdapters); a serving replica of a LoRA run follows its
promotions (PromotedAdapter).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import nats.errors
import nats.js.errors

from policyloop.bus import Bus, PermanentError, promotions_subject, weights_subject
from policyloop.bus.newest import NewestPerSubject
from policyloop.contracts.v1 import bus_pb2, loop_pb2
from policyloop.engines.adapters import AdapterLease, ServedAdapters
from policyloop.rl.lora import adapter_model_name
from policyloop.rl.settings import LoraSpec
from policyloop.state.catalog import RunRegistry
from policyloop.state.pacing import Pacer
from policyloop.telemetry.logging import get_logger

log = get_logger(__name__)


class LoraRuns:
    """A replica's LoRA runs (settings.lora_runs): which runs it serves — each known by its
    definition in the run registry, read once — their adapters in its engine, and their pacing,
    by each run's own versions."""

    def __init__(self, bus: Bus, runs: RunRegistry, served: ServedAdapters, model: str,
                 pacer_for: Callable[[str], Pacer | None],
                 on_serving: Callable[[int], None] = lambda _: None) -> None:
        self.bus, self.runs, self.served, self.model, self.pacer_for = bus, runs, served, model, pacer_for
        self.on_serving = on_serving  # told how many runs are served, as that changes
        self.pacers: dict[str, Pacer | None] = {}
        self._caught_up: dict[str, float] = {}  # when each run last read WEIGHTS directly

    async def serve(self, run_id: str) -> None:
        """Serves the run from now on (its newest announced version loaded): PermanentError when
        the run has no LoRA spec, which a cluster of LoRA runs cannot train."""
        if run_id in self.served.runs:
            return
        definition = await self.runs.definition(run_id)
        if definition is None or not definition.HasField("lora"):
            raise PermanentError(f"run {run_id!r} has no LoRA spec: this cluster trains LoRA runs")
        name = adapter_model_name(self.model, run_id)
        self.served.serve(run_id, LoraSpec.from_proto(definition.lora), name)
        self.pacers[run_id] = self.pacer_for(name)
        self.on_serving(len(self.served.runs))
        await self.catch_up(run_id)  # a run that trained before this replica started: its newest version now

    async def catch_up(self, run_id: str, every_s: float = 0.0) -> None:
        """Loads the run's newest announced version if this replica has an older one, read from
        WEIGHTS directly (at most once per `every_s`): announcements missed while the
        subscription was down (a NATS restart) are caught up by the run's paced tasks."""
        now = time.monotonic()
        if now - self._caught_up.get(run_id, -1e9) < every_s:
            return
        self._caught_up[run_id] = now
        served = self.served.runs.get(run_id)
        if served is None:
            return
        subject = weights_subject(served.model)
        try:
            newest = await self.bus.js.get_last_msg(self.bus.topology.stream_for_subject(subject).name, subject)
        except nats.js.errors.NotFoundError:
            return
        except (TimeoutError, nats.errors.Error) as exc:  # the server restarting: the next try
            log.warning("adapter_catch_up_failed", run=run_id, error=repr(exc))
            return
        event = bus_pb2.WeightsPublished.FromString(newest.data)
        if event.version > self.served.version(run_id):
            await self.served.update(run_id, event)

    async def on_event(self, msg) -> None:  # type: ignore[no-untyped-def]
        """A WEIGHTS announcement of some run's adapter: loaded when the run is served here."""
        event = bus_pb2.WeightsPublished.FromString(msg.data)
        run_id = self.served.run_of(event.model)
        if run_id is None:
            return
        try:
            await self.served.update(run_id, event)
        except Exception as exc:  # noqa: BLE001 - the run samples with the version it has; the next one retries
            log.warning("adapter_not_loaded", run=run_id, version=event.version, error=repr(exc))

    def subscription_subject(self) -> str:
        """Every model's announcements (a model name is one subject token, so a run's adapter has
        no subject of its own under the base's): on_event keeps those of the runs served here."""
        return weights_subject(self.model).rsplit(".", 1)[0] + ".*"

    @asynccontextmanager
    async def adapter(self, run_id: str) -> AsyncIterator[AdapterLease | None]:
        """The run's newest loaded adapter, held while sampling with it; None while the run is at
        version 0 (its adapter is still the base: the base samples)."""
        async with self.served.lease_or_base(run_id) as lease:
            yield lease


class PromotedAdapter:
    """A serving replica of a LoRA run: the adapter version the run's newest promotion names, older
    or newer (a rollback goes back), loaded beside the base; each request samples with it."""

    def __init__(self, bus: Bus, served: ServedAdapters, run_id: str, spec: LoraSpec, model: str,
                 on_version: Callable[[int], None] = lambda _: None) -> None:
        self.bus, self.served, self.run_id, self.on_version = bus, served, run_id, on_version
        self.promoted: bus_pb2.WeightsPublished | None = None  # the newest promotion's version
        served.serve(run_id, spec, model)

    async def on_promotion(self, msg) -> None:  # type: ignore[no-untyped-def]
        self.promoted = loop_pb2.Promotion.FromString(msg.data).weights
        try:
            await self._load()
        except Exception as exc:  # noqa: BLE001 - the served version stays; the next promotion retries
            log.error("adapter_not_loaded", run=self.run_id, version=self.promoted.version, error=repr(exc))

    async def _load(self) -> None:
        if self.promoted is None:
            return
        await self.served.update(self.run_id, self.promoted, newest_only=False)
        self.on_version(self.served.version(self.run_id))

    async def resync(self) -> None:
        """After the engine answered again: the base is named version 0 (a restarted SGLang says
        "default"), and an adapter the engine lost is loaded again before the engine counts as
        recovered; a failure raises, so that recovery is tried again."""
        from policyloop.rollout.engine_process import name_base_version

        await name_base_version(self.served.engine)
        if await self.served.lost(self.run_id):
            await self._load()

    async def run(self, stop: asyncio.Event) -> None:
        """Follows the run's PROMOTIONS until `stop` (made again after a reconnect)."""
        promotions = NewestPerSubject(self.bus, promotions_subject(self.run_id), self.on_promotion)
        try:
            while not stop.is_set():
                await promotions.ensure()
                try:
                    await asyncio.wait_for(stop.wait(), timeout=1.0)
                except TimeoutError:
                    pass
        finally:
            await promotions.close()

    @asynccontextmanager
    async def adapter(self) -> AsyncIterator[AdapterLease | None]:
        """The promoted adapter, held while a request samples with it; None before any promotion
        (the base serves)."""
        async with self.served.lease_or_base(self.run_id) as lease:
            yield lease


def stamp_version(traj: bus_pb2.Trajectory, version: int) -> None:
    """Every token of a LoRA run's sample carries the adapter version that made it (the engine
    reports the base's)."""
    n = len(traj.response_token_ids)
    del traj.version_spans[:]
    if n:
        traj.version_spans.append(bus_pb2.VersionSpan(version=version, start=0, end=n))
