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
from collections import Counter
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

from policyloop.contracts.v1 import bus_pb2
from policyloop.engines.sglang_client import SGLangClient
from policyloop.rl.lora import LoraSpec, save_adapter_directory
from policyloop.telemetry.logging import get_logger
from policyloop.weights.client import WeightClient
from policyloop.weights.codec import WeightSet
from policyloop.weights.sync import SyncReport, sync_weights

log = get_logger(__name__)


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
    def __init__(self, engine: SGLangClient, root: Path, publisher_for: Callable[[str], WeightClient]) -> None:
        self.engine, self.root, self.publisher_for = engine, Path(root), publisher_for
        self.runs: dict[str, ServedRun] = {}
        self.leases: Counter[str] = Counter()  # requests holding each loaded name
        self.loaded: dict[str, Path] = {}      # names loaded in the engine, and the directory each came from
        self._loading = asyncio.Lock()

    def serve(self, run_id: str, spec: LoraSpec, model: str) -> None:
        """Serves `run_id` from its next announced version on."""
        self.runs.setdefault(run_id, ServedRun(spec, model))

    async def update(self, run_id: str, event: bus_pb2.WeightsPublished) -> SyncReport | None:
        """Brings the run's adapter to the announced version and loads it; None when the run is not
        served here or already has that version or a newer one."""
        served = self.runs.get(run_id)
        if served is None or event.model != served.model:
            return None
        async with self._loading:
            if served.held is not None and served.held.version >= event.version:
                return None
            client = self.publisher_for(event.fetch_endpoint)
            weights, report = await sync_weights(client, served.model, served.held, event.version)
            from policyloop.weights.torch_io import to_tensor

            name = lora_name(run_id, weights.version)
            directory = save_adapter_directory({k: to_tensor(t) for k, t in weights.tensors.items()}, served.spec,
                                               self.root / served.model / f"v{weights.version:09d}")
            await self.engine.load_lora_adapter(name, str(directory))
            self.loaded[name] = directory
            previous, served.held, served.name = served.name, weights, name
            log.info("adapter_loaded", run=run_id, version=weights.version, kind=report.kind,
                     payload_bytes=report.payload_bytes)
            if previous is not None:
                await self._unload_if_unused(previous)
            return report

    async def remove(self, run_id: str) -> None:
        """Stops serving a run: its names are unloaded once no request holds them."""
        served = self.runs.pop(run_id, None)
        if served is None:
            return
        prefix = f"{run_id}@"
        for name in [n for n in self.loaded if n.startswith(prefix)]:
            await self._unload_if_unused(name)

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
        shutil.rmtree(directory, ignore_errors=True)
        log.info("adapter_unloaded", name=name)
