"""publisher service: gRPC WeightService over versions on disk, WeightsPublished on WEIGHTS.

A version is announced only after it is durable. At start-up the newest version of every
stored model is announced again (same message id, so JetStream drops it if it was seen), so a
crash between storing and announcing never leaves a version unannounced.

A damaged store still starts: what fails the store's checks is quarantined (see
policyloop.weights.store) and each quarantine is also dead-lettered on DLQ (origin WEIGHTS, the
model's weights subject; the payload is the quarantine's reason record).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from pydantic import Field

from policyloop.bus import Bus, weights_subject
from policyloop.bus.deadletter import publish_dead_letter
from policyloop.contracts.v1 import bus_pb2
from policyloop.runtime import ServiceContext, ServiceSettings, run_main
from policyloop.telemetry.logging import get_logger
from policyloop.weights.library import WeightLibrary
from policyloop.weights.link import LinkLimit
from policyloop.weights.server import WeightServicer, start_weight_server
from policyloop.weights.store import Quarantine, StoredVersion, VersionStore

log = get_logger(__name__)


class PublisherSettings(ServiceSettings):
    grpc_host: str = Field("127.0.0.1", description="Interface of the WeightService gRPC server.")
    grpc_port: int = Field(50052, description="Port of the WeightService gRPC server (0: any free port).")
    store_dir: Path = Field(Path("runs/local/weights"), description="Where versions are kept on disk.")
    retention_versions: int = Field(8, description="Newest versions kept per model; older ones are deleted.")
    bearer_token: str = Field("", description="If set, every call must carry 'authorization: Bearer <token>'.")
    snapshot_every: int = Field(
        16, description="Write a keyframe snapshot after this many chained deltas, so rebuilding any kept "
                        "version (restart, a lagging client) applies at most this many deltas.")
    payload_cache_entries: int = Field(4, description="Payloads kept in memory for fetches (each built once).")
    egress_gbps: float = Field(0.0, description="Cap on the bytes all fetches send, in Gbit/s (0: no cap).")


def announcement(stored: StoredVersion, endpoint: str) -> bus_pb2.WeightsPublished:
    return bus_pb2.WeightsPublished(
        model=stored.model, version=stored.version, manifest_hash=stored.manifest_hash,
        base_versions=[stored.base_version] if stored.kind == "delta" else [],
        bytes_raw=stored.raw_bytes, bytes_delta=stored.bytes if stored.kind == "delta" else 0,
        codec=stored.codec, fetch_endpoint=endpoint, step=stored.step,
        published_unix_ms=stored.created_unix_ms, run_id=stored.run_id,
    )


async def dead_letter_quarantine(bus: Bus, quarantine: Quarantine) -> None:
    """A quarantined store entry on DLQ. A stored file has no stream sequence: the incident
    number (unique per quarantine) stands in for it, which keeps the dead letter's id unique and
    a retried publish deduplicated."""
    try:
        await publish_dead_letter(
            bus, origin_stream="WEIGHTS", origin_subject=weights_subject(quarantine.model),
            stream_seq=quarantine.incident, consumer="", payload=quarantine.to_json().encode(),
            headers={"model": quarantine.model, "version": str(quarantine.version), "what": quarantine.what,
                     "quarantine": quarantine.directory},
            reason=f"version {quarantine.version} of {quarantine.model}: {quarantine.what} {quarantine.reason}",
            kind="weights_quarantined", delivery_count=0, service="publisher",
        )
    except Exception as exc:  # the quarantine itself is on disk, logged and counted already
        log.error("quarantine_dead_letter_failed", model=quarantine.model, version=quarantine.version,
                  error=repr(exc))


Report = Callable[[], Coroutine[Any, Any, None]]


class Reports:
    """Runs reports on the service's loop, whichever thread found what to report (the store
    checks files in worker threads)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.pending: set[asyncio.Task[None]] = set()

    def submit(self, report: Report) -> None:
        self.loop.call_soon_threadsafe(self._start, report)

    def _start(self, report: Report) -> None:
        task = self.loop.create_task(report())
        self.pending.add(task)
        task.add_done_callback(self.pending.discard)

    async def drain(self) -> None:
        while self.pending:
            await asyncio.gather(*self.pending, return_exceptions=True)


async def body(ctx: ServiceContext) -> None:
    settings: PublisherSettings = ctx.settings  # type: ignore[assignment]
    reports = Reports(asyncio.get_running_loop())

    def on_quarantine(quarantine: Quarantine) -> None:
        reports.submit(lambda: dead_letter_quarantine(ctx.bus, quarantine))

    # Opening the store checks every record, payload size and snapshot: off the event loop.
    store = await asyncio.to_thread(VersionStore, settings.store_dir, retention=settings.retention_versions,
                                    on_quarantine=on_quarantine)
    library = WeightLibrary(store, snapshot_every=settings.snapshot_every,
                            cache_entries=settings.payload_cache_entries)
    endpoint = ""

    async def announce(stored: StoredVersion) -> None:
        event = announcement(stored, endpoint)
        await ctx.bus.publish(weights_subject(stored.model), event, f"weights:{stored.model}:{stored.version}")
        ctx.policy_version = max(ctx.policy_version, stored.version)
        log.info("version_published", model=stored.model, version=stored.version, bytes=stored.bytes)

    servicer = WeightServicer(library, on_stored=announce, egress=LinkLimit(settings.egress_gbps))
    server, port = await start_weight_server(servicer, host=settings.grpc_host, port=settings.grpc_port,
                                             bearer_token=settings.bearer_token)
    endpoint = f"{settings.advertise_host}:{port}"
    ctx.detail["grpc"] = endpoint
    ctx.ready = True
    for model in store.models():
        latest = store.latest(model)
        if latest is not None:
            await announce(latest)
    try:
        await ctx.stop.wait()
    finally:
        # Lets running pushes and fetches finish within the grace period.
        await server.stop(ctx.settings.shutdown_grace_s)
        await library.drain()
        await reports.drain()


def main(argv: list[str] | None = None) -> int:
    return run_main("publisher", PublisherSettings, body, argv)
