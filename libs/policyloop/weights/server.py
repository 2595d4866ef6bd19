"""The WeightService servicer over a WeightLibrary. `on_stored` is called once a pushed version
is durable (the publisher announces it on WEIGHTS from there).

Every failure has its own status, with a message that names the field or the stored version:
INVALID_ARGUMENT only for what the client sent, FAILED_PRECONDITION for a push that does not
follow the stored versions, NOT_FOUND for a version never stored, DATA_LOSS for a version whose
stored files were damaged and that nothing left rebuilds, UNAVAILABLE when the disk fails,
RESOURCE_EXHAUSTED when memory does, INTERNAL (logged) for anything else."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc

from policyloop.common.clock import now_ms
from policyloop.contracts.v1 import weights_pb2, weights_pb2_grpc
from policyloop.telemetry.logging import get_logger
from policyloop.telemetry.metrics import WEIGHTS_BYTES_SERVED, WEIGHTS_TREE_DEPTH, WEIGHTS_TREE_MEMBERS
from policyloop.weights.codec import CODEC
from policyloop.weights.fanout import FanoutTree
from policyloop.weights.library import BaseUnavailable, PushRejected, Served, WeightLibrary
from policyloop.weights.link import LinkLimit
from policyloop.weights.store import (
    CHUNK_BYTES,
    DataLoss,
    PayloadMismatch,
    StaleVersion,
    StoredVersion,
    UnknownVersion,
    validate_model_name,
)

log = get_logger(__name__)

_HEX128 = re.compile(r"^[0-9a-f]{32}$")
_ENDPOINT = re.compile(r"^[^\s:/]+:\d{1,5}$|^\[[0-9a-fA-F:.]+\]:\d{1,5}$")
OnStored = Callable[[StoredVersion], Awaitable[None]]

# First match wins (subclasses before their bases): the status and the message's prefix.
_FAILURES: tuple[tuple[type[BaseException], grpc.StatusCode, str], ...] = (
    (BaseUnavailable, grpc.StatusCode.FAILED_PRECONDITION, ""),
    (PushRejected, grpc.StatusCode.INVALID_ARGUMENT, ""),
    (PayloadMismatch, grpc.StatusCode.INVALID_ARGUMENT, "data: "),
    (StaleVersion, grpc.StatusCode.FAILED_PRECONDITION, "header.version: "),
    (UnknownVersion, grpc.StatusCode.NOT_FOUND, "want_version: "),
    (DataLoss, grpc.StatusCode.DATA_LOSS, "store: "),
    (OSError, grpc.StatusCode.UNAVAILABLE, "store: the publisher's disk failed: "),
    (MemoryError, grpc.StatusCode.RESOURCE_EXHAUSTED, "publisher: out of memory: "),
)


def failure_status(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status and message a failed call answers with."""
    for kind, code, prefix in _FAILURES:
        if isinstance(exc, kind):
            return code, prefix + (str(exc) or type(exc).__name__)
    return grpc.StatusCode.INTERNAL, f"publisher: {type(exc).__name__}: {exc}"


async def abort_with(context: grpc.aio.ServicerContext, call: str, exc: BaseException) -> None:
    """Ends the call with the failure's status; what the publisher got wrong is logged too."""
    code, message = failure_status(exc)
    if code in (grpc.StatusCode.DATA_LOSS, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED,
                grpc.StatusCode.INTERNAL):
        log.error("weights_call_failed", call=call, code=code.name, error=message,
                  exc_info=code == grpc.StatusCode.INTERNAL)
    await context.abort(code, message)


def version_info(v: StoredVersion, kept: bool = False) -> weights_pb2.VersionInfo:
    return weights_pb2.VersionInfo(kept=kept,
        model=v.model, version=v.version, step=v.step, codec=v.codec, bytes=v.bytes,
        payload_xxh3_128=v.payload_xxh3_128, created_unix_ms=v.created_unix_ms,
        kind=weights_pb2.PAYLOAD_KIND_DELTA if v.kind == "delta" else weights_pb2.PAYLOAD_KIND_KEYFRAME,
        base_version=v.base_version, manifest_hash=v.manifest_hash, trained_unix_ms=v.trained_unix_ms,
    )


def check_fetch_request(request: weights_pb2.FetchRequest) -> str | None:
    """The name and problem of the first invalid field of a Fetch, or None."""
    try:
        validate_model_name(request.model)
    except ValueError as exc:
        return f"model: {exc}"
    if request.want_version < 0:
        return "want_version: must not be negative"
    if request.have_version < 0:
        return "have_version: must not be negative"
    return None


async def payload_chunks(served: Served, chunk_bytes: int, egress: LinkLimit) -> AsyncIterator[weights_pb2.WeightChunk]:
    """A Fetch's answer: the header, then the payload in chunks, each through the egress limit."""
    yield weights_pb2.WeightChunk(header=weights_pb2.FetchHeader(
        model=served.model, version=served.version, base_version=served.base_version,
        kind=weights_pb2.PAYLOAD_KIND_DELTA if served.kind == "delta" else weights_pb2.PAYLOAD_KIND_KEYFRAME,
        codec=CODEC, total_bytes=len(served.payload), payload_xxh3_128=served.payload_xxh3_128,
        manifest_hash=served.manifest_hash,
    ))
    view = memoryview(served.payload)
    for start in range(0, len(view), chunk_bytes):
        piece = view[start:start + chunk_bytes]
        await egress.take(len(piece))
        yield weights_pb2.WeightChunk(data=bytes(piece))


async def answer_fetch(served: Served, request: weights_pb2.FetchRequest, context: grpc.aio.ServicerContext, *,
                       chunk_bytes: int, egress: LinkLimit, server: str,
                       on_bytes: Callable[[int], None] | None = None) -> AsyncIterator[weights_pb2.WeightChunk]:
    """Fetch's answer once `served` is found: refused when the client holds it already, else
    streamed, its bytes counted for `server` (publisher or relay)."""
    if request.have_version and request.have_version == served.version:
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                            f"have_version: the client already holds version {served.version}")
    async for chunk in payload_chunks(served, chunk_bytes, egress):
        if chunk.WhichOneof("part") == "data":
            WEIGHTS_BYTES_SERVED.labels(server).inc(len(chunk.data))
            if on_bytes is not None:
                on_bytes(len(chunk.data))
        yield chunk


def check_join_request(request: weights_pb2.JoinTreeRequest) -> str | None:
    try:
        validate_model_name(request.model)
    except ValueError as exc:
        return f"model: {exc}"
    if not request.replica:
        return "replica: an id is required"
    if request.relay_endpoint and not _ENDPOINT.match(request.relay_endpoint):
        return f"relay_endpoint: {request.relay_endpoint!r} is not host:port"
    return None


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
    if header.trained_unix_ms < 0:
        return "header.trained_unix_ms: cannot be negative"
    if not _HEX128.match(header.payload_xxh3_128):
        return "header.payload_xxh3_128: must be 32 lower-case hex digits"
    if header.codec != CODEC:
        return f"header.codec: must be {CODEC!r} (payloads are made by policyloop.weights.codec)"
    return None


class WeightServicer(weights_pb2_grpc.WeightServiceServicer):
    """Push verifies and stores (see WeightLibrary.accept); Fetch streams the payload from the
    client's version to the wanted one in chunks of at most 1 MiB, through the egress limit."""

    def __init__(self, library: WeightLibrary, on_stored: OnStored, chunk_bytes: int = CHUNK_BYTES,
                 egress: LinkLimit | None = None, tree: Callable[[], FanoutTree] | None = None) -> None:
        self.library = library
        # Relayed fan-out: one tree per model, made by `tree` (None: off, every replica fetches here).
        self.new_tree = tree
        self.trees: dict[str, FanoutTree] = {}
        self.store = library.store
        self.on_stored = on_stored
        self.chunk_bytes = min(chunk_bytes, CHUNK_BYTES)
        self.egress = egress or LinkLimit(0)
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
            created_unix_ms=now_ms(), run_id=header.run_id, trained_unix_ms=header.trained_unix_ms,
        )
        try:
            latest = self.store.latest(header.model)
        except Exception as exc:  # each failure has its own status (failure_status)
            await abort_with(context, "Push", exc)
        if latest is not None and latest.version >= header.version:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"header.version: version {header.version} of {header.model} is not newer "
                                f"than {latest.version}")
        payload = bytearray()
        async for chunk in request_iterator:
            if chunk.WhichOneof("part") != "data":
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "data: a second header arrived mid-stream")
            payload += chunk.data
            if len(payload) > header.total_bytes:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"data: payload longer than header.total_bytes ({header.total_bytes})")
        async with self._push_lock:
            try:
                stored = await self.library.accept(meta, bytes(payload))
            except Exception as exc:
                await abort_with(context, "Push", exc)
        try:
            await self.on_stored(stored)
        except Exception as exc:  # stored durably: the next start announces it again
            log.error("announce_failed", model=stored.model, version=stored.version, error=repr(exc))
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                f"announce: version {stored.version} is stored but announcing it failed ({exc!r})")
        return weights_pb2.PushResult(model=stored.model, version=stored.version, bytes_stored=stored.bytes)

    async def Fetch(self, request: weights_pb2.FetchRequest,
                    context: grpc.aio.ServicerContext) -> AsyncIterator[weights_pb2.WeightChunk]:
        problem = check_fetch_request(request)
        if problem:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        try:
            served = await self.library.payload_for(request.model, request.have_version, request.want_version)
        except Exception as exc:
            await abort_with(context, "Fetch", exc)
        async for chunk in answer_fetch(served, request, context, chunk_bytes=self.chunk_bytes, egress=self.egress,
                                        server="publisher"):
            yield chunk

    async def JoinTree(self, request: weights_pb2.JoinTreeRequest,
                       context: grpc.aio.ServicerContext) -> weights_pb2.TreePlacement:
        problem = check_join_request(request)
        if problem:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        if self.new_tree is None:
            return weights_pb2.TreePlacement(depth=1)  # no tree: fetch from the publisher, ask again each time
        tree = self.trees.get(request.model)
        if tree is None:
            tree = self.trees[request.model] = self.new_tree()
        placed = tree.join(request.replica, endpoint=request.relay_endpoint, node=request.node,
                           zone=request.zone, failed_parent=request.failed_parent)
        if request.failed_parent:
            log.warning("weights_parent_failed", model=request.model, replica=request.replica,
                        parent=request.failed_parent, new_parent=placed.parent or "publisher")
        WEIGHTS_TREE_DEPTH.labels(request.model).set(tree.depth)
        WEIGHTS_TREE_MEMBERS.labels(request.model).set(len(tree.members))
        return weights_pb2.TreePlacement(parent=placed.parent, parent_endpoint=placed.parent_endpoint,
                                         depth=placed.depth, fanout=tree.fanout, lease_s=tree.lease_s)

    async def ListVersions(self, request: weights_pb2.ListVersionsRequest,
                           context: grpc.aio.ServicerContext) -> weights_pb2.ListVersionsResponse:
        if request.model:
            try:
                validate_model_name(request.model)
            except ValueError as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"model: {exc}")
        try:
            models = [request.model] if request.model else self.store.models()
            versions = [version_info(v, self.store.is_kept(model, v.version))
                        for model in models for v in self.store.versions(model)]
        except Exception as exc:  # damaged records are skipped by the store; this is the disk failing
            await abort_with(context, "ListVersions", exc)
        return weights_pb2.ListVersionsResponse(versions=versions)

    async def KeepVersion(self, request: weights_pb2.KeepVersionRequest,
                          context: grpc.aio.ServicerContext) -> weights_pb2.VersionInfo:
        try:
            validate_model_name(request.model)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"model: {exc}")
        if request.version < 1:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "version: must be at least 1")
        try:
            stored = await self.library.keep(request.model, request.version, request.reason)
        except UnknownVersion as exc:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"version: {exc}")
        except Exception as exc:
            await abort_with(context, "KeepVersion", exc)
        return version_info(stored, kept=True)


async def start_weight_server(servicer: WeightServicer, *, host: str, port: int, bearer_token: str = ""
                              ) -> tuple[grpc.aio.Server, int]:
    """The WeightService with health and reflection on a gRPC server; returns it and its port."""
    from policyloop.runtime.grpc_server import start_grpc_server

    server, _health, bound = await start_grpc_server(
        [lambda s: weights_pb2_grpc.add_WeightServiceServicer_to_server(servicer, s)],
        [weights_pb2.DESCRIPTOR.services_by_name["WeightService"].full_name],
        host=host, port=port, bearer_token=bearer_token,
    )
    return server, bound
