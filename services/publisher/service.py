"""publisher service: gRPC WeightService over versions on disk, WeightsPublished on WEIGHTS.

A version is announced only after it is durable. At start-up the newest version of every
stored model is announced again (same message id, so JetStream drops it if it was seen), so a
crash between storing and announcing never leaves a version unannounced.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from policyloop.bus import weights_subject
from policyloop.contracts.v1 import bus_pb2, weights_pb2, weights_pb2_grpc
from policyloop.runtime import ServiceContext, ServiceSettings, run_main
from policyloop.runtime.grpc_server import start_grpc_server
from policyloop.telemetry.logging import get_logger
from policyloop.weights.server import WeightServicer
from policyloop.weights.store import StoredVersion, VersionStore

log = get_logger(__name__)


class PublisherSettings(ServiceSettings):
    grpc_host: str = Field("127.0.0.1", description="Interface of the WeightService gRPC server.")
    grpc_port: int = Field(50052, description="Port of the WeightService gRPC server (0: any free port).")
    store_dir: Path = Field(Path("runs/local/weights"), description="Where versions are kept on disk.")
    retention_versions: int = Field(8, description="Newest versions kept per model; older ones are deleted.")
    bearer_token: str = Field("", description="If set, every call must carry 'authorization: Bearer <token>'.")


def announcement(stored: StoredVersion, endpoint: str) -> bus_pb2.WeightsPublished:
    return bus_pb2.WeightsPublished(
        model=stored.model, version=stored.version, manifest_hash=stored.payload_xxh3_128,
        bytes_raw=stored.bytes, codec=stored.codec, fetch_endpoint=endpoint, step=stored.step,
        published_unix_ms=stored.created_unix_ms, run_id=stored.run_id,
    )


async def body(ctx: ServiceContext) -> None:
    settings: PublisherSettings = ctx.settings  # type: ignore[assignment]
    store = VersionStore(settings.store_dir, retention=settings.retention_versions)
    endpoint = ""

    async def announce(stored: StoredVersion) -> None:
        event = announcement(stored, endpoint)
        await ctx.bus.publish(weights_subject(stored.model), event, f"weights:{stored.model}:{stored.version}")
        ctx.policy_version = max(ctx.policy_version, stored.version)
        log.info("version_published", model=stored.model, version=stored.version, bytes=stored.bytes)

    servicer = WeightServicer(store, on_stored=announce)
    server, _health, port = await start_grpc_server(
        [lambda s: weights_pb2_grpc.add_WeightServiceServicer_to_server(servicer, s)],
        [weights_pb2.DESCRIPTOR.services_by_name["WeightService"].full_name],
        host=settings.grpc_host, port=settings.grpc_port, bearer_token=settings.bearer_token,
    )
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


def main(argv: list[str] | None = None) -> int:
    return run_main("publisher", PublisherSettings, body, argv)
