"""Versions on disk: atomic, increasing, verified, pruned; crash leftovers cleaned."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from policyloop.weights.store import (
    PayloadMismatch,
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
