"""The learner's side of the weights: push each new version to the publisher until it holds it."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import grpc

from policyloop.telemetry.logging import get_logger
from policyloop.weights import codec
from policyloop.weights.client import WeightClient, refused

log = get_logger(__name__)


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

    async def push(self, weights: codec.WeightSet, step: int, *, full: bool = False,
                   trained_unix_ms: int = 0) -> PushReport:
        """`full=True` sends the raw weights every time (the no-delta baseline of the benchmark);
        `trained_unix_ms`: when the step finished computing the version (its announcement carries
        it, so replicas measure step end → serving)."""
        started = time.monotonic()
        if full:
            encoded = await asyncio.to_thread(codec.encode, weights, raw=True)
        else:
            encoded = await asyncio.to_thread(codec.encode, weights, self.confirmed)
        encode_s = time.monotonic() - started
        started = time.monotonic()
        try:
            await self._push_until_held(weights, encoded.payload, step, trained_unix_ms)
        except grpc.aio.AioRpcError as exc:
            if encoded.stats.kind != "delta" or not refused(exc):
                raise
            log.warning("push_keyframe_instead", version=weights.version, code=exc.code().name, reason=exc.details())
            started_keyframe = time.monotonic()
            encoded = await asyncio.to_thread(codec.encode, weights, None)
            encode_s += time.monotonic() - started_keyframe
            await self._push_until_held(weights, encoded.payload, step, trained_unix_ms)
        self.confirmed = weights
        stats = encoded.stats
        return PushReport(weights.version, stats.kind, stats.payload_bytes, stats.raw_bytes,
                          stats.changed_fraction, encode_s, time.monotonic() - started)

    async def _push_until_held(self, weights: codec.WeightSet, payload: bytes, step: int,
                               trained_unix_ms: int) -> None:
        """Pushes until the publisher holds the version. A push whose reply was lost is
        recognised afterwards: the publisher holds the version with the same manifest hash."""
        delay = 0.5
        for attempt in range(1, self.attempts + 1):
            try:
                await self.client.push(self.model, weights.version, payload, step=step, run_id=self.run_id,
                                       trained_unix_ms=trained_unix_ms)
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
