"""A replica's relay: it serves `WeightService.Fetch` to its children in the fan-out tree
(policyloop.weights.fanout) from what it has verified, and nothing else.

What it holds per model is the newest version it verified: the payload it verified it from (a
delta from the version before, or a keyframe) and, on a replica with the weights themselves, those
weights. A child holding the delta's base gets that payload byte for byte, so the hashes the
publisher made are the ones the child checks; a child holding anything else gets a keyframe made
from the held weights (once per version), or NOT_FOUND where none are held (a simulated replica),
and goes to the publisher. A child that asks for a version the relay is still fetching waits for
it, up to `wait_s`; then UNAVAILABLE, and the child falls back."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import xxhash

from policyloop.contracts.v1 import weights_pb2, weights_pb2_grpc
from policyloop.weights import codec
from policyloop.weights.client import FetchedVersion
from policyloop.weights.library import Served
from policyloop.weights.link import LinkLimit
from policyloop.weights.server import answer_fetch, check_fetch_request
from policyloop.weights.store import CHUNK_BYTES


class NotHeld(Exception):
    """The relay does not hold what was asked for (a version it has not verified, or no weights
    to make a keyframe from): the child asks the publisher."""


class NotYet(Exception):
    """The version asked for is newer than the relay's, and did not arrive within the wait."""


@dataclass
class _Held:
    served: Served  # the payload this version was verified from
    weights: codec.WeightSet | None
    keyframe: Served | None = None


def served_from(fetched: FetchedVersion) -> Served:
    """A verified fetch, as the relay serves it on."""
    header = fetched.header
    return Served(model=header.model, version=header.version, base_version=header.base_version,
                  kind="delta" if header.kind == weights_pb2.PAYLOAD_KIND_DELTA else "keyframe",
                  manifest_hash=header.manifest_hash, payload=fetched.payload,
                  payload_xxh3_128=header.payload_xxh3_128)


class RelayHoldings:
    """The newest verified version of each model, and the bytes served from it."""

    def __init__(self) -> None:
        self._held: dict[str, _Held] = {}
        self._changed = asyncio.Condition()
        # Held weights are the replica's own, which the next delta changes in place: a keyframe is
        # made from them under this lock, and they are let go under it before that apply starts.
        self._weights = asyncio.Lock()
        self.bytes_served = 0

    async def hold(self, fetched: FetchedVersion, weights: codec.WeightSet | None) -> None:
        """Records a version the replica verified (call it only then): `fetched` is the payload it
        was verified from, `weights` what it built (None: the replica keeps no weights)."""
        served = served_from(fetched)
        async with self._changed:
            current = self._held.get(served.model)
            if current is None or current.served.version < served.version:
                self._held[served.model] = _Held(served, weights)
            self._changed.notify_all()

    async def release_weights(self, model: str) -> None:
        """Stops making keyframes from the held weights of `model` (a keyframe already made is
        kept): call it before those weights change, as the next delta is applied to them."""
        async with self._weights:
            held = self._held.get(model)
            if held is not None:
                held.weights = None

    def count_served(self, nbytes: int) -> None:
        self.bytes_served += nbytes

    async def payload_for(self, model: str, have: int, want: int, wait_s: float) -> Served:
        held = await self._wait(model, want, wait_s)
        version = held.served.version
        if want and want != version:
            raise NotHeld(f"want_version: this relay holds version {version} of {model}, not {want}")
        if have == version:
            return held.served  # the caller answers FAILED_PRECONDITION, as the publisher does
        if held.served.kind == "keyframe" or have == held.served.base_version:
            return held.served
        async with self._weights:  # one keyframe a version, made while the weights hold still
            if held.keyframe is None and held.weights is not None:
                encoded = await asyncio.to_thread(codec.encode, held.weights)
                held.keyframe = Served(model=model, version=version, base_version=0, kind="keyframe",
                                       manifest_hash=held.served.manifest_hash, payload=encoded.payload,
                                       payload_xxh3_128=xxhash.xxh3_128_hexdigest(encoded.payload))
        if held.keyframe is None:
            raise NotHeld(f"have_version: this relay serves version {version} as a delta from "
                          f"{held.served.base_version} only (it keeps no weights to make a keyframe)")
        return held.keyframe

    async def _wait(self, model: str, want: int, wait_s: float) -> _Held:
        async def arrived() -> _Held:
            async with self._changed:
                await self._changed.wait_for(lambda: self._ready(model, want))
                return self._held[model]

        try:
            return await asyncio.wait_for(arrived(), wait_s)
        except TimeoutError:
            held = self._held.get(model)
            raise NotYet(f"want_version: this relay has not verified version {want or 'any'} of {model} within "
                         f"{wait_s} s (it holds {held.served.version if held else 'none'})") from None

    def _ready(self, model: str, want: int) -> bool:
        held = self._held.get(model)
        return held is not None and (not want or held.served.version >= want)


class RelayServicer(weights_pb2_grpc.WeightServiceServicer):
    """Fetch from a replica's holdings; every other call belongs to the publisher."""

    def __init__(self, holdings: RelayHoldings, *, wait_s: float, egress: LinkLimit | None = None,
                 chunk_bytes: int = CHUNK_BYTES) -> None:
        self.holdings = holdings
        self.wait_s = wait_s
        self.egress = egress or LinkLimit(0)
        self.chunk_bytes = min(chunk_bytes, CHUNK_BYTES)

    async def Fetch(self, request: weights_pb2.FetchRequest,
                    context: grpc.aio.ServicerContext) -> AsyncIterator[weights_pb2.WeightChunk]:
        problem = check_fetch_request(request)
        if problem:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        # Waits as long as the child does (its deadline), up to wait_s: a child deeper in the tree
        # waits longer, so a parent that lags for its own parent is not the one blamed.
        remaining = context.time_remaining()
        wait_s = self.wait_s if remaining is None else max(0.0, min(self.wait_s, remaining - min(1.0, remaining / 10)))
        try:
            served = await self.holdings.payload_for(request.model, request.have_version, request.want_version,
                                                     wait_s)
        except NotHeld as exc:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
        except NotYet as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        async for chunk in answer_fetch(served, request, context, chunk_bytes=self.chunk_bytes, egress=self.egress,
                                        server="relay", on_bytes=self.holdings.count_served):
            yield chunk

    async def _publisher_only(self, context: grpc.aio.ServicerContext, call: str) -> None:
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                            f"{call}: a relay serves Fetch only; ask the publisher")

    async def Push(self, request_iterator, context):  # type: ignore[no-untyped-def]
        await self._publisher_only(context, "Push")

    async def ListVersions(self, request, context):  # type: ignore[no-untyped-def]
        await self._publisher_only(context, "ListVersions")

    async def KeepVersion(self, request, context):  # type: ignore[no-untyped-def]
        await self._publisher_only(context, "KeepVersion")

    async def JoinTree(self, request, context):  # type: ignore[no-untyped-def]
        await self._publisher_only(context, "JoinTree")


async def start_relay_server(servicer: RelayServicer, *, host: str, port: int, bearer_token: str = ""
                             ) -> tuple[grpc.aio.Server, int]:
    """A replica's relay on a gRPC server of its own (every call carrying `bearer_token` when one
    is set: the publisher's, which the replicas hold); returns it and its port."""
    from policyloop.runtime.grpc_server import start_grpc_server

    server, _health, bound = await start_grpc_server(
        [lambda s: weights_pb2_grpc.add_WeightServiceServicer_to_server(servicer, s)],
        [weights_pb2.DESCRIPTOR.services_by_name["WeightService"].full_name], host=host, port=port,
        bearer_token=bearer_token)
    return server, bound
