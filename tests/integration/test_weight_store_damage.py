"""A publisher whose store was damaged while it was down — a payload, a snapshot, a keyframe or a
record flipped, truncated, missing, garbage or of the wrong types — starts, quarantines what is
damaged (a reason record beside it, a log line, a metric, a dead letter), stores the learner's
next versions (a keyframe where the delta's base is lost) and serves them: every replica reaches
the newest version exactly. Real gRPC servers on loopback; "restarted" is a new VersionStore and
WeightLibrary over the same directory."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import xxhash
from prometheus_client import REGISTRY

from policyloop.contracts.v1 import bus_pb2, weights_pb2
from policyloop.weights import codec
from policyloop.weights.client import WeightClient
from policyloop.weights.library import BaseUnavailable, PushRejected, Unrebuildable, WeightLibrary
from policyloop.weights.push import PushReport, VersionPusher
from policyloop.weights.server import OnStored, WeightServicer, failure_status, start_weight_server
from policyloop.weights.store import (
    DamagedEntry,
    DataLoss,
    PayloadMismatch,
    StaleVersion,
    StoredVersion,
    UnknownVersion,
    VersionStore,
)
from policyloop.weights.sync import sync_weights
from tests.helpers import eventually, perturbed, random_weights, stored
from tests.unit.test_version_store import sealed

MODEL = "policy"
SHAPES = {"embed": (96, 32), "layer.0.w": (32, 32), "norm": (32,)}


@dataclass(frozen=True)
class Publisher:
    library: WeightLibrary
    client: WeightClient


async def announce(_: StoredVersion) -> None:
    pass


@asynccontextmanager
async def publisher(root: Path, *, retention: int = 2, servicer: type[WeightServicer] = WeightServicer,
                    on_stored: OnStored = announce) -> AsyncIterator[Publisher]:
    """A publisher (library and servicer on a real gRPC server) over the store at `root`."""
    library = WeightLibrary(VersionStore(root, retention=retention), snapshot_every=2)
    server, port = await start_weight_server(servicer(library, on_stored=on_stored), host="127.0.0.1", port=0)
    pub = Publisher(library, WeightClient(f"127.0.0.1:{port}", deadline_s=20))
    try:
        yield pub
    finally:
        await pub.client.close()
        await server.stop(None)
        await library.drain()


def chain(count: int) -> list[codec.WeightSet]:
    versions = [random_weights(1, shapes=SHAPES)]
    for v in range(2, count + 1):
        versions.append(perturbed(versions[-1], v, seed=v))
    return versions


async def push_all(pub: Publisher, pusher: VersionPusher, versions: list[codec.WeightSet],
                   keyframes: tuple[int, ...] = ()) -> list[PushReport]:
    """Pushes each version (those in `keyframes` as keyframes), waiting for its snapshot, if any,
    so that pruning is the same every run."""
    pusher.client = pub.client
    reports = []
    for weights in versions:
        if weights.version in keyframes:
            pusher.confirmed = None
        reports.append(await pusher.push(weights, step=weights.version))
        await pub.library.drain()
    return reports


def same(a: codec.WeightSet, b: codec.WeightSet) -> bool:
    return a.version == b.version and a.manifest_hash == b.manifest_hash


def quarantined(root: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((root / MODEL).glob("quarantine/*/reason.json"))]


def counted(what: str) -> float:
    return REGISTRY.get_sample_value("policyloop_weights_quarantined_total", {"what": what}) or 0.0


# ---------------------------------------------------------------- kinds of damage


def path_of(root: Path, version: int, suffix: str) -> Path:
    return root / MODEL / f"{version:012d}{suffix}"


def flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40
    path.write_bytes(bytes(data))


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def wrong_types(path: Path) -> None:
    content = json.loads(path.read_text())
    content.pop("record_xxh3_128")
    path.write_text(sealed(content | {"version": str(content["version"]), "bytes": float(content["bytes"])}))


def edited(path: Path) -> None:
    content = json.loads(path.read_text())
    path.write_text(json.dumps(content | {"step": content["step"] + 1}))


def flipped_with_its_record(record_suffix: str) -> Callable[[Path], None]:
    """Damage whose record was rewritten to match it: only decoding the file finds it."""

    def damage(path: Path) -> None:
        flip(path)
        record = path.with_name(path.name[:12] + record_suffix)
        content = json.loads(record.read_text())
        content.pop("record_xxh3_128")
        record.write_text(sealed(content | {"payload_xxh3_128": xxhash.xxh3_128_hexdigest(path.read_bytes())}))

    return damage


@dataclass(frozen=True)
class Damage:
    what: str                            # the quarantine's `what`
    suffix: str                          # the file damaged: .bin, .snapshot, .snapshot.json, .json
    version: int                         # of the file damaged
    how: Callable[[Path], None]
    keyframe_at: int | None = None       # a keyframe pushed at this version (the layout's newest chain)


def delete(path: Path) -> None:
    path.unlink()


# Layout without keyframe_at (retention 2, a snapshot every 2 deltas): versions 5 (a delta with a
# snapshot) and 6 (a delta from 5); everything older was pruned. With keyframe_at=6 and 7
# versions: 6 (a keyframe) and 7 (a delta from 6). Each damage below is on the newest version's
# only route: after it, the learner's next delta has no base and a keyframe must follow.
DAMAGES = {
    "payload_flipped": Damage("payload", ".bin", 6, flip),
    "payload_truncated": Damage("payload", ".bin", 6, truncate),
    "payload_missing": Damage("payload", ".bin", 6, delete),
    "payload_flipped_with_its_record": Damage("payload", ".bin", 6, flipped_with_its_record(".json")),
    "snapshot_flipped": Damage("snapshot", ".snapshot", 5, flip),
    "snapshot_flipped_with_its_record": Damage("snapshot", ".snapshot", 5, flipped_with_its_record(".snapshot.json")),
    "snapshot_truncated": Damage("snapshot", ".snapshot", 5, truncate),
    "snapshot_missing": Damage("snapshot", ".snapshot", 5, delete),
    "snapshot_record_garbage": Damage("snapshot", ".snapshot.json", 5, lambda p: p.write_text("{]")),
    "keyframe_flipped": Damage("keyframe", ".bin", 6, flip, keyframe_at=6),
    "keyframe_truncated": Damage("keyframe", ".bin", 6, truncate, keyframe_at=6),
    "keyframe_missing": Damage("keyframe", ".bin", 6, delete, keyframe_at=6),
    "record_garbage_json": Damage("record", ".json", 6, lambda p: p.write_text("{\"model\": \"policy\", ver")),
    "record_empty": Damage("record", ".json", 6, lambda p: p.write_bytes(b"")),
    "record_not_an_object": Damage("record", ".json", 6, lambda p: p.write_text("[1, 2, 3]")),
    "record_wrong_types": Damage("record", ".json", 6, wrong_types),
    "record_edited": Damage("record", ".json", 6, edited),
    "record_flipped": Damage("record", ".json", 5, flip),
    "record_missing": Damage("record", ".json", 5, delete),
    "record_of_the_keyframe_missing": Damage("record", ".json", 6, delete, keyframe_at=6),
}


@pytest.mark.parametrize("name", sorted(DAMAGES))
async def test_a_damaged_store_keeps_serving_later_versions(tmp_path: Path, name: str) -> None:
    damage = DAMAGES[name]
    last = 7 if damage.keyframe_at else 6
    versions = chain(last + 2)
    pusher = VersionPusher(None, MODEL)  # type: ignore[arg-type]
    async with publisher(tmp_path) as pub:
        await push_all(pub, pusher, versions[:last], keyframes=(damage.keyframe_at,) if damage.keyframe_at else ())
        follower, _ = await sync_weights(pub.client, MODEL, None, last)
        lagging, _ = await sync_weights(pub.client, MODEL, None, last - 1)
    damaged = path_of(tmp_path, damage.version, damage.suffix)
    assert damaged.exists(), sorted(p.name for p in (tmp_path / MODEL).iterdir())
    damage.how(damaged)
    counted_before = counted(damage.what)

    async with publisher(tmp_path) as pub:  # restarted over the damaged store
        await pub.client.list_versions(MODEL)  # answers, whatever it lists
        # The learner's next versions are stored: a keyframe, as the delta's base was lost, then deltas.
        reports = await push_all(pub, pusher, versions[last:])
        assert [(r.version, r.kind) for r in reports] == [(last + 1, "keyframe"), (last + 2, "delta")]
        listed = {v.version: v for v in await pub.client.list_versions(MODEL)}
        assert listed[last + 2].manifest_hash == versions[-1].manifest_hash
        # Every replica reaches the newest version exactly: one that followed, one a version
        # behind, one with nothing.
        for held in (follower, lagging, None):
            synced, _ = await sync_weights(pub.client, MODEL, held, last + 2)
            assert same(synced, versions[-1]), name
            assert all(synced.tensors[n].data.tobytes() == versions[-1].tensors[n].data.tobytes()
                       for n in versions[-1].tensors)
    reasons = quarantined(tmp_path)
    assert damage.what in [r["what"] for r in reasons], reasons
    assert all(r["model"] == MODEL and r["reason"] for r in reasons)
    assert counted(damage.what) > counted_before

    async with publisher(tmp_path) as pub:  # and again: what was quarantined stays quarantined
        assert max(v.version for v in await pub.client.list_versions(MODEL)) == last + 2
    assert quarantined(tmp_path) == reasons


# ---------------------------------------------------------------- other routes


async def test_a_damaged_snapshot_gives_way_to_the_deltas_below_it(tmp_path: Path) -> None:
    versions = chain(8)
    pusher = VersionPusher(None, MODEL)  # type: ignore[arg-type]
    async with publisher(tmp_path, retention=8) as pub:
        await push_all(pub, pusher, versions[:6])  # 1 keyframe, 2, 3 (snapshot), 4, 5 (snapshot), 6
    flip(path_of(tmp_path, 5, ".snapshot"))
    async with publisher(tmp_path, retention=8) as pub:
        reports = await push_all(pub, pusher, versions[6:])
        assert [r.kind for r in reports] == ["delta", "delta"]  # 6 rebuilt through 4 and 3's snapshot
        synced, _ = await sync_weights(pub.client, MODEL, None, 8)
        assert same(synced, versions[7])
    assert [(r["version"], r["what"]) for r in quarantined(tmp_path)] == [(5, "snapshot")]
    assert not path_of(tmp_path, 5, ".snapshot").exists() and path_of(tmp_path, 5, ".bin").exists()


async def test_a_delta_whose_payload_is_damaged_lives_on_as_its_snapshot(tmp_path: Path) -> None:
    versions = chain(6)
    pusher = VersionPusher(None, MODEL)  # type: ignore[arg-type]
    async with publisher(tmp_path, retention=8) as pub:
        await push_all(pub, pusher, versions)
    flip(path_of(tmp_path, 5, ".bin"))
    async with publisher(tmp_path, retention=8) as pub:
        # The stored delta 4 → 5 is checked before it is served: damaged, so one is built.
        synced, report = await sync_weights(pub.client, MODEL, versions[3].copy(), 5)
        assert same(synced, versions[4]) and report.kind == "delta" and report.fallback_reason == ""
        listed = {v.version: v for v in await pub.client.list_versions(MODEL)}
        assert listed[5].kind == weights_pb2.PAYLOAD_KIND_KEYFRAME
        synced, _ = await sync_weights(pub.client, MODEL, None, 6)
        assert same(synced, versions[5])
    [reason] = quarantined(tmp_path)
    assert (reason["version"], reason["what"], reason["files"]) == (5, "payload", ["000000000005.bin"])
    assert "snapshot" in reason["rebuilt"]


# ---------------------------------------------------------------- what the calls answer


async def fetch_error(client: WeightClient, **request: int) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await client.fetch(MODEL, **request)
    return err.value


async def test_fetch_answers_data_loss_naming_the_version_and_what_was_damaged(tmp_path: Path) -> None:
    versions = chain(6)
    async with publisher(tmp_path) as pub:
        await push_all(pub, VersionPusher(pub.client, MODEL), versions)
    path_of(tmp_path, 6, ".bin").unlink()
    flip(path_of(tmp_path, 5, ".snapshot"))
    async with publisher(tmp_path) as pub:
        lost = await fetch_error(pub.client, want_version=6)
        assert lost.code() == grpc.StatusCode.DATA_LOSS
        assert "version 6 of policy" in lost.details() and "payload is missing" in lost.details()
        unrebuildable = await fetch_error(pub.client, want_version=5)
        assert unrebuildable.code() == grpc.StatusCode.DATA_LOSS
        assert "version 5 of policy cannot be rebuilt" in unrebuildable.details()
        assert "snapshot hashes to" in unrebuildable.details()
        assert (await fetch_error(pub.client, want_version=0)).code() == grpc.StatusCode.DATA_LOSS
        assert (await fetch_error(pub.client, want_version=9)).code() == grpc.StatusCode.NOT_FOUND
        # ListVersions answers for a damaged store (and blames the client only for its own field).
        assert [v.version for v in await pub.client.list_versions(MODEL)] == [5]
        with pytest.raises(grpc.aio.AioRpcError) as bad_name:
            await pub.client.list_versions("../x")
        assert bad_name.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert bad_name.value.details().startswith("model:")
        # A delta onto the newest version, which cannot be rebuilt: FAILED_PRECONDITION, so the
        # learner sends a keyframe.
        delta = codec.encode(perturbed(versions[4], 7), versions[4]).payload
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await pub.client.push(MODEL, 7, delta)
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert refused.value.details().startswith("base_version:") and "cannot be rebuilt" in refused.value.details()


async def test_disk_errors_answer_unavailable(tmp_path: Path) -> None:
    async with publisher(tmp_path) as pub:
        (tmp_path / MODEL).write_bytes(b"a file where the model's directory belongs")
        with pytest.raises(grpc.aio.AioRpcError) as push:
            await VersionPusher(pub.client, MODEL, attempts=1).push(random_weights(1, shapes=SHAPES), step=1)
        assert push.value.code() == grpc.StatusCode.UNAVAILABLE
        assert push.value.details().startswith("store: the publisher's disk failed:")
    (tmp_path / MODEL).unlink()
    async with publisher(tmp_path) as pub:
        await VersionPusher(pub.client, MODEL).push(random_weights(1, shapes=SHAPES), step=1)
        path_of(tmp_path, 2, ".json").mkdir()  # a record that cannot be read
        unreadable = await fetch_error(pub.client, want_version=2)
        assert unreadable.code() == grpc.StatusCode.UNAVAILABLE


async def test_a_version_stored_but_not_announced_answers_unavailable(tmp_path: Path) -> None:
    async def fail(_: StoredVersion) -> None:
        raise ConnectionError("NATS is down")

    async with publisher(tmp_path, on_stored=fail) as pub:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await pub.client.push(MODEL, 1, codec.encode(random_weights(1, shapes=SHAPES)).payload)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert err.value.details().startswith("announce: version 1 is stored")
        assert [v.version for v in await pub.client.list_versions(MODEL)] == [1]  # a retry finds it held


def test_every_known_failure_has_its_status() -> None:
    cases = [
        (BaseUnavailable("base_version: x"), grpc.StatusCode.FAILED_PRECONDITION, "base_version: x"),
        (PushRejected("data: x"), grpc.StatusCode.INVALID_ARGUMENT, "data: x"),
        (PayloadMismatch("x"), grpc.StatusCode.INVALID_ARGUMENT, "data: x"),
        (StaleVersion("x"), grpc.StatusCode.FAILED_PRECONDITION, "header.version: x"),
        (UnknownVersion("x"), grpc.StatusCode.NOT_FOUND, "want_version: x"),
        (DamagedEntry(MODEL, 3, "payload", "is missing"), grpc.StatusCode.DATA_LOSS,
         "store: version 3 of policy: payload is missing"),
        (Unrebuildable("x"), grpc.StatusCode.DATA_LOSS, "store: x"),
        (DataLoss("x"), grpc.StatusCode.DATA_LOSS, "store: x"),
        (OSError(5, "Input/output error"), grpc.StatusCode.UNAVAILABLE,
         "store: the publisher's disk failed: [Errno 5] Input/output error"),
        (MemoryError(), grpc.StatusCode.RESOURCE_EXHAUSTED, "publisher: out of memory: MemoryError"),
        (KeyError("x"), grpc.StatusCode.INTERNAL, "publisher: KeyError: 'x'"),
    ]
    for exc, code, message in cases:
        assert failure_status(exc) == (code, message)


# ---------------------------------------------------------------- the learner and the replica


async def test_the_learner_sends_a_keyframe_whatever_refused_its_delta(tmp_path: Path) -> None:
    """A delta the publisher cannot verify (INVALID_ARGUMENT: the learner's copy of the confirmed
    version drifted) is replaced by a keyframe, which is stored."""
    versions = chain(3)
    async with publisher(tmp_path) as pub:
        pusher = VersionPusher(pub.client, MODEL)
        await push_all(pub, pusher, versions[:2])
        drifted = versions[1].copy()
        drifted.tensors["embed"].data[0] ^= 1  # the bytes changed, the recorded hashes did not
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await pub.client.push(MODEL, 3, codec.encode(versions[2], drifted).payload)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        pusher.confirmed = drifted
        report = await pusher.push(versions[2], step=3)
        assert report.kind == "keyframe"
        synced, _ = await sync_weights(pub.client, MODEL, None, 3)
        assert same(synced, versions[2])


class RefusingDeltas(WeightServicer):
    """A publisher that cannot build any delta (DATA_LOSS) but still serves keyframes."""

    async def Fetch(self, request, context):  # type: ignore[no-untyped-def]
        if request.have_version:
            await context.abort(grpc.StatusCode.DATA_LOSS, "store: version 1 of policy cannot be rebuilt")
        async for chunk in super().Fetch(request, context):
            yield chunk


async def test_a_replica_fetches_a_keyframe_when_its_delta_is_lost(tmp_path: Path) -> None:
    versions = chain(2)
    async with publisher(tmp_path, servicer=RefusingDeltas) as pub:
        await push_all(pub, VersionPusher(pub.client, MODEL), versions)
        synced, report = await sync_weights(pub.client, MODEL, versions[0].copy(), 2)
        assert same(synced, versions[1]) and report.kind == "keyframe"
        assert report.fallback_reason.startswith("publisher: DATA_LOSS:")


# ---------------------------------------------------------------- the publisher service


async def test_the_publisher_service_starts_on_a_damaged_store_and_dead_letters_what_it_quarantined(
        tmp_path: Path, nats_server, redis_server, bus) -> None:  # type: ignore[no-untyped-def]
    from tests.conftest import ServiceLauncher

    store_dir = tmp_path / "weights"
    async with publisher(store_dir) as pub:
        await push_all(pub, VersionPusher(pub.client, MODEL), chain(3))
    path_of(store_dir, 3, ".json").write_text("garbage")
    services = ServiceLauncher(tmp_path, nats_server, redis_server, tmp_path)
    try:
        process = services.start("publisher")
        await services.wait_healthy(process)

        async def dead_lettered() -> list[bus_pb2.DeadLetter]:
            return [d for d in await stored(bus, "DLQ", bus_pb2.DeadLetter) if d.origin_stream == "WEIGHTS"]

        async def arrived() -> bool:
            return bool(await dead_lettered())

        await eventually(arrived, what="the quarantine's dead letter")
        [letter] = await dead_lettered()
        assert letter.service == "publisher" and letter.origin_subject.endswith(".weights.policy")
        assert letter.reason.startswith("weights_quarantined: version 3 of policy: record")
        assert json.loads(letter.payload)["what"] == "record" and letter.headers["version"] == "3"
        client = WeightClient(f"127.0.0.1:{process.ports['grpc']}", deadline_s=10)
        try:
            assert [v.version for v in await client.list_versions(MODEL)] == [1, 2]
        finally:
            await client.close()
        events = [e for e in process.log_events() if e.get("event") == "weights_quarantined"]
        assert events and events[0]["what"] == "record" and events[0]["version"] == 3
    finally:
        services.stop_all()
