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

Damage on disk (see store.py) never blocks later versions: a version is rebuilt by whatever route
remains (a snapshot, the deltas below a damaged snapshot, the newest weights held in memory); a
client whose version cannot be rebuilt gets a keyframe; a delta pushed onto a newest version that
cannot be rebuilt is refused with BaseUnavailable, so the learner sends a keyframe, which is
always accepted. A wanted version that no route rebuilds raises Unrebuildable (a DataLoss).
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass

from policyloop.common.clock import now_ms
from policyloop.telemetry.logging import get_logger
from policyloop.weights import codec
from policyloop.weights.store import (
    DamagedEntry,
    DataLoss,
    StaleVersion,
    StoredVersion,
    StoreError,
    UnknownVersion,
    VersionStore,
    payload_digest,
)

log = get_logger(__name__)

# Each failed route quarantines what failed, so the routes left shrink with every try; this only
# bounds a store that keeps changing underneath.
_MAX_ROUTES = 32


class PushRejected(Exception):
    """The pushed payload is not acceptable; the message names the field and the problem."""


class BaseUnavailable(PushRejected):
    """A delta whose base is not the newest version here: the pusher should send a keyframe."""


class Unrebuildable(DataLoss):
    """No route rebuilds the version from what is stored; the message names the version and why."""


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
        """A stored version's weights, rebuilt from the nearest keyframe or snapshot (blocking).

        Every file read is checked; one that fails is quarantined and the next route is tried:
        a damaged snapshot gives way to the deltas below it, a damaged delta to its snapshot.
        Raises UnknownVersion for a version that is not stored, Unrebuildable when no route is left."""
        damaged: list[str] = []
        for _ in range(_MAX_ROUTES):
            try:
                return self._rebuild(model, version)
            except DamagedEntry as exc:
                damaged.append(str(exc))
            except Unrebuildable as exc:  # no route left: a link of the chain is gone
                raise Unrebuildable(_with_damage(str(exc), damaged)) from exc
            except DataLoss as exc:  # the version itself was quarantined (its reasons are in the message)
                raise Unrebuildable(str(exc)) from exc
        raise Unrebuildable(_with_damage(f"version {version} of {model} cannot be rebuilt: the store kept "
                                         f"changing over {_MAX_ROUTES} tries", damaged))

    def _rebuild(self, model: str, version: int) -> codec.WeightSet:
        """One route: back from the version to a keyframe or snapshot, then the deltas forward."""
        target = self.store.get(model, version)
        chain: list[StoredVersion] = []  # deltas to apply, newest first
        current = target
        while not self.store.is_base_point(current):
            chain.append(current)
            current = self._base_of(target, current)
        weights = self._decode_base_point(current)
        for stored in reversed(chain):
            weights = self._apply_stored(weights, stored)
        return weights

    def _base_of(self, target: StoredVersion, stored: StoredVersion) -> StoredVersion:
        try:
            return self.store.get(stored.model, stored.base_version)
        except DamagedEntry:
            raise
        except (UnknownVersion, DataLoss) as exc:
            raise Unrebuildable(f"version {target.version} of {target.model} cannot be rebuilt: version "
                                f"{stored.version} is a delta from version {stored.base_version}, and {exc}") from exc

    def _decode_base_point(self, stored: StoredVersion) -> codec.WeightSet:
        """A keyframe's payload or a delta's snapshot, decoded and checked against the record."""
        if stored.kind == "keyframe":
            payload = self.store.read_payload(stored.model, stored.version)
            return self._checked(stored, payload, None, self.store.quarantine_payload)
        payload = self.store.read_snapshot(stored.model, stored.version)
        return self._checked(stored, payload, None, self.store.quarantine_snapshot)

    def _apply_stored(self, weights: codec.WeightSet, stored: StoredVersion) -> codec.WeightSet:
        payload = self.store.read_payload(stored.model, stored.version)
        return self._checked(stored, payload, weights, self.store.quarantine_payload)

    def _checked(self, stored: StoredVersion, payload: bytes, held: codec.WeightSet | None,
                 quarantine: Callable[[StoredVersion, str], StoreError]) -> codec.WeightSet:
        """Applies a stored payload (it matched its record's hash) and checks the result against
        the record: one that does not give the recorded weights is quarantined."""
        try:
            weights = codec.apply(held, payload, pool=self.pool)
        except codec.TooLarge as exc:  # this machine's memory bound, not damage: nothing is quarantined
            raise MemoryError(f"version {stored.version} of {stored.model}: {exc}") from exc
        except codec.CodecError as exc:
            raise quarantine(stored, f"does not decode ({type(exc).__name__}: {exc})") from exc
        problem = _mismatch(weights, stored)
        if problem:
            raise quarantine(stored, problem)
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
            held = await self._newest_as_base(meta.model) if header.kind == "delta" else None
            try:
                weights = await asyncio.to_thread(codec.apply, held, payload, pool=self.pool)
            except codec.WrongBase as exc:
                raise BaseUnavailable(f"base_version: {exc}; push a keyframe") from exc
            except codec.CodecError as exc:
                raise PushRejected(f"data: {exc}") from exc
            record = StoredVersion(
                model=meta.model, version=meta.version, step=meta.step, codec=codec.CODEC, bytes=meta.bytes,
                payload_xxh3_128=digest, created_unix_ms=now_ms(), run_id=meta.run_id,
                kind=header.kind, base_version=header.base_version, manifest_hash=header.manifest_hash,
                raw_bytes=weights.raw_bytes, trained_unix_ms=meta.trained_unix_ms,
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

    async def keep(self, model: str, version: int, reason: str) -> StoredVersion:
        """Keeps a stored version past the retention window: a delta gets a snapshot first, so that
        it is rebuilt from its own files once the versions below it are pruned."""
        async with self._lock(model):
            stored = await asyncio.to_thread(self.store.get, model, version)
            if not self.store.is_base_point(stored):
                weights = await asyncio.to_thread(self.materialize, model, version)
                snapshot = await asyncio.to_thread(lambda: codec.encode(weights, raw=True, pool=self.pool).payload)
                await asyncio.to_thread(self.store.write_snapshot, model, version, snapshot)
            kept = await asyncio.to_thread(self.store.keep, model, version, reason)
        log.info("version_kept", model=model, version=version, reason=reason)
        return kept

    async def _newest_as_base(self, model: str) -> codec.WeightSet | None:
        try:
            return await self._newest(model)
        except (DataLoss, UnknownVersion) as exc:  # lost, or quarantined since the check above
            raise BaseUnavailable(f"base_version: the publisher's newest version cannot be rebuilt ({exc}); "
                                  f"push a keyframe") from exc

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
            except StoreError:
                break
        return length

    async def _write_snapshot(self, stored: StoredVersion, payload: bytes) -> None:
        try:
            await asyncio.to_thread(self.store.write_snapshot, stored.model, stored.version, payload)
            log.info("snapshot_written", model=stored.model, version=stored.version, bytes=len(payload))
        except UnknownVersion:
            pass  # pruned meanwhile
        except (OSError, StoreError) as exc:
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

    def _remember(self, served: Served, *also: tuple[str, int, int]) -> None:
        """Caches a payload under its own key and the keys of requests it answers (a keyframe
        answers a request for a delta from a version that cannot be rebuilt)."""
        for key in {(served.model, served.base_version, served.version), *also}:
            self._cache[key] = served
            self._cache.move_to_end(key)
        while len(self._cache) > self.cache_entries:
            self._cache.popitem(last=False)

    async def payload_for(self, model: str, have_version: int, want_version: int) -> Served:
        """What a client holding `have_version` (0: nothing) needs for `want_version` (0: newest).
        Raises UnknownVersion when the wanted version is not stored, DataLoss when it was
        quarantined or cannot be rebuilt."""
        stored = {v.version: v for v in self.store.versions(model)}  # one listing of the records
        if want_version and want_version not in stored:
            stored[want_version] = self.store.get(model, want_version)  # raises what became of it
        if not stored:
            raise UnknownVersion(f"no version of {model} is stored")
        target = stored[want_version or max(stored)]
        base = have_version if 0 < have_version < target.version and have_version in stored else 0
        key = (model, base, target.version)
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]
        if target.base_version == base and (base > 0 or target.kind == "keyframe"):
            served = await self._stored_payload(target, base)
            if served is not None:
                return served
        building = self._building.get(key)
        if building is None:
            building = asyncio.ensure_future(self._build(model, base, target.version))
            self._building[key] = building
            building.add_done_callback(lambda _: self._building.pop(key, None))
        return await asyncio.shield(building)

    async def _stored_payload(self, target: StoredVersion, base: int) -> Served | None:
        """The stored payload as the learner made it, checked against its record; None when it
        fails the check (quarantined: the caller builds one from what remains)."""
        try:
            payload = await asyncio.to_thread(self.store.read_payload, target.model, target.version)
        except DamagedEntry as exc:
            log.warning("stored_payload_unusable", model=target.model, version=target.version, error=str(exc))
            return None
        served = Served(target.model, target.version, base, target.kind, target.manifest_hash, payload,
                        target.payload_xxh3_128)
        self._remember(served)
        return served

    async def _build(self, model: str, base: int, version: int) -> Served:
        async with self._lock(model):
            started = time.monotonic()
            target = await self._weights_of(model, version)
            from_weights = await self._client_base(model, base)
            encoded = await asyncio.to_thread(codec.encode, target, from_weights, pool=self.pool)
        served = Served(model, version, from_weights.version if from_weights else 0, encoded.stats.kind,
                        target.manifest_hash, encoded.payload, payload_digest(encoded.payload))
        log.info("payload_built", model=model, version=version, base_version=served.base_version, kind=served.kind,
                 bytes=len(served.payload), seconds=round(time.monotonic() - started, 3))
        self._remember(served, (model, base, version))
        return served

    async def _weights_of(self, model: str, version: int) -> codec.WeightSet:
        """A version's weights: the newest held in memory when it is that one (which also serves a
        newest version whose files were lost), else rebuilt from disk (call with the lock held)."""
        held = self._held.get(model)
        if held is not None and held.version == version:
            return held
        latest = self.store.latest(model)
        if latest is not None and latest.version == version:
            newest = await self._newest(model)  # kept for the pushes that follow
            if newest is not None and newest.version == version:
                return newest
        return await asyncio.to_thread(self.materialize, model, version)

    async def _client_base(self, model: str, base: int) -> codec.WeightSet | None:
        """The client's version to encode a delta from; None (a keyframe) when it cannot be rebuilt."""
        if not base:
            return None
        try:
            return await asyncio.to_thread(self.materialize, model, base)
        except (UnknownVersion, DataLoss) as exc:
            log.warning("client_base_unavailable", model=model, base_version=base, error=str(exc))
            return None


def _mismatch(weights: codec.WeightSet, stored: StoredVersion) -> str:
    """How decoded weights differ from what the version's record says ("" if they do not)."""
    if weights.version != stored.version or weights.manifest_hash != stored.manifest_hash:
        return (f"decodes to version {weights.version} with manifest {weights.manifest_hash}, its record says "
                f"version {stored.version} with manifest {stored.manifest_hash}")
    return ""


def _with_damage(message: str, damaged: list[str]) -> str:
    return message + (f" (quarantined on the way: {'; '.join(damaged)})" if damaged else "")
