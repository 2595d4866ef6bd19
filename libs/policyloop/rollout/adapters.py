"""The LoRA adapters a rollout replica's engine serves, one run each (the many-runs mode).

For every run it serves, the replica brings the run's adapter to each announced version the way
it brings the base — a verified delta from the version it holds, a keyframe when that fails —
and loads it into its engine under a name of its own, `<run>@<version>`. A request takes a lease
on the newest name of its run and samples with it (lora_path), so every token of the sample
carries that adapter's version; an older name is unloaded once the last request holding it is
done. Only the adapters of the runs it serves are fetched.
"""

from __future__ import annotations

import asyncio
import shutil
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import nats.errors
import nats.js.errors

from policyloop.bus import Bus, PermanentError, promotions_subject, weights_subject
from policyloop.bus.newest import NewestPerSubject
from policyloop.contracts.v1 import bus_pb2, loop_pb2
from policyloop.engines.sglang_client import EngineError, SGLangClient
from policyloop.rl.lora import adapter_config_dict, adapter_model_name, adapter_safetensors, save_adapter_directory
from policyloop.rl.settings import LoraSpec
from policyloop.state.catalog import RunRegistry
from policyloop.state.pacing import Pacer
from policyloop.telemetry.logging import get_logger
from policyloop.weights.client import WeightClient
from policyloop.weights.codec import WeightSet
from policyloop.weights.sync import SyncReport, sync_weights

log = get_logger(__name__)


# How a version reaches the engine: sent in the request (/load_lora_adapter_from_tensors, the
# embedded engine) or written as a peft directory the engine reads (/load_lora_adapter: SGLang,
# whose from-tensors route takes pickles only).
AdapterSource = Literal["tensors", "directory"]


def lora_name(run_id: str, version: int) -> str:
    return f"{run_id}@{version}"


@dataclass
class ServedRun:
    spec: LoraSpec
    model: str                      # the run's adapter versions' name at the publisher
    held: WeightSet | None = None   # the newest loaded version's tensors: the base of the next delta
    name: str | None = None         # the newest loaded version's name in the engine


@dataclass(frozen=True)
class AdapterLease:
    run_id: str
    name: str      # lora_path of the requests made under it
    version: int   # the version every token sampled under it carries


class ServedAdapters:
    def __init__(self, engine: SGLangClient, root: Path, publisher_for: Callable[[str], WeightClient],
                 load_from: AdapterSource = "tensors") -> None:
        self.engine, self.root, self.publisher_for, self.load_from = engine, Path(root), publisher_for, load_from
        self.runs: dict[str, ServedRun] = {}
        self.leases: Counter[str] = Counter()  # requests holding each loaded name
        # names loaded in the engine, and the directory each came from (None: sent as tensors)
        self.loaded: dict[str, Path | None] = {}
        self._loading = asyncio.Lock()
        self._moved = asyncio.Condition()       # notified whenever a run's newest version changes

    def serve(self, run_id: str, spec: LoraSpec, model: str) -> None:
        """Serves `run_id` from its next announced version on."""
        self.runs.setdefault(run_id, ServedRun(spec, model))

    async def update(self, run_id: str, event: bus_pb2.WeightsPublished, *, newest_only: bool = True
                     ) -> SyncReport | None:
        """Brings the run's adapter to the announced version and loads it; None when the run is not
        served here or already has that version or (`newest_only`) a newer one. Without
        `newest_only` an older version is loaded too (a rollback), fetched whole."""
        served = self.runs.get(run_id)
        if served is None or event.model != served.model:
            return None
        async with self._loading:
            held = served.held.version if served.held is not None else None
            if held is not None and (held == event.version or (newest_only and held > event.version)):
                return None
            client = self.publisher_for(event.fetch_endpoint)
            base = served.held if held is not None and held < event.version else None  # a delta goes forward only
            weights, report = await sync_weights(client, served.model, base, event.version)
            name = lora_name(run_id, weights.version)
            self.loaded[name] = await self._load(name, served, weights)
            previous, served.held, served.name = served.name, weights, name
            async with self._moved:
                self._moved.notify_all()
            log.info("adapter_loaded", run=run_id, version=weights.version, kind=report.kind,
                     payload_bytes=report.payload_bytes)
            if previous is not None:
                await self._unload_if_unused(previous)
            return report

    async def _load(self, name: str, served: ServedRun, weights: WeightSet) -> Path | None:
        """Loads a version into the engine under `name`; the directory it was written to, if any."""
        from policyloop.weights.torch_io import to_tensor

        tensors = {k: to_tensor(t) for k, t in weights.tensors.items()}
        if self.load_from == "tensors":
            payload, checksums = await asyncio.to_thread(adapter_safetensors, tensors)
            await self.engine.load_lora_adapter_from_tensors(name, adapter_config_dict(served.spec), payload,
                                                             checksums)
            return None
        directory = await asyncio.to_thread(save_adapter_directory, tensors, served.spec,
                                            self.root / served.model / f"v{weights.version:09d}")
        await self.engine.load_lora_adapter(name, str(directory))
        return directory

    async def forget(self, run_id: str) -> None:
        """After the engine failed and answered again (restarted without adapters, or not): the
        run's names are unloaded where the engine still has them, and the run holds no version."""
        served = self.runs.get(run_id)
        if served is not None:
            served.held = served.name = None
        for name in [n for n in self.loaded if n.startswith(f"{run_id}@")]:
            directory = self.loaded.pop(name)
            try:
                await self.engine.unload_lora_adapter(name)
            except EngineError:
                pass  # a restarted engine does not know it
            if directory is not None:
                shutil.rmtree(directory, ignore_errors=True)

    async def remove(self, run_id: str) -> None:
        """Stops serving a run: its names are unloaded once no request holds them."""
        served = self.runs.pop(run_id, None)
        if served is None:
            return
        prefix = f"{run_id}@"
        for name in [n for n in self.loaded if n.startswith(prefix)]:
            await self._unload_if_unused(name)

    def version(self, run_id: str) -> int:
        """The newest version of the run loaded here (0: none yet, the base, which its adapter starts as)."""
        served = self.runs.get(run_id)
        return served.held.version if served is not None and served.held is not None else 0

    def run_of(self, model: str) -> str | None:
        """The served run whose adapter versions go under `model` at the publisher."""
        return next((run_id for run_id, served in self.runs.items() if served.model == model), None)

    async def version_moved(self, run_id: str, since: int, timeout_s: float) -> None:
        """Returns once the run's loaded version is past `since`, or after `timeout_s`."""
        async with self._moved:
            try:
                await asyncio.wait_for(self._moved.wait_for(lambda: self.version(run_id) > since), timeout_s)
            except TimeoutError:
                pass

    def current(self, run_id: str) -> AdapterLease | None:
        served = self.runs.get(run_id)
        if served is None or served.name is None or served.held is None:
            return None
        return AdapterLease(run_id, served.name, served.held.version)

    @asynccontextmanager
    async def lease(self, run_id: str) -> AsyncIterator[AdapterLease]:
        """The newest loaded version of the run, held for a request's lifetime; LookupError when
        none is loaded yet."""
        lease = self.current(run_id)
        if lease is None:
            raise LookupError(f"no adapter of run {run_id!r} is loaded")
        self.leases[lease.name] += 1
        try:
            yield lease
        finally:
            self.leases[lease.name] -= 1
            if not self.leases[lease.name]:
                del self.leases[lease.name]
                if not self._is_newest(lease.name):
                    await self._unload_if_unused(lease.name)

    def _is_newest(self, name: str) -> bool:
        return any(served.name == name for served in self.runs.values())

    async def _unload_if_unused(self, name: str) -> None:
        if self.leases[name] or name not in self.loaded or self._is_newest(name):
            return
        directory = self.loaded.pop(name)
        await self.engine.unload_lora_adapter(name)
        if directory is not None:
            shutil.rmtree(directory, ignore_errors=True)
        log.info("adapter_unloaded", name=name)


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
        if self.served.current(run_id) is None:
            yield None
            return
        async with self.served.lease(run_id) as lease:
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
        await self._load()

    async def _load(self) -> None:
        if self.promoted is None:
            return
        try:
            await self.served.update(self.run_id, self.promoted, newest_only=False)
        except Exception as exc:  # noqa: BLE001 - the served version stays; the next promotion retries
            log.error("adapter_not_loaded", run=self.run_id, version=self.promoted.version, error=repr(exc))
            return
        self.on_version(self.served.version(self.run_id))

    async def resync(self) -> None:
        """After the engine answered again: it may have restarted without adapters, so the
        promoted one is loaded again before the engine counts as recovered."""
        await self.served.forget(self.run_id)
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
        if self.served.current(self.run_id) is None:
            yield None
            return
        async with self.served.lease(self.run_id) as lease:
            yield lease


def stamp_version(traj: bus_pb2.Trajectory, version: int) -> None:
    """Every token of a LoRA run's sample carries the adapter version that made it (the engine
    reports the base's)."""
    n = len(traj.response_token_ids)
    del traj.version_spans[:]
    if n:
        traj.version_spans.append(bus_pb2.VersionSpan(version=version, start=0, end=n))
