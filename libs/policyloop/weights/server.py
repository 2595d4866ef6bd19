"""The WeightService servicer over a VersionStore. `on_stored` is called once a pushed version
is durable (the publisher announces it on WEIGHTS from there)."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc

from policyloop.contracts.v1 import weights_pb2, weights_pb2_grpc
from policyloop.weights.store import (
    CHUNK_BYTES,
    PayloadMismatch,
    StaleVersion,
    StoredVersion,
    UnknownVersion,
    VersionStore,
    validate_model_name,
)

_HEX128 = re.compile(r"^[0-9a-f]{32}$")
OnStored = Callable[[StoredVersion], Awaitable[None]]


def version_info(v: StoredVersion) -> weights_pb2.VersionInfo:
    return weights_pb2.VersionInfo(
        model=v.model, version=v.version, step=v.step, codec=v.codec, bytes=v.bytes,
        payload_xxh3_128=v.payload_xxh3_128, created_unix_ms=v.created_unix_ms,
    )


def check_push_header(header: weights_pb2.PushHeader) -> str | None:
    """The name and problem of the first invalid header field, or None."""
    try:
        validate_model_name(header.model)
    except ValueError as exc:
        return f"header.model: {exc}"
    if header.version < 1:
        return "header.version: must be at least 1"
    if header.total_bytes < 1:
        return "header.total_bytes: must be at least 1"
    if not _HEX128.match(header.payload_xxh3_128):
        return "header.payload_xxh3_128: must be 32 lower-case hex digits"
    if not header.codec:
        return "header.codec: is empty"
    return None


class WeightServicer(weights_pb2_grpc.WeightServiceServicer):
    def __init__(self, store: VersionStore, on_stored: OnStored, chunk_bytes: int = CHUNK_BYTES) -> None:
        self.store = store
        self.on_stored = on_stored
        self.chunk_bytes = min(chunk_bytes, CHUNK_BYTES)
        self._push_lock = asyncio.Lock()  # one writer at a time keeps versions increasing

    async def Push(self, request_iterator: AsyncIterator[weights_pb2.PushChunk],
                   context: grpc.aio.ServicerContext) -> weights_pb2.PushResult:
        first = await anext(aiter(request_iterator), None)
        if first is None or first.WhichOneof("part") != "header":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "header: the first chunk must be a PushHeader")
        header = first.header
        problem = check_push_header(header)
        if problem:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        meta = StoredVersion(
            model=header.model, version=header.version, step=header.step, codec=header.codec,
            bytes=header.total_bytes, payload_xxh3_128=header.payload_xxh3_128,
            created_unix_ms=int(time.time() * 1000), run_id=header.run_id,
        )
        async with self._push_lock:
            try:
                writer = self.store.begin(meta)
            except StaleVersion as exc:
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"header.version: {exc}")
            try:
                async for chunk in request_iterator:
                    if chunk.WhichOneof("part") != "data":
                        raise PayloadMismatch("data: a second header arrived mid-stream")
                    writer.write(chunk.data)
                stored = await asyncio.to_thread(writer.commit)
            except PayloadMismatch as exc:
                writer.abort()
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"data: {exc}")
            except StaleVersion as exc:
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"header.version: {exc}")
            except BaseException:
                writer.abort()
                raise
        await self.on_stored(stored)
        return weights_pb2.PushResult(model=stored.model, version=stored.version, bytes_stored=stored.bytes)

    async def Fetch(self, request: weights_pb2.FetchRequest,
                    context: grpc.aio.ServicerContext) -> AsyncIterator[weights_pb2.WeightChunk]:
        try:
            validate_model_name(request.model)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"model: {exc}")
        if request.want_version < 0 or request.have_version < 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "want_version/have_version: must not be negative")
        try:
            if request.want_version == 0:
                target = self.store.latest(request.model)
                if target is None:
                    raise UnknownVersion(f"no version of {request.model} is stored")
            else:
                target = self.store.get(request.model, request.want_version)
        except UnknownVersion as exc:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"want_version: {exc}")
        # Deltas come with the weight-sync work; until then every fetch is a keyframe.
        yield weights_pb2.WeightChunk(header=weights_pb2.FetchHeader(
            model=target.model, version=target.version, base_version=0,
            kind=weights_pb2.PAYLOAD_KIND_KEYFRAME, codec=target.codec,
            total_bytes=target.bytes, payload_xxh3_128=target.payload_xxh3_128,
        ))
        try:
            for chunk in self.store.read_chunks(target.model, target.version, self.chunk_bytes):
                yield weights_pb2.WeightChunk(data=chunk)
        except (UnknownVersion, FileNotFoundError) as exc:
            # Pruned while streaming: the client sees the stream end with an error, never short data.
            await context.abort(grpc.StatusCode.NOT_FOUND, f"want_version: {target.version} was pruned: {exc}")

    async def ListVersions(self, request: weights_pb2.ListVersionsRequest,
                           context: grpc.aio.ServicerContext) -> weights_pb2.ListVersionsResponse:
        models = [request.model] if request.model else self.store.models()
        versions = []
        for model in models:
            try:
                versions.extend(version_info(v) for v in self.store.versions(model))
            except ValueError as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"model: {exc}")
        return weights_pb2.ListVersionsResponse(versions=versions)
