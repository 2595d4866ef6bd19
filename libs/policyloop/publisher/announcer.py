"""WeightsPublished for each version once it is durable. At start-up the newest version of every
stored model is announced again (same message id, so JetStream drops it if it was seen), so a
crash between storing and announcing never leaves a version unannounced."""

from __future__ import annotations

from collections.abc import Callable

from policyloop.bus import Bus, weights_subject
from policyloop.contracts.v1 import bus_pb2
from policyloop.telemetry.logging import get_logger
from policyloop.weights.store import StoredVersion, VersionStore

log = get_logger(__name__)


def announcement(stored: StoredVersion, endpoint: str) -> bus_pb2.WeightsPublished:
    return bus_pb2.WeightsPublished(
        model=stored.model, version=stored.version, manifest_hash=stored.manifest_hash,
        base_versions=[stored.base_version] if stored.kind == "delta" else [],
        bytes_raw=stored.raw_bytes, bytes_delta=stored.bytes if stored.kind == "delta" else 0,
        codec=stored.codec, fetch_endpoint=endpoint, step=stored.step,
        published_unix_ms=stored.created_unix_ms, run_id=stored.run_id, trained_unix_ms=stored.trained_unix_ms,
    )


class Announcer:
    """`endpoint` is where clients fetch (host:port of the WeightService), set once the server
    listens; `on_announced` hears each version announced."""

    def __init__(self, bus: Bus, on_announced: Callable[[StoredVersion], None] = lambda stored: None) -> None:
        self.bus = bus
        self.endpoint = ""
        self.on_announced = on_announced

    async def announce(self, stored: StoredVersion) -> None:
        event = announcement(stored, self.endpoint)
        await self.bus.publish(weights_subject(stored.model), event, f"weights:{stored.model}:{stored.version}")
        self.on_announced(stored)
        log.info("version_published", model=stored.model, version=stored.version, bytes=stored.bytes)

    async def announce_latest(self, store: VersionStore) -> None:
        """The newest version of every stored model, again."""
        for model in store.models():
            latest = store.latest(model)
            if latest is not None:
                await self.announce(latest)
