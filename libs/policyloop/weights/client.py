"""A WeightService client: push a version, fetch one back verified, and bring held weights to a
new version (a delta when possible, a keyframe when the delta cannot be applied)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import xxhash

from policyloop.contracts.v1 import weights_pb2, weights_pb2_grpc
from policyloop.telemetry.logging import get_logger
from policyloop.weights import codec
from policyloop.weights.link import LinkLimit
from policyloop.weights.store import CHUNK_BYTES

log = get_logger(__name__)


class FetchError(Exception):
    """The fetched payload is not what its header promised."""


# Codes that say the publisher was not reached or did not answer (retried, or left to the
# caller), or that any request would get: everything else is the publisher refusing this one.
_NOT_A_REFUSAL = frozenset({
    grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED,
    grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.RESOURCE_EXHAUSTED,
})


def refused(exc: grpc.aio.AioRpcError) -> bool:
    """Whether the publisher answered and refused the call, so that another payload (a keyframe
    instead of a delta) may succeed where this one did not."""
    transport = exc.code() == grpc.StatusCode.INTERNAL and "from Core" in (exc.details() or "")
    return exc.code() not in _NOT_A_REFUSAL and not transport


@dataclass(frozen=True)
class FetchedVersion:
    header: weights_pb2.FetchHeader
    payload: bytes


class WeightClient:
    def __init__(self, target: str, *, bearer_token: str = "", deadline_s: float = 60.0,
                 link: LinkLimit | None = None) -> None:
        # Payloads are streamed in 1 MiB chunks, so the default 4 MiB message limit is enough.
        self.channel = grpc.aio.insecure_channel(target)
        self.link = link or LinkLimit(0)
        self.stub = weights_pb2_grpc.WeightServiceStub(self.channel)
        self.metadata = (("authorization", f"Bearer {bearer_token}"),) if bearer_token else ()
        self.deadline_s = deadline_s

    async def close(self) -> None:
        await self.channel.close()

    async def push(self, model: str, version: int, payload: bytes, *, codec_name: str = codec.CODEC,
                   step: int = 0, run_id: str = "") -> weights_pb2.PushResult:
        async def chunks() -> AsyncIterator[weights_pb2.PushChunk]:
            yield weights_pb2.PushChunk(header=weights_pb2.PushHeader(
                model=model, version=version, step=step, codec=codec_name, total_bytes=len(payload),
                payload_xxh3_128=xxhash.xxh3_128_hexdigest(payload), run_id=run_id,
            ))
            for start in range(0, len(payload), CHUNK_BYTES):
                piece = payload[start:start + CHUNK_BYTES]
                await self.link.take(len(piece))
                yield weights_pb2.PushChunk(data=piece)

        return await self.stub.Push(chunks(), timeout=self.deadline_s, metadata=self.metadata)

    async def fetch(self, model: str, *, have_version: int = 0, want_version: int = 0) -> FetchedVersion:
        call = self.stub.Fetch(
            weights_pb2.FetchRequest(model=model, have_version=have_version, want_version=want_version),
            timeout=self.deadline_s, metadata=self.metadata,
        )
        header: weights_pb2.FetchHeader | None = None
        parts: list[bytes] = []
        async for chunk in call:
            if chunk.WhichOneof("part") == "header":
                if header is not None:
                    raise FetchError("a second header arrived mid-stream")
                header = chunk.header
            else:
                if header is None:
                    raise FetchError("data arrived before the header")
                parts.append(chunk.data)
        if header is None:
            raise FetchError("the stream ended without a header")
        payload = b"".join(parts)
        if len(payload) != header.total_bytes:
            raise FetchError(f"received {len(payload)} bytes, header announced {header.total_bytes}")
        digest = xxhash.xxh3_128_hexdigest(payload)
        if digest != header.payload_xxh3_128:
            raise FetchError(f"payload xxh3-128 {digest} does not match the header's {header.payload_xxh3_128}")
        return FetchedVersion(header, payload)

    async def list_versions(self, model: str = "") -> list[weights_pb2.VersionInfo]:
        reply = await self.stub.ListVersions(
            weights_pb2.ListVersionsRequest(model=model), timeout=self.deadline_s, metadata=self.metadata
        )
        return list(reply.versions)


@dataclass(frozen=True)
class SyncReport:
    """How one update went: what came over the wire and where the time went."""

    version: int
    kind: str               # "delta" or "keyframe"
    payload_bytes: int
    raw_bytes: int
    transfer_s: float
    apply_s: float
    fallback_reason: str    # why a delta was refused and a keyframe fetched instead ("" if not)


async def sync_weights(client: WeightClient, model: str, held: codec.WeightSet | None, want_version: int
                       ) -> tuple[codec.WeightSet, SyncReport]:
    """Brings `held` (None: nothing yet) to `want_version` (0: newest) and verifies every tensor.

    A delta that cannot be applied — wrong base, hash mismatch, damaged or truncated payload,
    unknown tensor, changed shape — or that the publisher refuses to serve (DATA_LOSS: the
    publisher lost what it needs) leaves `held` untouched (codec.apply is all or nothing); the
    error is logged with its reason and a keyframe is fetched instead. A keyframe that fails the
    same checks raises: there is nothing better to fall back to, and the caller keeps serving."""
    fallback = ""
    have = held.version if held is not None else 0
    while True:
        started = time.monotonic()
        try:
            fetched = await client.fetch(model, have_version=have, want_version=want_version)
        except FetchError as exc:
            if have == 0:
                raise
            fallback, have = f"transfer: {exc}", 0
            log.warning("weights_delta_refused", model=model, reason=fallback)
            continue
        except grpc.aio.AioRpcError as exc:
            if have == 0 or not refused(exc) or exc.code() == grpc.StatusCode.NOT_FOUND:
                raise
            fallback, have = f"publisher: {exc.code().name}: {exc.details()}", 0
            log.warning("weights_delta_refused", model=model, reason=fallback)
            continue
        transfer_s = time.monotonic() - started
        started = time.monotonic()
        try:
            check_labels(fetched, want_version)
            weights = await asyncio.to_thread(codec.apply, held if have else None, fetched.payload)
        except codec.CodecError as exc:
            if have == 0:
                raise
            fallback, have = f"{type(exc).__name__}: {exc}", 0
            log.warning("weights_delta_refused", model=model, reason=fallback)
            continue
        kind = "delta" if fetched.header.kind == weights_pb2.PAYLOAD_KIND_DELTA else "keyframe"
        return weights, SyncReport(weights.version, kind, len(fetched.payload), weights.raw_bytes, transfer_s,
                                   time.monotonic() - started, fallback)


def check_labels(fetched: FetchedVersion, want_version: int) -> None:
    """Refuses a payload that is not the version the Fetch announced (and asked for) before it is
    applied: its own header's version and manifest must be the ones the publisher named."""
    header = codec.read_header(fetched.payload)
    announced = fetched.header
    if header.version != announced.version or header.manifest_hash != announced.manifest_hash:
        raise codec.CorruptPayload(f"payload: it is version {header.version} (manifest {header.manifest_hash}), the "
                                   f"publisher announced {announced.version} ({announced.manifest_hash})")
    if want_version and header.version != want_version:
        raise codec.CorruptPayload(f"payload: it is version {header.version}, version {want_version} was asked for")


@dataclass(frozen=True)
class PushReport:
    version: int
    kind: str               # what the publisher stored: "delta" or "keyframe"
    payload_bytes: int
    raw_bytes: int
    changed_fraction: float
    encode_s: float
    push_s: float


class VersionPusher:
    """The learner's side: each new version goes to the publisher as a delta from the last
    version the publisher confirmed, or as a keyframe when there is none or the publisher refuses
    the delta, whatever the reason (a fresh or restored publisher, one whose newest version was
    damaged on disk, a delta it cannot verify). Only a refused keyframe raises."""

    def __init__(self, client: WeightClient, model: str, *, run_id: str = "", attempts: int = 8) -> None:
        self.client, self.model, self.run_id, self.attempts = client, model, run_id, attempts
        self.confirmed: codec.WeightSet | None = None

    async def push(self, weights: codec.WeightSet, step: int, *, full: bool = False) -> PushReport:
        """`full=True` sends the raw weights every time (the no-delta baseline of the benchmark)."""
        started = time.monotonic()
        if full:
            encoded = await asyncio.to_thread(codec.encode, weights, raw=True)
        else:
            encoded = await asyncio.to_thread(codec.encode, weights, self.confirmed)
        encode_s = time.monotonic() - started
        started = time.monotonic()
        try:
            await self._push_until_held(weights, encoded.payload, step)
        except grpc.aio.AioRpcError as exc:
            if encoded.stats.kind != "delta" or not refused(exc):
                raise
            log.warning("push_keyframe_instead", version=weights.version, code=exc.code().name, reason=exc.details())
            started_keyframe = time.monotonic()
            encoded = await asyncio.to_thread(codec.encode, weights, None)
            encode_s += time.monotonic() - started_keyframe
            await self._push_until_held(weights, encoded.payload, step)
        self.confirmed = weights
        stats = encoded.stats
        return PushReport(weights.version, stats.kind, stats.payload_bytes, stats.raw_bytes,
                          stats.changed_fraction, encode_s, time.monotonic() - started)

    async def _push_until_held(self, weights: codec.WeightSet, payload: bytes, step: int) -> None:
        """Pushes until the publisher holds the version. A push whose reply was lost is
        recognised afterwards: the publisher holds the version with the same manifest hash."""
        delay = 0.5
        for attempt in range(1, self.attempts + 1):
            try:
                await self.client.push(self.model, weights.version, payload, step=step, run_id=self.run_id)
                return
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.FAILED_PRECONDITION:
                    held = {v.version: v.manifest_hash for v in await self.client.list_versions(self.model)}
                    if held.get(weights.version) == weights.manifest_hash:
                        return
                    raise
                # INTERNAL "from Core": the client's stream write failed as the connection dropped
                # (a publisher killed mid-push); the push is retried like any lost connection.
                transient = exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED) or (
                    exc.code() == grpc.StatusCode.INTERNAL and "from Core" in (exc.details() or ""))
                if not transient or attempt == self.attempts:
                    raise
                log.warning("push_retry", version=weights.version, attempt=attempt, error=exc.code().name)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 10.0)
