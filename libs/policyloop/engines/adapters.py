"""LoRA adapters in an engine, by version: each run's adapter brought to an announced version the
way weights are (a verified delta from the version held, a keyframe when that fails) and loaded
under a name of its own, `<run>@<version>`; a request holds a lease on the name it samples with,
and an older name is unloaded once the last request holding it is done. Rollout replicas (one
engine, many runs), serving replicas and the evaluator use it."""

from __future__ import annotations

import asyncio
import copy
import shutil
from collections import Counter
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from policyloop.contracts.v1 import bus_pb2
from policyloop.engines.protocol import GenerateRequest, SamplingParams
from policyloop.engines.sglang_client import EngineError, EngineUnavailable, SGLangClient
from policyloop.rl.lora import adapter_config_dict, adapter_safetensors, save_adapter_directory
from policyloop.rl.settings import LoraSpec
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
        self.weights: dict[str, WeightSet] = {}  # each loaded name's tensors (the base of a later delta)
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
            name = lora_name(run_id, event.version)
            report = None
            if name in self.loaded:  # still loaded (back to a version a request holds): nothing to fetch
                weights = self.weights[name]
            else:
                client = self.publisher_for(event.fetch_endpoint)
                # Deltas go forward, and are applied in place: on a copy, since the held version
                # stays loaded (and may be made current again) while requests hold it.
                base = copy.deepcopy(served.held) if held is not None and held < event.version else None
                weights, report = await sync_weights(client, served.model, base, event.version)
                self.loaded[name] = await self._load(name, served, weights)
                self.weights[name] = weights
            previous, served.held, served.name = served.name, weights, name
            async with self._moved:
                self._moved.notify_all()
            log.info("adapter_loaded", run=run_id, version=weights.version, kind=report.kind if report else "loaded",
                     payload_bytes=report.payload_bytes if report else 0)
            if previous is not None and previous != name:
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

    async def lost(self, run_id: str) -> bool:
        """After the engine failed and answered again: whether it lost the run's adapter (a restart
        loads none), found by sampling one token with it. A lost run holds no version here any more,
        so the next update loads it whole. Raises EngineUnavailable while the engine cannot tell."""
        async with self._loading:
            served = self.runs.get(run_id)
            if served is None or served.name is None:
                return False
            probe = GenerateRequest(input_ids=[0], lora_path=served.name, sampling_params=SamplingParams(
                max_new_tokens=1, temperature=0.0))
            try:
                await self.engine.generate(probe)
                return False
            except EngineUnavailable:
                raise
            except EngineError as exc:
                log.warning("adapter_lost", run=run_id, name=served.name, error=repr(exc))
            served.held = served.name = None
            for name in [n for n in self.loaded if n.startswith(f"{run_id}@")]:
                directory = self.loaded.pop(name)
                self.weights.pop(name, None)
                if directory is not None:
                    shutil.rmtree(directory, ignore_errors=True)
            return True

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

    @asynccontextmanager
    async def lease_or_base(self, run_id: str) -> AsyncIterator[AdapterLease | None]:
        """`lease`, or None while no version of the run is loaded (its adapter is the base)."""
        if self.current(run_id) is None:
            yield None
            return
        async with self.lease(run_id) as lease:
            yield lease

    def _is_newest(self, name: str) -> bool:
        return any(served.name == name for served in self.runs.values())

    async def _unload_if_unused(self, name: str) -> None:
        if self.leases[name] or name not in self.loaded or self._is_newest(name):
            return
        directory = self.loaded.pop(name)
        self.weights.pop(name, None)
        await self.engine.unload_lora_adapter(name)
        if directory is not None:
            shutil.rmtree(directory, ignore_errors=True)
        log.info("adapter_unloaded", name=name)
