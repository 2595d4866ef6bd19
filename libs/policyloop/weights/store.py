"""Policy versions on disk, one payload file per version plus a small JSON record.

A version exists once its record exists; both are written to a temporary name, fsynced and
renamed into place, so a crash while storing leaves no half version behind. Versions of a
model only increase. A payload is a keyframe (self-contained) or a delta from the previous
version; a version may also have a snapshot (a keyframe written beside it) so that
reconstructing it never needs a long chain of deltas. The newest `retention` versions are kept,
together with what reconstructing the oldest of them needs (back to a keyframe or snapshot).
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import xxhash

CHUNK_BYTES = 1024 * 1024
_MODEL_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}$")


class StoreError(Exception):
    """Base of the store's errors; the message names what is wrong."""


class StaleVersion(StoreError):
    pass


class PayloadMismatch(StoreError):
    pass


class UnknownVersion(StoreError):
    pass


@dataclass(frozen=True)
class StoredVersion:
    model: str
    version: int
    step: int
    codec: str
    bytes: int
    payload_xxh3_128: str
    created_unix_ms: int
    run_id: str = ""
    kind: str = "keyframe"        # "keyframe" (self-contained) or "delta" (from base_version)
    base_version: int = 0
    manifest_hash: str = ""       # hash of the version's weights (names, dtypes, shapes, tensor hashes)
    raw_bytes: int = 0            # size of the version's weights, uncompressed


def validate_model_name(model: str) -> None:
    if not _MODEL_RE.match(model):
        raise ValueError(f"model name {model!r} must match {_MODEL_RE.pattern}")


def fsync_dir(path: Path) -> None:
    """Makes a rename inside `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class VersionWriter:
    """Receives one version's payload in pieces; `commit` makes it durable and visible."""

    def __init__(self, store: VersionStore, meta: StoredVersion) -> None:
        self.store, self.meta = store, meta
        self.dir = store.model_dir(meta.model)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.tmp = self.dir / f".{meta.version:012d}.{os.getpid()}.{time.monotonic_ns()}.tmp"
        self._file = open(self.tmp, "wb")
        self._hash = xxhash.xxh3_128()
        self.received = 0

    def write(self, data: bytes) -> None:
        self.received += len(data)
        if self.received > self.meta.bytes:
            raise PayloadMismatch(f"payload longer than the announced {self.meta.bytes} bytes")
        self._hash.update(data)
        self._file.write(data)

    def commit(self) -> StoredVersion:
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        if self.received != self.meta.bytes:
            self.abort()
            raise PayloadMismatch(f"payload has {self.received} bytes, {self.meta.bytes} announced")
        digest = self._hash.hexdigest()
        if digest != self.meta.payload_xxh3_128:
            self.abort()
            raise PayloadMismatch(f"payload xxh3-128 is {digest}, {self.meta.payload_xxh3_128} announced")
        latest = self.store.latest(self.meta.model)
        if latest is not None and latest.version >= self.meta.version:
            self.abort()
            raise StaleVersion(f"version {self.meta.version} of {self.meta.model} is not newer than {latest.version}")
        os.replace(self.tmp, self.store.payload_path(self.meta.model, self.meta.version))
        record = self.store.record_path(self.meta.model, self.meta.version)
        tmp_record = record.with_suffix(".json.tmp")
        with open(tmp_record, "w") as f:
            json.dump(asdict(self.meta), f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_record, record)
        fsync_dir(self.dir)
        self.store.prune(self.meta.model)
        return self.meta

    def abort(self) -> None:
        if not self._file.closed:
            self._file.close()
        self.tmp.unlink(missing_ok=True)


class VersionStore:
    def __init__(self, root: Path, retention: int = 8) -> None:
        if retention < 1:
            raise ValueError("retention must keep at least one version")
        self.root = Path(root)
        self.retention = retention
        self.root.mkdir(parents=True, exist_ok=True)
        self._clean_partial()

    def model_dir(self, model: str) -> Path:
        validate_model_name(model)
        return self.root / model

    def payload_path(self, model: str, version: int) -> Path:
        return self.model_dir(model) / f"{version:012d}.bin"

    def record_path(self, model: str, version: int) -> Path:
        return self.model_dir(model) / f"{version:012d}.json"

    def snapshot_path(self, model: str, version: int) -> Path:
        return self.model_dir(model) / f"{version:012d}.snapshot"

    def write_snapshot(self, model: str, version: int, payload: bytes) -> None:
        """A keyframe of a stored version, written atomically beside it."""
        self.get(model, version)
        path = self.snapshot_path(model, version)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{time.monotonic_ns()}.tmp")
        with open(tmp, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)

    def has_snapshot(self, model: str, version: int) -> bool:
        return self.snapshot_path(model, version).exists()

    def read_snapshot(self, model: str, version: int) -> bytes:
        return self.snapshot_path(model, version).read_bytes()

    def read_payload(self, model: str, version: int) -> bytes:
        self.get(model, version)
        return self.payload_path(model, version).read_bytes()

    def is_base_point(self, stored: StoredVersion) -> bool:
        """Whether the version can be rebuilt from its own files alone."""
        return stored.kind != "delta" or self.has_snapshot(stored.model, stored.version)

    def _clean_partial(self) -> None:
        """Removes what a crash mid-write left: temporaries and payloads without a record."""
        for tmp in self.root.glob("*/.*.tmp"):  # payloads and snapshots being written
            tmp.unlink(missing_ok=True)
        for tmp in self.root.glob("*/*.json.tmp"):
            tmp.unlink(missing_ok=True)
        for payload in [*self.root.glob("*/*.bin"), *self.root.glob("*/*.snapshot")]:
            if not payload.with_suffix(".json").exists():
                payload.unlink(missing_ok=True)

    def begin(self, meta: StoredVersion) -> VersionWriter:
        validate_model_name(meta.model)
        if meta.version < 1:
            raise StaleVersion(f"versions start at 1, got {meta.version}")
        latest = self.latest(meta.model)
        if latest is not None and latest.version >= meta.version:
            raise StaleVersion(f"version {meta.version} of {meta.model} is not newer than {latest.version}")
        return VersionWriter(self, meta)

    def versions(self, model: str) -> list[StoredVersion]:
        directory = self.model_dir(model)
        if not directory.exists():
            return []
        out = []
        for record in sorted(directory.glob("*.json")):
            out.append(StoredVersion(**json.loads(record.read_text())))
        return out

    def models(self) -> list[str]:
        return sorted(p.name for p in self.root.iterdir() if p.is_dir() and _MODEL_RE.match(p.name))

    def latest(self, model: str) -> StoredVersion | None:
        versions = self.versions(model)
        return versions[-1] if versions else None

    def get(self, model: str, version: int) -> StoredVersion:
        record = self.record_path(model, version)
        if not record.exists():
            raise UnknownVersion(f"version {version} of {model} is not stored")
        return StoredVersion(**json.loads(record.read_text()))

    def prune(self, model: str) -> list[int]:
        """Deletes versions older than the newest `retention`, except those needed to rebuild
        the oldest kept one (back to the newest keyframe or snapshot at or before it)."""
        versions = self.versions(model)
        keep_from = max(0, len(versions) - self.retention)
        while keep_from > 0 and not self.is_base_point(versions[keep_from]):
            keep_from -= 1
        dropped = [v.version for v in versions[:keep_from]]
        for version in dropped:
            # Record first: a version without its record is treated as never written.
            self.record_path(model, version).unlink(missing_ok=True)
            self.payload_path(model, version).unlink(missing_ok=True)
            self.snapshot_path(model, version).unlink(missing_ok=True)
        return dropped


def payload_digest(data: bytes) -> str:
    return xxhash.xxh3_128_hexdigest(data)
