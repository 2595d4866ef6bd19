"""Versions on disk: atomic, increasing, verified, pruned; crash leftovers cleaned; what was
damaged on disk quarantined and reported, and the store still opens."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from prometheus_client import REGISTRY

from policyloop.weights.store import (
    DamagedEntry,
    DataLoss,
    PayloadMismatch,
    Quarantine,
    StaleVersion,
    StoredVersion,
    UnknownVersion,
    VersionStore,
    payload_digest,
)


def meta(version: int, payload: bytes, model: str = "m") -> StoredVersion:
    return StoredVersion(model, version, version, "raw", len(payload), payload_digest(payload), 0)


def put(store: VersionStore, version: int, payload: bytes) -> StoredVersion:
    writer = store.begin(meta(version, payload))
    for i in range(0, len(payload), 1000):
        writer.write(payload[i:i + 1000])
    return writer.commit()


def test_put_read_and_prune(tmp_path: Path) -> None:
    store = VersionStore(tmp_path, retention=2)
    payloads = {v: os.urandom(5000 + v) for v in (1, 2, 3)}
    for v, p in payloads.items():
        put(store, v, p)
    assert [v.version for v in store.versions("m")] == [2, 3]
    assert store.read_payload("m", 3) == payloads[3]
    with pytest.raises(UnknownVersion):
        store.get("m", 1)
    assert store.models() == ["m"]


def test_versions_only_increase(tmp_path: Path) -> None:
    store = VersionStore(tmp_path)
    put(store, 4, b"abc")
    with pytest.raises(StaleVersion, match="not newer than 4"):
        store.begin(meta(4, b"abc"))
    with pytest.raises(StaleVersion, match="start at 1"):
        store.begin(meta(0, b"abc"))


def test_mismatched_payload_is_refused_and_leaves_nothing(tmp_path: Path) -> None:
    store = VersionStore(tmp_path)
    writer = store.begin(meta(1, b"hello world"))
    writer.write(b"hello worle")
    with pytest.raises(PayloadMismatch, match="xxh3-128"):
        writer.commit()
    writer = store.begin(meta(1, b"hello world"))
    writer.write(b"hello")
    with pytest.raises(PayloadMismatch, match="5 bytes"):
        writer.commit()
    writer = store.begin(meta(1, b"hi"))
    with pytest.raises(PayloadMismatch, match="longer"):
        writer.write(b"hi!")
    writer.abort()
    assert store.versions("m") == [] and list((tmp_path / "m").iterdir()) == []


def test_a_crash_mid_write_leaves_the_previous_version(tmp_path: Path) -> None:
    store = VersionStore(tmp_path)
    put(store, 1, b"one")
    # What a crash can leave: a temporary payload, and a payload renamed without its record.
    (tmp_path / "m" / ".000000000002.123.456.tmp").write_bytes(b"partial")
    (tmp_path / "m" / "000000000003.bin").write_bytes(b"orphan")
    reopened = VersionStore(tmp_path)
    assert [v.version for v in reopened.versions("m")] == [1]
    assert sorted(p.name for p in (tmp_path / "m").iterdir()) == ["000000000001.bin", "000000000001.json"]
    put(reopened, 2, b"two")


def test_model_names_cannot_escape_the_store(tmp_path: Path) -> None:
    store = VersionStore(tmp_path)
    with pytest.raises(ValueError):
        store.begin(meta(1, b"x", model="../x"))


def put_kind(store: VersionStore, version: int, kind: str) -> StoredVersion:
    payload = f"payload {version}".encode()
    record = StoredVersion("m", version, version, "c", len(payload), payload_digest(payload), 0, kind=kind,
                           base_version=version - 1 if kind == "delta" else 0)
    writer = store.begin(record)
    writer.write(payload)
    return writer.commit()


def test_pruning_keeps_what_rebuilding_the_oldest_kept_version_needs(tmp_path: Path) -> None:
    store = VersionStore(tmp_path, retention=2)
    put_kind(store, 1, "keyframe")
    for v in (2, 3, 4):
        put_kind(store, v, "delta")
    # 3 and 4 are kept; 3 is a delta, so the chain back to keyframe 1 stays.
    assert [v.version for v in store.versions("m")] == [1, 2, 3, 4]
    store.write_snapshot("m", 3, b"snapshot of 3")
    put_kind(store, 5, "delta")
    # 4 and 5 kept; 4 needs 3, which has a snapshot: 1 and 2 go.
    assert [v.version for v in store.versions("m")] == [3, 4, 5]
    assert store.read_snapshot("m", 3) == b"snapshot of 3"
    put_kind(store, 6, "keyframe")
    put_kind(store, 7, "delta")
    assert [v.version for v in store.versions("m")] == [6, 7]
    assert not store.snapshot_path("m", 3).exists()
    # A snapshot left half-written by a crash, or orphaned, is cleaned at start.
    (tmp_path / "m" / ".000000000007.snapshot.1.2.tmp").write_bytes(b"partial")
    (tmp_path / "m" / "000000000009.snapshot").write_bytes(b"orphan")
    VersionStore(tmp_path)
    assert sorted(p.name for p in (tmp_path / "m").iterdir()) == [
        "000000000006.bin", "000000000006.json", "000000000007.bin", "000000000007.json"]


# ---------------------------------------------------------------- what is read back is checked


def sealed(content: dict) -> str:
    """A record whose seal matches its content: only the field checks can refuse it."""
    import xxhash

    canonical = json.dumps(content, sort_keys=True, separators=(",", ":"))
    return json.dumps(content | {"record_xxh3_128": xxhash.xxh3_128_hexdigest(canonical.encode())})


def fields_of(path: Path) -> dict:
    content = json.loads(path.read_text())
    content.pop("record_xxh3_128")
    return content


def reasons(root: Path, model: str = "m") -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((root / model).glob("quarantine/*/reason.json"))]


RECORD_DAMAGE = {
    "garbage": lambda path: path.write_text("{\"model\": "),
    "empty": lambda path: path.write_bytes(b""),
    "a list": lambda path: path.write_text("[]"),
    "edited": lambda path: path.write_text(json.dumps(json.loads(path.read_text()) | {"step": 99})),
    "no seal": lambda path: path.write_text(json.dumps(fields_of(path))),
    "wrong types": lambda path: path.write_text(sealed(fields_of(path) | {"bytes": "3"})),
    "a bool for an int": lambda path: path.write_text(sealed(fields_of(path) | {"step": True})),
    "an extra field": lambda path: path.write_text(sealed(fields_of(path) | {"extra": 1})),
    "a field missing": lambda path: path.write_text(sealed({k: v for k, v in fields_of(path).items() if k != "kind"})),
    "another version's": lambda path: path.write_text(sealed(fields_of(path) | {"version": 1})),
    "negative bytes": lambda path: path.write_text(sealed(fields_of(path) | {"bytes": -1})),
    "a bad hash": lambda path: path.write_text(sealed(fields_of(path) | {"payload_xxh3_128": "xyz"})),
    "an unknown kind": lambda path: path.write_text(sealed(fields_of(path) | {"kind": "diff"})),
    "a delta from itself": lambda path: path.write_text(sealed(fields_of(path) | {"kind": "delta", "base_version": 2})),
}


def test_a_record_written_before_a_later_field_reads_as_its_default(tmp_path: Path) -> None:
    store = VersionStore(tmp_path)
    put(store, 1, b"one")
    path = store.record_path("m", 1)
    path.write_text(sealed({k: v for k, v in fields_of(path).items() if k != "trained_unix_ms"}))
    [stored] = VersionStore(tmp_path).versions("m")
    assert stored.version == 1 and stored.trained_unix_ms == 0


@pytest.mark.parametrize("damage", sorted(RECORD_DAMAGE))
def test_a_damaged_record_is_quarantined_at_start_and_the_store_opens(tmp_path: Path, damage: str) -> None:
    store = VersionStore(tmp_path)
    put(store, 1, b"one")
    put(store, 2, b"two")
    RECORD_DAMAGE[damage](store.record_path("m", 2))
    seen: list[Quarantine] = []
    reopened = VersionStore(tmp_path, on_quarantine=seen.append)
    assert [v.version for v in reopened.versions("m")] == [1]
    [quarantine] = seen
    assert (quarantine.version, quarantine.what, quarantine.files) == (2, "record", ("000000000002.json",
                                                                                     "000000000002.bin"))
    assert reasons(tmp_path) == [json.loads(quarantine.to_json())]
    assert sorted(p.name for p in (tmp_path / quarantine.directory).iterdir()) == [
        "000000000002.bin", "000000000002.json", "reason.json"]
    with pytest.raises(DataLoss, match="version 2 of m was quarantined: record"):
        reopened.get("m", 2)
    put(reopened, 3, b"three")  # later versions are stored as usual
    assert [v.version for v in VersionStore(tmp_path).versions("m")] == [1, 3]


def test_payloads_are_checked_on_every_read(tmp_path: Path) -> None:
    seen: list[Quarantine] = []
    store = VersionStore(tmp_path, on_quarantine=seen.append)
    put(store, 1, b"one")
    put(store, 2, b"two")
    before = REGISTRY.get_sample_value("policyloop_weights_quarantined_total", {"what": "keyframe"}) or 0
    store.payload_path("m", 2).write_bytes(b"twO")  # same size: only the hash tells
    with pytest.raises(DamagedEntry, match="version 2 of m: keyframe hashes to"):
        store.read_payload("m", 2)
    with pytest.raises(DataLoss, match="was quarantined: keyframe hashes to"):
        store.read_payload("m", 2)
    assert [(q.version, q.what) for q in seen] == [(2, "keyframe")]
    assert REGISTRY.get_sample_value("policyloop_weights_quarantined_total", {"what": "keyframe"}) == before + 1
    store.payload_path("m", 1).unlink()
    assert store.versions("m") == []  # a missing payload is found by listing, too
    assert [(q.version, q.what, q.reason) for q in seen][1:] == [(1, "keyframe", "is missing")]
    with pytest.raises(UnknownVersion):
        store.get("m", 3)


def test_a_delta_whose_payload_is_lost_becomes_its_snapshot(tmp_path: Path) -> None:
    store = VersionStore(tmp_path)
    put_kind(store, 1, "keyframe")
    put_kind(store, 2, "delta")
    store.write_snapshot("m", 2, b"snapshot of 2")
    assert store.has_snapshot("m", 2) and store.read_snapshot("m", 2) == b"snapshot of 2"
    store.payload_path("m", 2).write_bytes(b"payload 3")
    with pytest.raises(DamagedEntry, match="its snapshot is its payload"):
        store.read_payload("m", 2)
    promoted = store.get("m", 2)
    assert (promoted.kind, promoted.base_version, promoted.bytes) == ("keyframe", 0, len(b"snapshot of 2"))
    assert store.read_payload("m", 2) == b"snapshot of 2" and not store.has_snapshot("m", 2)
    [reason] = reasons(tmp_path)
    assert (reason["what"], reason["files"]) == ("payload", ["000000000002.bin"]) and reason["rebuilt"]


SNAPSHOT_DAMAGE = {
    "flipped": (".snapshot", lambda path: path.write_bytes(b"snapshot of 3")),
    "truncated": (".snapshot", lambda path: path.write_bytes(b"snap")),
    "missing": (".snapshot", lambda path: path.unlink()),
    "record missing": (".snapshot.json", lambda path: path.unlink()),
    "record garbage": (".snapshot.json", lambda path: path.write_text("{")),
    "record edited": (".snapshot.json", lambda path: path.write_text(json.dumps(json.loads(path.read_text())
                                                                              | {"bytes": 4}))),
}


@pytest.mark.parametrize("damage", sorted(SNAPSHOT_DAMAGE))
def test_a_damaged_snapshot_is_quarantined_and_its_version_keeps_its_payload(tmp_path: Path, damage: str) -> None:
    store = VersionStore(tmp_path)
    put_kind(store, 1, "keyframe")
    put_kind(store, 2, "delta")
    store.write_snapshot("m", 2, b"snapshot of 2")
    suffix, how = SNAPSHOT_DAMAGE[damage]
    how(tmp_path / "m" / f"{2:012d}{suffix}")
    reopened = VersionStore(tmp_path)
    if store.has_snapshot("m", 2):  # same size, other bytes: found when read
        with pytest.raises(DamagedEntry, match="version 2 of m: snapshot hashes to"):
            reopened.read_snapshot("m", 2)
    assert not reopened.has_snapshot("m", 2) and not reopened.is_base_point(reopened.get("m", 2))
    assert reopened.read_payload("m", 2) == b"payload 2"
    assert [(r["version"], r["what"]) for r in reasons(tmp_path)] == [(2, "snapshot")]
    assert not list((tmp_path / "m").glob("*.snapshot*"))


def test_files_without_a_record(tmp_path: Path) -> None:
    """A crash while storing leaves files newer than every record, one while pruning files
    older than every record that nothing needs: removed. Any other file lost its record."""
    store = VersionStore(tmp_path, retention=8)
    put_kind(store, 1, "keyframe")
    for v in (2, 3, 4):
        put_kind(store, v, "delta")
    store.record_path("m", 3).unlink()                 # lost: 4 needs it
    (tmp_path / "m" / f"{9:012d}.bin").write_bytes(b"crash while storing")
    reopened = VersionStore(tmp_path, retention=8)
    assert [v.version for v in reopened.versions("m")] == [1, 2, 4]
    assert [(r["version"], r["what"], r["reason"], r["files"]) for r in reasons(tmp_path)] == [
        (3, "record", "is missing", ["000000000003.bin"])]
    assert not (tmp_path / "m" / f"{9:012d}.bin").exists()

    other = tmp_path / "other"
    store = VersionStore(other, retention=8)
    put_kind(store, 1, "keyframe")
    put_kind(store, 2, "keyframe")
    put_kind(store, 3, "delta")
    store.record_path("m", 1).unlink()                 # what a crash while pruning leaves: 2 needs nothing
    store.record_path("m", 2).unlink()                 # lost: 3 is a delta from it
    VersionStore(other, retention=8)
    assert [(r["version"], r["what"]) for r in reasons(other)] == [(2, "record")]
    assert not store.payload_path("m", 1).exists()


def test_a_record_lost_while_running_is_quarantined_when_asked_for(tmp_path: Path) -> None:
    store = VersionStore(tmp_path)
    put(store, 1, b"one")
    put(store, 2, b"two")
    store.record_path("m", 1).unlink()
    with pytest.raises(DamagedEntry, match="version 1 of m: record is missing"):
        store.get("m", 1)
    with pytest.raises(DataLoss, match="was quarantined: record is missing"):
        store.get("m", 1)
    assert VersionStore(tmp_path).lost("m", 1) == "record is missing"  # remembered across restarts


def test_every_write_is_atomic_and_leaves_no_temporary(tmp_path: Path) -> None:
    store = VersionStore(tmp_path)
    put_kind(store, 1, "keyframe")
    put_kind(store, 2, "delta")
    store.write_snapshot("m", 2, b"snapshot of 2")
    assert sorted(p.name for p in (tmp_path / "m").iterdir()) == [
        "000000000001.bin", "000000000001.json", "000000000002.bin", "000000000002.json",
        "000000000002.snapshot", "000000000002.snapshot.json"]
    # What a crash mid-write of each leaves: a temporary of the record, the snapshot or its record.
    for name in ("000000000003.json", "000000000002.snapshot", "000000000002.snapshot.json"):
        (tmp_path / "m" / f".{name}.1.2.tmp").write_bytes(b"partial")
    (tmp_path / "m" / "000000000003.json.tmp").write_bytes(b"partial")
    VersionStore(tmp_path)
    assert not [p for p in (tmp_path / "m").iterdir() if p.name.endswith(".tmp")]
    assert reasons(tmp_path) == []
