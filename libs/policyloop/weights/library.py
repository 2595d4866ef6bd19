"""The publisher's view of a model's versions: payloads on disk, the newest weights in memory,
and the payload a client needs to go from the version it has to the version it wants.

Pushes are verified by applying them: a delta is applied to the newest weights held here, and
only if every tensor hash matches is the payload made durable. So the publisher never stores or
serves a version it could not reconstruct exactly.

Serving: the stored delta when the client has exactly its base (the common case: encoded once
by the learner, served to every replica); otherwise a delta encoded here from the client's
version (rebuilt from disk; XOR composes, so one delta covers any number of steps), or a
keyframe when the client has nothing or a version no longer kept. Built payloads are cached, and
concurrent requests for the same one wait for a single encoding.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from concurrent.futures import Executor
from dataclasses import dataclass

from policyloop.telemetry.logging import get_logger
from policyloop.weights import codec
from policyloop.weights.store import StaleVersion, StoredVersion, UnknownVersion, VersionStore, payload_digest

log = get_logger(__name__)


class PushRejected(Exception):
    """The pushed payload is not acceptable; the message names the field and the problem."""


class BaseUnavailable(PushRejected):
    """A delta whose base is not the newest version here: the pusher should send a keyframe."""


@dataclass(frozen=True)
class Served:
    """One payload for a Fetch."""

    model: str
    version: int
    base_version: int
    kind: str
    manifest_hash: str
    payload: bytes
    payload_xxh3_128: str


class WeightLibrary:
    def __init__(self, store: VersionStore, *, snapshot_every: int = 16, cache_entries: int = 4,
                 pool: Executor | None = None) -> None:
        if snapshot_every < 1:
            raise ValueError("snapshot_every must be at least 1")
        self.store = store
        self.snapshot_every = snapshot_every
        self.cache_entries = cache_entries
        self.pool = pool
        self._held: dict[str, codec.WeightSet] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._cache: OrderedDict[tuple[str, int, int], Served] = OrderedDict()
        self._building: dict[tuple[str, int, int], asyncio.Future[Served]] = {}
        self._background: set[asyncio.Task[None]] = set()

    def _lock(self, model: str) -> asyncio.Lock:
        # Guards the in-memory newest weights: pushes change them in place, encoders read them.
        return self._locks.setdefault(model, asyncio.Lock())

    # ------------------------------------------------------------ rebuilding versions

    def materialize(self, model: str, version: int) -> codec.WeightSet:
        """A stored version's weights, rebuilt from the nearest keyframe or snapshot (blocking)."""
        chain: list[StoredVersion] = []
        current = self.store.get(model, version)
        while True:
            chain.append(current)
            if self.store.is_base_point(current):
                break
            current = self.store.get(model, current.base_version)
        start = chain.pop()
        if start.kind == "delta":  # a delta with a snapshot beside it
            weights = codec.apply(None, self.store.read_snapshot(model, start.version), pool=self.pool)
        else:
            weights = codec.apply(None, self.store.read_payload(model, start.version), pool=self.pool)
        for stored in reversed(chain):
            weights = codec.apply(weights, self.store.read_payload(model, stored.version), pool=self.pool)
        return weights

    async def _newest(self, model: str) -> codec.WeightSet | None:
        """The newest version's weights (call with the model's lock held)."""
        latest = self.store.latest(model)
        if latest is None:
            return None
        held = self._held.get(model)
        if held is None or held.version != latest.version:
            held = await asyncio.to_thread(self.materialize, model, latest.version)
            self._held[model] = held
        return held

    # ------------------------------------------------------------ pushes

    async def accept(self, meta: StoredVersion, payload: bytes) -> StoredVersion:
        """Verifies a pushed payload by applying it, then stores it durably."""
        if len(payload) != meta.bytes:
            raise PushRejected(f"data: payload has {len(payload)} bytes, header.total_bytes says {meta.bytes}")
        digest = payload_digest(payload)
        if digest != meta.payload_xxh3_128:
            raise PushRejected(f"data: payload xxh3-128 is {digest}, header.payload_xxh3_128 says "
                               f"{meta.payload_xxh3_128}")
        try:
            header = codec.read_header(payload)
        except codec.CodecError as exc:
            raise PushRejected(f"data: {exc}") from exc
        if header.version != meta.version:
            raise PushRejected(f"data: the payload is version {header.version}, header.version says {meta.version}")
        async with self._lock(meta.model):
            latest = self.store.latest(meta.model)
            if latest is not None and latest.version >= meta.version:
                raise StaleVersion(f"version {meta.version} of {meta.model} is not newer than {latest.version}")
            if header.kind == "delta" and (latest is None or latest.version != header.base_version):
                have = latest.version if latest is not None else "none"
                raise BaseUnavailable(f"base_version: the delta is from {header.base_version}, the publisher's "
                                      f"newest version is {have}; push a keyframe")
            held = await self._newest(meta.model) if header.kind == "delta" else None
            try:
                weights = await asyncio.to_thread(codec.apply, held, payload, pool=self.pool)
            except codec.WrongBase as exc:
                raise BaseUnavailable(f"base_version: {exc}; push a keyframe") from exc
            except codec.CodecError as exc:
                raise PushRejected(f"data: {exc}") from exc
            record = StoredVersion(
                model=meta.model, version=meta.version, step=meta.step, codec=codec.CODEC, bytes=meta.bytes,
                payload_xxh3_128=digest, created_unix_ms=int(time.time() * 1000), run_id=meta.run_id,
                kind=header.kind, base_version=header.base_version, manifest_hash=header.manifest_hash,
                raw_bytes=weights.raw_bytes,
            )
            try:
                stored = await asyncio.to_thread(self._write, record, payload)
            except BaseException:
                self._held.pop(meta.model, None)  # changed in place but not stored: rebuild from disk
                raise
            self._held[meta.model] = weights
            self._remember(Served(stored.model, stored.version, stored.base_version, stored.kind,
                                  stored.manifest_hash, payload, digest))
            if header.kind == "delta" and self._chain_length(stored) >= self.snapshot_every:
                snapshot = await asyncio.to_thread(lambda: codec.encode(weights, raw=True, pool=self.pool).payload)
                self._spawn(self._write_snapshot(stored, snapshot))
        return stored

    def _write(self, record: StoredVersion, payload: bytes) -> StoredVersion:
        writer = self.store.begin(record)
        try:
            writer.write(payload)
        except BaseException:
            writer.abort()
            raise
        return writer.commit()

    def _chain_length(self, stored: StoredVersion) -> int:
        """Deltas between this version and the keyframe or snapshot it is rebuilt from."""
        length = 0
        current = stored
        while not self.store.is_base_point(current):
            length += 1
            try:
                current = self.store.get(current.model, current.base_version)
            except UnknownVersion:
                break
        return length

    async def _write_snapshot(self, stored: StoredVersion, payload: bytes) -> None:
        try:
            await asyncio.to_thread(self.store.write_snapshot, stored.model, stored.version, payload)
            log.info("snapshot_written", model=stored.model, version=stored.version, bytes=len(payload))
        except UnknownVersion:
            pass  # pruned meanwhile
        except OSError as exc:
            log.error("snapshot_failed", model=stored.model, version=stored.version, error=repr(exc))

    def _spawn(self, coro: object) -> None:
        task = asyncio.ensure_future(coro)  # type: ignore[arg-type]
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def drain(self) -> None:
        """Waits for background snapshot writes (at shutdown)."""
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)

    # ------------------------------------------------------------ fetches

    def _remember(self, served: Served) -> None:
        key = (served.model, served.base_version, served.version)
        self._cache[key] = served
        self._cache.move_to_end(key)
        while len(self._cache) > self.cache_entries:
            self._cache.popitem(last=False)

    async def payload_for(self, model: str, have_version: int, want_version: int) -> Served:
        """What a client holding `have_version` (0: nothing) needs for `want_version` (0: newest).
        Raises UnknownVersion when the wanted version is not stored."""
        stored = {v.version: v for v in self.store.versions(model)}  # one listing of the records
        if not stored:
            raise UnknownVersion(f"no version of {model} is stored")
        target = stored.get(want_version or max(stored))
        if target is None:
            raise UnknownVersion(f"version {want_version} of {model} is not stored")
        base = have_version if 0 < have_version < target.version and have_version in stored else 0
        key = (model, base, target.version)
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]
        if target.base_version == base and (base > 0 or target.kind == "keyframe"):
            payload = await asyncio.to_thread(self.store.read_payload, model, target.version)
            served = Served(model, target.version, base, target.kind, target.manifest_hash, payload,
                            target.payload_xxh3_128)
            self._remember(served)
            return served
        building = self._building.get(key)
        if building is None:
            building = asyncio.ensure_future(self._build(model, base, target.version))
            self._building[key] = building
            building.add_done_callback(lambda _: self._building.pop(key, None))
        return await asyncio.shield(building)

    async def _build(self, model: str, base: int, version: int) -> Served:
        async with self._lock(model):
            newest = await self._newest(model)
            started = time.monotonic()

            def build() -> codec.Encoded:
                target = newest if newest is not None and newest.version == version else \
                    self.materialize(model, version)
                from_weights = self.materialize(model, base) if base else None
                return codec.encode(target, from_weights, pool=self.pool)

            encoded = await asyncio.to_thread(build)
        served = Served(model, version, base, encoded.stats.kind, self.store.get(model, version).manifest_hash,
                        encoded.payload, payload_digest(encoded.payload))
        log.info("payload_built", model=model, version=version, base_version=base, kind=served.kind,
                 bytes=len(served.payload), seconds=round(time.monotonic() - started, 3))
        self._remember(served)
        return served
