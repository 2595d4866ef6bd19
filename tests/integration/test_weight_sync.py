"""Weight sync over a real gRPC WeightService on loopback: the learner pushes deltas, replicas
follow them exactly, and every corruption on the way is detected and recovered by a keyframe."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import grpc
import numpy as np
import pytest

from policyloop.contracts.v1 import weights_pb2
from policyloop.weights import codec
from policyloop.weights.client import WeightClient
from policyloop.weights.library import WeightLibrary
from policyloop.weights.push import VersionPusher
from policyloop.weights.server import WeightServicer, start_weight_server
from policyloop.weights.store import StoredVersion, VersionStore
from policyloop.weights.sync import sync_weights
from tests.helpers import perturbed, random_weights


class Publisher:
    def __init__(self, root: Path, **library_options: int) -> None:
        self.library = WeightLibrary(VersionStore(root, retention=3), **library_options)
        self.announced: list[StoredVersion] = []
        self.servicer = WeightServicer(self.library, on_stored=self._announce)

    async def _announce(self, stored: StoredVersion) -> None:
        self.announced.append(stored)


@pytest.fixture
async def publisher(tmp_path: Path) -> AsyncIterator[tuple[Publisher, WeightClient]]:
    pub = Publisher(tmp_path / "store", snapshot_every=2)
    server, port = await start_weight_server(pub.servicer, host="127.0.0.1", port=0)
    client = WeightClient(f"127.0.0.1:{port}", deadline_s=20)
    yield pub, client
    await client.close()
    await server.stop(None)
    await pub.library.drain()


def same(a: codec.WeightSet, b: codec.WeightSet) -> bool:
    return a.version == b.version and a.manifest_hash == b.manifest_hash and all(
        np.array_equal(a.tensors[n].data, b.tensors[n].data) for n in b.tensors)


async def test_replicas_follow_a_chain_of_deltas_exactly(publisher) -> None:  # type: ignore[no-untyped-def]
    pub, client = publisher
    pusher = VersionPusher(client, "policy")
    versions = [random_weights(1, shapes={"w": (512, 64), "b": (64,)})]
    for v in range(2, 9):
        versions.append(perturbed(versions[-1], v, fraction=0.02, seed=v))
    # A replica that follows every version gets each stored delta as the learner made it.
    held, lagging = None, None
    for weights in versions:
        pushed = await pusher.push(weights, step=weights.version)
        assert pushed.kind == ("keyframe" if weights.version == 1 else "delta")
        held, report = await sync_weights(client, "policy", held, weights.version)
        assert same(held, weights) and report.fallback_reason == ""
        assert report.kind == pushed.kind and report.payload_bytes == pushed.payload_bytes
        if weights.version > 1:
            assert pushed.payload_bytes * 5 < pushed.raw_bytes
        if weights.version == 6:
            lagging = held.copy()
    assert [s.version for s in pub.announced] == list(range(1, 9))
    # A lagging replica gets one delta across several versions (XOR composes), built once.
    caught_up, report = await sync_weights(client, "policy", lagging, 8)
    assert same(caught_up, versions[7]) and report.kind == "delta"
    # Retention 3 (+ what rebuilding needs): an old version is answered with a keyframe.
    kept = [v.version for v in await client.list_versions("policy")]
    assert kept[-3:] == [6, 7, 8] and 1 not in kept
    stale, report = await sync_weights(client, "policy", versions[0].copy(), 8)
    assert same(stale, versions[7]) and report.kind == "keyframe"
    infos = {v.version: v for v in await client.list_versions("policy")}
    assert infos[8].kind == weights_pb2.PAYLOAD_KIND_DELTA and infos[8].base_version == 7
    assert infos[8].manifest_hash == versions[7].manifest_hash


async def test_a_restarted_publisher_rebuilds_its_versions_from_disk(tmp_path: Path) -> None:
    versions = [random_weights(1)]
    for v in range(2, 7):
        versions.append(perturbed(versions[-1], v, seed=v))
    first = Publisher(tmp_path, snapshot_every=2)
    server, port = await start_weight_server(first.servicer, host="127.0.0.1", port=0)
    client = WeightClient(f"127.0.0.1:{port}", deadline_s=20)
    pusher = VersionPusher(client, "policy")
    for weights in versions[:4]:
        await pusher.push(weights, step=weights.version)
    await client.close()
    await server.stop(None)
    await first.library.drain()
    assert (tmp_path / "policy" / f"{3:012d}.snapshot").exists()  # two deltas after the keyframe

    again = Publisher(tmp_path, snapshot_every=2)
    server, port = await start_weight_server(again.servicer, host="127.0.0.1", port=0)
    client = WeightClient(f"127.0.0.1:{port}", deadline_s=20)
    try:
        pusher.client = client  # the learner's pusher survives the publisher's restart
        for weights in versions[4:]:
            assert (await pusher.push(weights, step=weights.version)).kind == "delta"
        held, _ = await sync_weights(client, "policy", None, 0)
        assert same(held, versions[-1])
        held, report = await sync_weights(client, "policy", versions[2].copy(), 6)
        assert same(held, versions[-1]) and report.kind == "delta"
    finally:
        await client.close()
        await server.stop(None)
        await again.library.drain()


async def test_pushes_that_do_not_verify_are_refused_and_a_lost_base_gets_a_keyframe(publisher) -> None:  # type: ignore[no-untyped-def]
    pub, client = publisher
    v1 = random_weights(1)
    v2 = perturbed(v1, 2)
    await VersionPusher(client, "policy").push(v1, step=1)
    # A delta whose bytes do not reproduce the learner's hashes is refused, naming the tensor.
    forged = codec.encode(perturbed(v1, 2, seed=7), v1).payload
    header = codec.read_header(forged)
    assert header.kind == "delta"
    bad = bytearray(forged)
    tampered = _tamper_hash(bytes(bad), "norm")
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await client.push("policy", 2, tampered)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "tensor 'norm'" in refused.value.details()
    with pytest.raises(grpc.aio.AioRpcError) as wrong_codec:
        await client.push("policy", 2, forged, codec_name="safetensors")
    assert wrong_codec.value.details().startswith("header.codec:")
    with pytest.raises(grpc.aio.AioRpcError) as not_codec:
        await client.push("policy", 2, b"\x00" * 64)
    assert not_codec.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "data:" in not_codec.value.details()
    # A delta from a base the publisher does not have as its newest: FAILED_PRECONDITION …
    v3 = perturbed(v2, 3)
    with pytest.raises(grpc.aio.AioRpcError) as no_base:
        await client.push("policy", 3, codec.encode(v3, v2).payload)
    assert no_base.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert no_base.value.details().startswith("base_version:")
    # … and a pusher that believes the publisher has v2 falls back to a keyframe by itself.
    believer = VersionPusher(client, "policy")
    believer.confirmed = v2
    report = await believer.push(v3, step=3)
    assert report.kind == "keyframe"
    assert [(v.version, v.kind) for v in await client.list_versions("policy")] == [
        (1, weights_pb2.PAYLOAD_KIND_KEYFRAME), (3, weights_pb2.PAYLOAD_KIND_KEYFRAME)]
    # A retried push whose reply was lost counts as done; other bytes under that version do not.
    await VersionPusher(client, "policy").push(v3, step=3)
    with pytest.raises(grpc.aio.AioRpcError) as conflict:
        await VersionPusher(client, "policy").push(perturbed(v3, 3, seed=11), step=3)
    assert conflict.value.code() == grpc.StatusCode.FAILED_PRECONDITION


def _tamper_hash(payload: bytes, tensor: str) -> bytes:
    from tests.unit.test_weight_codec import rewrite

    def edit(meta, tensors, frames) -> None:  # type: ignore[no-untyped-def]
        next(t for t in tensors if t["name"] == tensor)["xxh3_128"] = "0" * 32

    return rewrite(payload, edit)


async def test_replica_recovers_from_each_corruption_with_a_keyframe(publisher, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """What reaches a replica can be wrong in several ways; each is detected, the held weights
    stay as they were meanwhile, and a keyframe brings the replica to the right version."""
    pub, client = publisher
    pusher = VersionPusher(client, "policy")
    v1 = random_weights(1)
    await pusher.push(v1, step=1)
    version = 1
    current = v1
    store_dir = tmp_path / "store" / "policy"

    def corrupt_stored_delta(version: int, how: str) -> None:
        """Damage the publisher's own checks cannot see (the record rewritten to match it), so
        that only the replica's checks can catch it."""
        path = store_dir / f"{version:012d}.bin"
        payload = path.read_bytes()
        if how == "hash":        # a tensor decodes to bytes that are not the learner's
            payload = _tamper_hash(payload, "layer.0.w")
        elif how == "frame":     # a damaged frame inside an intact container
            from tests.unit.test_weight_codec import rewrite

            def flip(meta, tensors, frames) -> None:  # type: ignore[no-untyped-def]
                blob = frames["embed/plane0/frame0"]
                blob[len(blob) // 3] ^= 0x10

            payload = rewrite(payload, flip)
        elif how == "truncated":  # a short payload whose record was rewritten to match
            payload = payload[: len(payload) * 2 // 3]
        elif how == "stream":     # bytes damaged after the publisher checked them (in memory, on the way)
            key = ("policy", version - 1, version)
            served = pub.library._cache[key]
            damaged = served.payload[:-10] + bytes(b ^ 0xFF for b in served.payload[-10:])
            pub.library._cache[key] = replace(served, payload=damaged)
            return
        path.write_bytes(payload)
        store = pub.library.store
        record = replace(store.get("policy", version), bytes=len(payload),
                         payload_xxh3_128=codec.tensor_digest(payload))
        if how == "hash":  # the manifest too, so that the publisher announces what the header says
            record = replace(record, manifest_hash=codec.read_header(payload).manifest_hash)
        store.write_record(record)
        pub.library._cache.clear()  # the publisher serves from disk from here on

    reasons: dict[str, str] = {}
    for how in ("hash", "frame", "truncated", "stream", "wrong_base"):
        version += 1
        nxt = perturbed(current, version, seed=version)
        await pusher.push(nxt, step=version)
        # The publisher's background snapshot write reads what the push stored: done before the
        # stored delta is damaged, or it finds the damage first (and fetches see no fallback).
        await pub.library.drain()
        held = current.copy()
        if how == "wrong_base":
            held = perturbed(current, current.version, seed=99)  # the replica's bytes drifted
        else:
            corrupt_stored_delta(version, how)
        before = held.copy()
        synced, report = await sync_weights(client, "policy", held, version)
        assert same(synced, nxt), how
        assert report.kind == "keyframe" and report.fallback_reason, how
        # All or nothing: the refused delta did not change what the replica held.
        assert all(np.array_equal(held.tensors[n].data, before.tensors[n].data) for n in before.tensors), how
        reasons[how] = report.fallback_reason
        current = nxt
    assert reasons["hash"].startswith("HashMismatch: tensor 'layer.0.w'")
    assert "tensor 'embed'" in reasons["frame"]
    assert reasons["truncated"].startswith("CorruptPayload")
    assert reasons["stream"].startswith("transfer: payload xxh3-128")
    assert reasons["wrong_base"].startswith("WrongBase") and "other weights" in reasons["wrong_base"]


async def test_fetch_names_the_bad_field(publisher) -> None:  # type: ignore[no-untyped-def]
    _, client = publisher
    await VersionPusher(client, "policy").push(random_weights(1), step=1)
    stub = client.stub
    cases = [
        (weights_pb2.FetchRequest(model="policy", have_version=-1), grpc.StatusCode.INVALID_ARGUMENT, "have_version:"),
        (weights_pb2.FetchRequest(model="policy", want_version=-2), grpc.StatusCode.INVALID_ARGUMENT, "want_version:"),
        (weights_pb2.FetchRequest(model="../x"), grpc.StatusCode.INVALID_ARGUMENT, "model:"),
        (weights_pb2.FetchRequest(model="policy", want_version=9), grpc.StatusCode.NOT_FOUND, "want_version:"),
        (weights_pb2.FetchRequest(model="policy", have_version=1, want_version=1), grpc.StatusCode.FAILED_PRECONDITION,
         "have_version:"),
    ]
    for request, code, field in cases:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in stub.Fetch(request, timeout=10):
                pass
        assert err.value.code() == code and err.value.details().startswith(field), request


def test_a_payload_of_another_version_than_announced_is_refused_before_it_is_applied() -> None:
    from policyloop.weights.client import FetchedVersion
    from policyloop.weights.sync import check_labels

    v1 = random_weights(1, seed=3)
    v2 = perturbed(v1, 2, seed=4)
    payload = codec.encode(v2, v1).payload

    def fetched(version: int, manifest: str) -> FetchedVersion:
        return FetchedVersion(weights_pb2.FetchHeader(version=version, manifest_hash=manifest), payload)

    check_labels(fetched(2, v2.manifest_hash), want_version=2)
    check_labels(fetched(2, v2.manifest_hash), want_version=0)  # the newest, whichever it is
    with pytest.raises(codec.CorruptPayload, match="announced 3"):
        check_labels(fetched(3, v2.manifest_hash), want_version=0)
    with pytest.raises(codec.CorruptPayload, match="announced 2"):
        check_labels(fetched(2, v1.manifest_hash), want_version=2)
    with pytest.raises(codec.CorruptPayload, match="version 3 was asked for"):
        check_labels(fetched(2, v2.manifest_hash), want_version=3)


async def test_a_kept_version_outlives_the_retention_window_and_a_restart(publisher, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """A promoted version is kept: a delta gets its own snapshot, later pushes never prune it,
    and a replica rolled back to it gets its exact weights (a keyframe: it holds a newer one)."""
    pub, client = publisher
    pusher = VersionPusher(client, "policy")
    versions = [random_weights(1, shapes={"w": (256, 32)})]
    for v in range(2, 13):
        versions.append(perturbed(versions[-1], v, fraction=0.05, seed=v))
    for weights in versions[:3]:
        await pusher.push(weights, step=weights.version)
    info = await client.keep_version("policy", 3, "promoted")
    assert info.kept and info.version == 3 and (await client.keep_version("policy", 3, "again")).kept
    assert (tmp_path / "store" / "policy" / f"{3:012d}.snapshot").exists()  # rebuilt from its own files
    for weights in versions[3:]:
        await pusher.push(weights, step=weights.version)
    listed = {v.version: v for v in await client.list_versions("policy")}
    assert 3 in listed and listed[3].kept and not listed[12].kept
    assert 2 not in listed and 4 not in listed  # the versions around it went as usual
    newest, _ = await sync_weights(client, "policy", None, 12)
    rolled_back, report = await sync_weights(client, "policy", newest, 3)
    assert same(rolled_back, versions[2]) and report.kind == "keyframe"
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await client.keep_version("policy", 2, "promoted")
    assert refused.value.code() == grpc.StatusCode.NOT_FOUND and "version" in (refused.value.details() or "")
    for model, version, field in (("bad/name", 3, "model"), ("policy", 0, "version")):
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await client.keep_version(model, version, "promoted")
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert (refused.value.details() or "").startswith(f"{field}:")
    # A restarted publisher (a fresh store over the same directory) still keeps and serves it.
    again = WeightLibrary(VersionStore(tmp_path / "store", retention=3), snapshot_every=2)
    assert same(await asyncio.to_thread(again.materialize, "policy", 3), versions[2])
    assert again.store.is_kept("policy", 3)
