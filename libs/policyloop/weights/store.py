"""Policy versions on disk, one payload file per version plus a small JSON record.

A version exists once its record exists; both are written to a temporary name, fsynced and
renamed into place, so a crash while storing leaves no half version behind. Versions of a
model only increase. A payload is a keyframe (self-contained) or a delta from the previous
version; a version may also have a snapshot (a keyframe written beside it, with a record of its
own) so that reconstructing it never needs a long chain of deltas. The newest `retention`
versions are kept, together with what reconstructing the oldest of them needs (back to a
keyframe or snapshot).

Nothing read back is trusted. Every record carries the xxh3-128 of its own content and is parsed
field by field; every payload and snapshot is checked against the size and xxh3-128 recorded for
it each time it is read. What fails a check is quarantined: moved into
`<model>/quarantine/<version>.<what>.<incident>/` beside a `reason.json`, logged, counted
(`policyloop_weights_quarantined_total{what}`) and handed to `on_quarantine`; the read raises
DamagedEntry. A delta whose payload is lost but whose snapshot verifies becomes a keyframe
version (the snapshot is its payload from then on). Opening a store removes what a crash left
and checks every record, payload size and snapshot record, so a damaged store still opens.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, TypeVar

import xxhash

from policyloop.telemetry.logging import get_logger
from policyloop.telemetry.metrics import WEIGHTS_QUARANTINED

log = get_logger(__name__)

CHUNK_BYTES = 1024 * 1024
QUARANTINE_DIR = "quarantine"
SEAL_FIELD = "record_xxh3_128"
_MODEL_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}$")
_HEX128_RE = re.compile(r"^[0-9a-f]{32}$")
_DATA_FILE_RE = re.compile(r"^(\d{12})\.(bin|snapshot|snapshot\.json)$")
_RECORD_FILE_RE = re.compile(r"^(\d{12})\.json$")


class StoreError(Exception):
    """Base of the store's errors; the message names what is wrong."""


class StaleVersion(StoreError):
    pass


class PayloadMismatch(StoreError):
    pass


class UnknownVersion(StoreError):
    pass


class DataLoss(StoreError):
    """Stored data is damaged or missing; the message names the version and what was lost."""


class DamagedEntry(DataLoss):
    """A stored file failed its check and was quarantined; another route may rebuild the version."""

    def __init__(self, model: str, version: int, what: str, detail: str) -> None:
        super().__init__(f"version {version} of {model}: {what} {detail}")
        self.model, self.version, self.what = model, version, what

    @classmethod
    def of(cls, quarantine: Quarantine) -> DamagedEntry:
        rebuilt = f"; {quarantine.rebuilt}" if quarantine.rebuilt else ""
        return cls(quarantine.model, quarantine.version, quarantine.what, quarantine.reason + rebuilt)


class _Unreadable(Exception):
    """A record file that is not a valid record (internal: turned into a quarantine)."""


# Record fields added after the format's first release: a record written before may lack them
# (and reads as their default); every other field must be there.
ADDED_LATER = frozenset({"trained_unix_ms"})


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
    manifest_hash: str = ""       # hash of the version: its number, and names, dtypes, shapes, tensor hashes
    raw_bytes: int = 0            # size of the version's weights, uncompressed
    trained_unix_ms: int = 0      # when the learner's step finished computing it (0: unknown)


@dataclass(frozen=True)
class SnapshotRecord:
    """What the snapshot beside a version must be: written after the snapshot, so that a
    snapshot counts (for pruning and rebuilding) only once it can be checked."""

    model: str
    version: int
    bytes: int
    payload_xxh3_128: str
    manifest_hash: str


@dataclass(frozen=True)
class Quarantine:
    """One damaged or missing entry, moved aside. `what`: record, payload, keyframe or snapshot."""

    model: str
    version: int
    what: str
    reason: str
    incident: int                       # unique per quarantine (nanoseconds since the epoch)
    directory: str                      # where the files went, relative to the store root
    files: tuple[str, ...] = ()         # the files moved there (none when all were missing)
    rebuilt: str = ""                   # how the version lives on, if it does

    def to_json(self) -> str:
        return json.dumps(asdict(self) | {"files": list(self.files)}, sort_keys=True)


OnQuarantine = Callable[[Quarantine], None]


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


def payload_digest(data: bytes) -> str:
    return xxhash.xxh3_128_hexdigest(data)


# ---------------------------------------------------------------- sealed JSON records


def _canonical(content: dict[str, Any]) -> str:
    return json.dumps(content, sort_keys=True, separators=(",", ":"))


def _seal(content: dict[str, Any]) -> str:
    return xxhash.xxh3_128_hexdigest(_canonical(content).encode())


def sealed_json(entry: StoredVersion | SnapshotRecord) -> str:
    """A record as written to disk: its fields plus the xxh3-128 of their canonical JSON."""
    content = asdict(entry)
    return _canonical(content | {SEAL_FIELD: _seal(content)})


_Entry = TypeVar("_Entry", StoredVersion, SnapshotRecord)


def _unseal(text: str, cls: type[_Entry]) -> _Entry:
    """Parses a sealed record strictly: JSON object, seal intact, exactly the fields of `cls`
    with exactly their types (bool is not an int)."""
    try:
        content = json.loads(text)
    except ValueError as exc:
        raise _Unreadable(f"is not JSON ({exc})") from None
    if not isinstance(content, dict):
        raise _Unreadable(f"is a JSON {type(content).__name__}, not an object")
    seal = content.pop(SEAL_FIELD, None)
    if seal != _seal(content):
        raise _Unreadable(f"has no {SEAL_FIELD}, or one that does not match its content")
    expected = {f.name: f.type for f in fields(cls)}
    required = set(expected) - ADDED_LATER
    if not required <= set(content) <= set(expected):
        raise _Unreadable(f"has fields {sorted(content)}, expected {sorted(expected)}")
    for name, type_name in expected.items():
        if name in content and type(content[name]).__name__ != type_name:
            raise _Unreadable(f"field {name!r} is {content[name]!r}, not of type {type_name}")
    return cls(**content)


def _problem(entry: StoredVersion | SnapshotRecord, model: str, version: int) -> str | None:
    """What is inconsistent in a record that parsed (None: nothing)."""
    if entry.model != model or entry.version != version:
        return f"names version {entry.version} of {entry.model!r}, but is the record of version {version} of {model!r}"
    if entry.bytes < 0:
        return f"field 'bytes' is negative ({entry.bytes})"
    if not _HEX128_RE.match(entry.payload_xxh3_128):
        return "field 'payload_xxh3_128' is not 32 lower-case hex digits"
    if entry.manifest_hash and not _HEX128_RE.match(entry.manifest_hash):
        return "field 'manifest_hash' is not 32 lower-case hex digits"
    if isinstance(entry, StoredVersion):
        if entry.kind not in ("keyframe", "delta"):
            return f"field 'kind' is {entry.kind!r}, neither keyframe nor delta"
        if entry.kind == "delta" and not 1 <= entry.base_version < entry.version:
            return f"a delta of version {entry.version} cannot have base_version {entry.base_version}"
        if entry.kind == "keyframe" and entry.base_version != 0:
            return f"a keyframe cannot have base_version {entry.base_version}"
        if min(entry.step, entry.created_unix_ms, entry.raw_bytes, entry.trained_unix_ms) < 0:
            return "fields 'step', 'created_unix_ms', 'raw_bytes' and 'trained_unix_ms' cannot be negative"
    return None


def _parse(text: str, cls: type[_Entry], model: str, version: int) -> _Entry:
    entry = _unseal(text, cls)
    problem = _problem(entry, model, version)
    if problem:
        raise _Unreadable(problem)
    return entry


def _write_tmp(path: Path, data: bytes) -> Path:
    """Writes and fsyncs a temporary file beside `path` (renamed into place by the caller)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{time.monotonic_ns()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return tmp


def _write_atomically(path: Path, data: bytes) -> None:
    os.replace(_write_tmp(path, data), path)


# ---------------------------------------------------------------- writing


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
        problem = _problem(self.meta, self.meta.model, self.meta.version)
        if problem:
            self.abort()
            raise PayloadMismatch(f"record: {problem}")
        with self.store.lock:
            latest = self.store.latest(self.meta.model)
            if latest is not None and latest.version >= self.meta.version:
                self.abort()
                raise StaleVersion(f"version {self.meta.version} of {self.meta.model} is not newer than "
                                   f"{latest.version}")
            # Payload first, made durable before the record that makes the version visible.
            os.replace(self.tmp, self.store.payload_path(self.meta.model, self.meta.version))
            fsync_dir(self.dir)
            self.store.write_record(self.meta)
            self.store.prune(self.meta.model)
        return self.meta

    def abort(self) -> None:
        if not self._file.closed:
            self._file.close()
        self.tmp.unlink(missing_ok=True)


# ---------------------------------------------------------------- the store


@dataclass
class _Listing:
    """One model directory's file names and sizes, read once."""

    sizes: dict[str, int] = field(default_factory=dict)

    @classmethod
    def read(cls, directory: Path) -> _Listing:
        listing = cls()
        if directory.is_dir():
            with os.scandir(directory) as entries:
                for entry in entries:
                    if entry.name.startswith("."):
                        continue  # a temporary being written, which may be renamed while we look
                    try:
                        if entry.is_file(follow_symlinks=False):
                            listing.sizes[entry.name] = entry.stat(follow_symlinks=False).st_size
                    except FileNotFoundError:
                        continue  # removed or renamed since the directory was read
        return listing


class VersionStore:
    def __init__(self, root: Path, retention: int = 8, *, on_quarantine: OnQuarantine | None = None) -> None:
        if retention < 1:
            raise ValueError("retention must keep at least one version")
        self.root = Path(root)
        self.retention = retention
        self.on_quarantine = on_quarantine
        # Renames that make, change or drop a version, and the quarantines that check against
        # them, happen under this lock: a reader never takes a version being committed or pruned
        # for a damaged one, and one damage found by two readers is quarantined once.
        self.lock = threading.RLock()
        self._lost: dict[tuple[str, int], list[str]] = {}
        self._last_incident = 0
        self.root.mkdir(parents=True, exist_ok=True)
        self._read_quarantine()
        self._remove_temporaries()
        for model in self.models():
            self.check(model)

    # ------------------------------------------------------------ paths

    def model_dir(self, model: str) -> Path:
        validate_model_name(model)
        return self.root / model

    def payload_path(self, model: str, version: int) -> Path:
        return self.model_dir(model) / f"{version:012d}.bin"

    def record_path(self, model: str, version: int) -> Path:
        return self.model_dir(model) / f"{version:012d}.json"

    def snapshot_path(self, model: str, version: int) -> Path:
        return self.model_dir(model) / f"{version:012d}.snapshot"

    def snapshot_record_path(self, model: str, version: int) -> Path:
        return self.model_dir(model) / f"{version:012d}.snapshot.json"

    def kept_path(self, model: str, version: int) -> Path:
        return self.model_dir(model) / f"{version:012d}.kept"

    def _snapshot_files(self, model: str, version: int) -> list[Path]:
        return [self.snapshot_path(model, version), self.snapshot_record_path(model, version)]

    def _version_files(self, model: str, version: int) -> list[Path]:
        """Record first: removing them in this order never leaves a record without its payload."""
        return [self.record_path(model, version), self.payload_path(model, version),
                *self._snapshot_files(model, version), self.kept_path(model, version)]

    # ------------------------------------------------------------ records

    def write_record(self, meta: StoredVersion) -> None:
        """Writes a version's record atomically (this is what makes the version visible)."""
        path = self.record_path(meta.model, meta.version)
        _write_atomically(path, sealed_json(meta).encode())
        fsync_dir(path.parent)

    def _load(self, model: str, version: int) -> StoredVersion:
        """The version's record; FileNotFoundError if there is none, _Unreadable if damaged."""
        return _parse(self.record_path(model, version).read_text(errors="replace"), StoredVersion, model, version)

    def get(self, model: str, version: int) -> StoredVersion:
        try:
            return self._load(model, version)
        except FileNotFoundError:
            return self._without_record(model, version)
        except _Unreadable as exc:
            raise self._lose_record(model, version, str(exc)) from None

    def _lose_record(self, model: str, version: int, problem: str) -> StoreError:
        """Quarantines a version whose record is damaged (once) and returns the reader's error."""
        with self.lock:
            try:
                self._load(model, version)
                return DamagedEntry(model, version, "record", f"{problem} (rewritten meanwhile)")
            except FileNotFoundError:
                return self._missing_error(model, version)
            except _Unreadable:
                return DamagedEntry.of(self._quarantine_version(model, version, "record", problem))

    def _without_record(self, model: str, version: int) -> StoredVersion:
        """A version without a record: a lost record when its files remain (quarantined), else unknown."""
        with self.lock:
            if self.record_path(model, version).exists():
                return self.get(model, version)  # committed meanwhile
            if any(p.exists() for p in self._version_files(model, version)):
                raise DamagedEntry.of(self._quarantine_version(model, version, "record", "is missing"))
        raise self._missing_error(model, version)

    def _missing_error(self, model: str, version: int) -> StoreError:
        lost = self.lost(model, version)
        if lost:
            return DataLoss(f"version {version} of {model} was quarantined: {lost}")
        return UnknownVersion(f"version {version} of {model} is not stored")

    def versions(self, model: str) -> list[StoredVersion]:
        """The model's versions whose record is valid and whose payload is there at its recorded
        size (damaged ones are quarantined on the way), oldest first."""
        listing = _Listing.read(self.model_dir(model))
        found = (self._listed(model, int(match.group(1)), listing)
                 for name in sorted(listing.sizes) if (match := _RECORD_FILE_RE.match(name)))
        return [stored for stored in found if stored is not None]

    def _listed(self, model: str, version: int, listing: _Listing) -> StoredVersion | None:
        try:
            stored = self._load(model, version)
        except FileNotFoundError:
            return None  # pruned or quarantined meanwhile
        except _Unreadable as exc:
            self._lose_record(model, version, str(exc))
            return None
        size = listing.sizes.get(self.payload_path(model, version).name)
        if size == stored.bytes:
            return stored
        problem = "is missing" if size is None else f"has {size} bytes, its record says {stored.bytes}"
        return self._lose_payload(stored, problem, recheck_size=True)

    def models(self) -> list[str]:
        return sorted(p.name for p in self.root.iterdir() if p.is_dir() and _MODEL_RE.match(p.name))

    def latest(self, model: str) -> StoredVersion | None:
        versions = self.versions(model)
        return versions[-1] if versions else None

    def lost(self, model: str, version: int) -> str:
        """Why a version was quarantined ("" if it was not)."""
        return "; ".join(self._lost.get((model, version), []))

    # ------------------------------------------------------------ payloads

    def read_payload(self, model: str, version: int) -> bytes:
        """The version's payload, checked against its record's size and xxh3-128."""
        stored = self.get(model, version)
        try:
            data = self.payload_path(model, version).read_bytes()
        except FileNotFoundError:
            raise self._payload_error(stored, "is missing") from None
        if len(data) != stored.bytes:
            raise self._payload_error(stored, f"has {len(data)} bytes, its record says {stored.bytes}")
        digest = payload_digest(data)
        if digest != stored.payload_xxh3_128:
            raise self._payload_error(stored, f"hashes to {digest}, its record says {stored.payload_xxh3_128}")
        return data

    def quarantine_payload(self, stored: StoredVersion, problem: str) -> StoreError:
        """For a payload that matches its record but cannot be used (it does not decode to the
        recorded weights): quarantines it and returns the error to raise."""
        return self._payload_error(stored, problem)

    def _payload_error(self, stored: StoredVersion, problem: str) -> StoreError:
        now = self._lose_payload(stored, problem)
        if now is None and not self.record_path(stored.model, stored.version).exists():
            missing = self._missing_error(stored.model, stored.version)
            if isinstance(missing, UnknownVersion):
                return missing  # pruned while it was read
        what = "keyframe" if stored.kind == "keyframe" else "payload"
        rebuilt = "; its snapshot is its payload from now on (a keyframe)" if now is not None else ""
        return DamagedEntry(stored.model, stored.version, what, problem + rebuilt)

    def _lose_payload(self, stored: StoredVersion, problem: str, *, recheck_size: bool = False
                      ) -> StoredVersion | None:
        """Quarantines a version's payload and returns the version as it stands afterwards: a
        keyframe whose payload is its snapshot when that verifies, None when the version is gone."""
        with self.lock:
            try:
                current = self._load(stored.model, stored.version)
            except (FileNotFoundError, _Unreadable):
                return None  # pruned or quarantined meanwhile
            if current != stored:
                return current  # promoted meanwhile
            if recheck_size and self._payload_size(stored) == stored.bytes:
                return stored  # the listing raced a commit: nothing is wrong
            what = "keyframe" if stored.kind == "keyframe" else "payload"
            snapshot = self._verified_snapshot(stored)
            if snapshot is None:
                self._quarantine_version(stored.model, stored.version, what, problem)
                return None
            self._quarantine(stored.model, stored.version, what, problem,
                             [self.payload_path(stored.model, stored.version)],
                             rebuilt="its snapshot is its payload from now on (a keyframe)")
            return self._promote(stored, snapshot)

    def _payload_size(self, stored: StoredVersion) -> int | None:
        try:
            return self.payload_path(stored.model, stored.version).stat().st_size
        except FileNotFoundError:
            return None

    def _promote(self, stored: StoredVersion, snapshot: SnapshotRecord) -> StoredVersion:
        """Makes a version's snapshot its payload (call with the lock held)."""
        promoted = replace(stored, kind="keyframe", base_version=0, bytes=snapshot.bytes,
                           payload_xxh3_128=snapshot.payload_xxh3_128)
        # Record first: a crash before the rename leaves a record whose payload is missing and
        # whose snapshot is still there, which the next check promotes again.
        self.write_record(promoted)
        os.replace(self.snapshot_path(stored.model, stored.version), self.payload_path(stored.model, stored.version))
        self.snapshot_record_path(stored.model, stored.version).unlink(missing_ok=True)
        fsync_dir(self.model_dir(stored.model))
        return promoted

    # ------------------------------------------------------------ snapshots

    def write_snapshot(self, model: str, version: int, payload: bytes) -> None:
        """A keyframe of a stored version, written atomically beside it, then its record (a
        snapshot counts only once its record is there). Versions that only the snapshot's
        absence kept (to rebuild this one) are pruned then."""
        stored = self.get(model, version)
        path = self.snapshot_path(model, version)
        tmp = _write_tmp(path, payload)
        record = SnapshotRecord(model, version, len(payload), payload_digest(payload), stored.manifest_hash)
        try:
            with self.lock:
                if self.get(model, version) != stored:
                    raise UnknownVersion(f"version {version} of {model} changed while its snapshot was written")
                os.replace(tmp, path)
                _write_atomically(self.snapshot_record_path(model, version), sealed_json(record).encode())
                fsync_dir(path.parent)
                self.prune(model)
        finally:
            tmp.unlink(missing_ok=True)

    def has_snapshot(self, model: str, version: int) -> bool:
        return all(p.exists() for p in self._snapshot_files(model, version))

    def read_snapshot(self, model: str, version: int) -> bytes:
        """The snapshot beside a version, checked against its record's size and xxh3-128."""
        stored = self.get(model, version)
        _, data, problem = self._snapshot(stored, read=True)
        if problem:
            raise self._lose_snapshot(stored, problem)
        return data

    def quarantine_snapshot(self, stored: StoredVersion, problem: str) -> StoreError:
        """For a snapshot that matches its record but does not decode to the version's weights:
        quarantines it and returns the error to raise."""
        return self._lose_snapshot(stored, problem)

    def _snapshot(self, stored: StoredVersion, *, read: bool) -> tuple[SnapshotRecord | None, bytes, str]:
        """The snapshot's record and bytes (b"" unless `read`) and "", or what is wrong with them."""
        model, version = stored.model, stored.version
        try:
            record = _parse(self.snapshot_record_path(model, version).read_text(errors="replace"), SnapshotRecord,
                            model, version)
        except FileNotFoundError:
            return None, b"", "has no record beside it"
        except _Unreadable as exc:
            return None, b"", f"record {exc}"
        if record.manifest_hash != stored.manifest_hash:
            return None, b"", f"record names manifest {record.manifest_hash}, the version's is {stored.manifest_hash}"
        path = self.snapshot_path(model, version)
        try:
            data = path.read_bytes() if read else b""
            size = len(data) if read else path.stat().st_size
        except FileNotFoundError:
            return None, b"", "is missing"
        if size != record.bytes:
            return None, b"", f"has {size} bytes, its record says {record.bytes}"
        if read and (digest := payload_digest(data)) != record.payload_xxh3_128:
            return None, b"", f"hashes to {digest}, its record says {record.payload_xxh3_128}"
        return record, data, ""

    def _verified_snapshot(self, stored: StoredVersion) -> SnapshotRecord | None:
        """The record of the version's snapshot if there is one and it verifies (read in full);
        a damaged one is quarantined."""
        if not any(p.exists() for p in self._snapshot_files(stored.model, stored.version)):
            return None
        record, _, problem = self._snapshot(stored, read=True)
        if problem:
            self._lose_snapshot(stored, problem)
        return record

    def _lose_snapshot(self, stored: StoredVersion, problem: str) -> StoreError:
        """Quarantines a version's snapshot (once) and returns the reader's error; the version
        keeps its payload (rebuilt through the deltas below it, where they remain)."""
        with self.lock:
            if not self.record_path(stored.model, stored.version).exists():
                return self._missing_error(stored.model, stored.version)
            files = self._snapshot_files(stored.model, stored.version)
            if not any(p.exists() for p in files):
                return DamagedEntry(stored.model, stored.version, "snapshot", problem)  # quarantined meanwhile
            return DamagedEntry.of(self._quarantine(stored.model, stored.version, "snapshot", problem, files))

    def is_base_point(self, stored: StoredVersion) -> bool:
        """Whether the version can be rebuilt from its own files alone."""
        return stored.kind != "delta" or self.has_snapshot(stored.model, stored.version)

    # ------------------------------------------------------------ quarantine

    def _quarantine_version(self, model: str, version: int, what: str, reason: str) -> Quarantine:
        """Moves every file of a version aside: without a valid record or payload it is gone."""
        return self._quarantine(model, version, what, reason, self._version_files(model, version))

    def _quarantine(self, model: str, version: int, what: str, reason: str, files: list[Path],
                    rebuilt: str = "") -> Quarantine:
        with self.lock:
            # Strictly increasing: it names the quarantine's folder and its dead letter.
            incident = self._last_incident = max(time.time_ns(), self._last_incident + 1)
            directory = self.model_dir(model) / QUARANTINE_DIR / f"{version:012d}.{what}.{incident}"
            directory.mkdir(parents=True, exist_ok=True)
            moved = []
            for path in files:
                if path.exists():
                    os.replace(path, directory / path.name)
                    moved.append(path.name)
            quarantine = Quarantine(model, version, what, reason, incident, str(directory.relative_to(self.root)),
                                    tuple(moved), rebuilt)
            _write_atomically(directory / "reason.json", quarantine.to_json().encode())
            fsync_dir(directory)
            fsync_dir(self.model_dir(model))
            self._lost.setdefault((model, version), []).append(f"{what} {reason}")
        self._report(quarantine)
        return quarantine

    def _report(self, quarantine: Quarantine) -> None:
        WEIGHTS_QUARANTINED.labels(quarantine.what).inc()
        log.error("weights_quarantined", model=quarantine.model, version=quarantine.version, what=quarantine.what,
                  reason=quarantine.reason, moved=list(quarantine.files), to=quarantine.directory,
                  rebuilt=quarantine.rebuilt or None)
        if self.on_quarantine is not None:
            try:
                self.on_quarantine(quarantine)
            except Exception as exc:  # reporting must not turn a handled damage into a failed read
                log.error("quarantine_report_failed", model=quarantine.model, version=quarantine.version,
                          error=repr(exc))

    def _read_quarantine(self) -> None:
        """Remembers what earlier runs quarantined, so that asking for it says so."""
        for reason in self.root.glob(f"*/{QUARANTINE_DIR}/*/reason.json"):
            try:
                content = json.loads(reason.read_text(errors="replace"))
                key = (str(content["model"]), int(content["version"]))
                self._lost.setdefault(key, []).append(f"{content['what']} {content['reason']}")
            except (ValueError, KeyError, TypeError):
                log.warning("quarantine_reason_unreadable", path=str(reason))

    # ------------------------------------------------------------ start-up check

    def _remove_temporaries(self) -> None:
        for tmp in [*self.root.glob("*/.*.tmp"), *self.root.glob("*/*.json.tmp")]:
            tmp.unlink(missing_ok=True)

    def check(self, model: str) -> list[StoredVersion]:
        """Checks a model's records, payload sizes and snapshots (payload and snapshot hashes
        are checked on every read) and deals with files that have no record; returns the versions."""
        with self.lock:
            versions = self.versions(model)
            self._clean_orphans(model, versions)
            for stored in versions:
                if any(p.exists() for p in self._snapshot_files(model, stored.version)):
                    _, _, problem = self._snapshot(stored, read=False)
                    if problem:
                        self._lose_snapshot(stored, problem)
            return self.versions(model)

    def _clean_orphans(self, model: str, versions: list[StoredVersion]) -> None:
        """Files without a record: what a crash while storing (newer than every record) or pruning
        (older, needed by nothing) left is removed; anything else lost its record."""
        listing = _Listing.read(self.model_dir(model))
        recorded = {v.version for v in versions}
        orphans = {int(m.group(1)) for name in listing.sizes if (m := _DATA_FILE_RE.match(name))} - recorded
        for version in sorted(orphans):
            if self.record_path(model, version).exists():
                continue
            needed = any(v.kind == "delta" and v.base_version == version and not self.is_base_point(v)
                         for v in versions)
            if not recorded or version > max(recorded) or (version < min(recorded) and not needed):
                for path in self._version_files(model, version):
                    path.unlink(missing_ok=True)
                log.info("store_leftover_removed", model=model, version=version)
            else:
                self._quarantine_version(model, version, "record", "is missing")

    # ------------------------------------------------------------ versions

    def begin(self, meta: StoredVersion) -> VersionWriter:
        validate_model_name(meta.model)
        if meta.version < 1:
            raise StaleVersion(f"versions start at 1, got {meta.version}")
        latest = self.latest(meta.model)
        if latest is not None and latest.version >= meta.version:
            raise StaleVersion(f"version {meta.version} of {meta.model} is not newer than {latest.version}")
        return VersionWriter(self, meta)

    def keep(self, model: str, version: int, reason: str) -> StoredVersion:
        """Marks a stored version as kept past the retention window (durably); prune spares it
        and the versions rebuilding it needs. Raises UnknownVersion (or DataLoss) when it is not stored."""
        with self.lock:
            stored = self.get(model, version)
            if not self.is_kept(model, version):
                _write_atomically(self.kept_path(model, version),
                                  json.dumps({"reason": reason, "kept_unix_ms": int(time.time() * 1000)}).encode())
                fsync_dir(self.model_dir(model))
            return stored

    def is_kept(self, model: str, version: int) -> bool:
        return self.kept_path(model, version).exists()

    def prune(self, model: str) -> list[int]:
        """Deletes versions older than the newest `retention`, except those needed to rebuild
        the oldest kept one (back to the newest keyframe or snapshot at or before it), and kept
        versions (`keep`) with what rebuilding them needs."""
        with self.lock:
            versions = self.versions(model)
            keep_from = max(0, len(versions) - self.retention)
            while keep_from > 0 and not self.is_base_point(versions[keep_from]):
                keep_from -= 1
            by_version = {v.version: v for v in versions}
            spared: set[int] = set()
            for stored in versions[:keep_from]:
                if not self.is_kept(model, stored.version):
                    continue
                current: StoredVersion | None = stored
                while current is not None and current.version not in spared:
                    spared.add(current.version)
                    current = None if self.is_base_point(current) else by_version.get(current.base_version)
            dropped = [v.version for v in versions[:keep_from] if v.version not in spared]
            for version in dropped:
                for path in self._version_files(model, version):
                    path.unlink(missing_ok=True)
            return dropped
