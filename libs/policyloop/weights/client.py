"""The WeightService client: push a version's payload, fetch one (header and payload, checked
against the header's size and hash as it streams in), list the versions held. The learner's
side of a push is `weights.push`, the replica's side of a fetch `weights.sync`."""

from __future__ import annotations

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
# UNKNOWN is a failure outside the publisher's own handling (it answers its refusals with a
# code of their own): it says nothing about this payload, and a keyframe would not mend it.
_NOT_A_REFUSAL = frozenset({
    grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED,
    grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.UNKNOWN,
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
                   step: int = 0, run_id: str = "", trained_unix_ms: int = 0) -> weights_pb2.PushResult:
        async def chunks() -> AsyncIterator[weights_pb2.PushChunk]:
            yield weights_pb2.PushChunk(header=weights_pb2.PushHeader(
                model=model, version=version, step=step, codec=codec_name, total_bytes=len(payload),
                payload_xxh3_128=xxhash.xxh3_128_hexdigest(payload), run_id=run_id, trained_unix_ms=trained_unix_ms,
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

    async def list_versions(self, model: str = "", *, wait_for_ready: bool = False) -> list[weights_pb2.VersionInfo]:
        """`wait_for_ready`: a publisher not listening yet (restarting) is waited for, up to the
        deadline, instead of failing at once."""
        reply = await self.stub.ListVersions(
            weights_pb2.ListVersionsRequest(model=model), timeout=self.deadline_s, metadata=self.metadata,
            wait_for_ready=wait_for_ready)
        return list(reply.versions)

    async def join_tree(self, request: weights_pb2.JoinTreeRequest) -> weights_pb2.TreePlacement:
        """Where the publisher places this replica in the fan-out tree (weights.tree)."""
        return await self.stub.JoinTree(request, timeout=self.deadline_s, metadata=self.metadata)

    async def keep_version(self, model: str, version: int, reason: str) -> weights_pb2.VersionInfo:
        """Has the publisher keep `version` past its retention window (idempotent)."""
        return await self.stub.KeepVersion(
            weights_pb2.KeepVersionRequest(model=model, version=version, reason=reason),
            timeout=self.deadline_s, metadata=self.metadata,
        )
