"""publisher service: gRPC WeightService over versions on disk, WeightsPublished on WEIGHTS.

A version is announced only after it is durable, and the newest of every model again at
start-up (policyloop.publisher.announcer). A damaged store still starts: what fails the store's
checks is quarantined (policyloop.weights.store) and dead-lettered (policyloop.publisher.quarantine).
This is the wiring; the logic is in policyloop.publisher and policyloop.weights.
"""

from __future__ import annotations

import asyncio

from policyloop.publisher.announcer import Announcer
from policyloop.publisher.quarantine import Reports, quarantine_reporter
from policyloop.publisher.settings import PublisherSettings
from policyloop.runtime import ServiceContext, run_main
from policyloop.weights.fanout import FanoutTree
from policyloop.weights.library import WeightLibrary
from policyloop.weights.link import LinkLimit
from policyloop.weights.server import WeightServicer, start_weight_server
from policyloop.weights.store import StoredVersion, VersionStore


async def body(ctx: ServiceContext) -> None:
    settings: PublisherSettings = ctx.settings  # type: ignore[assignment]
    reports = Reports(asyncio.get_running_loop())
    # Opening the store checks every record, payload size and snapshot: off the event loop.
    store = await asyncio.to_thread(VersionStore, settings.store_dir, retention=settings.retention_versions,
                                    on_quarantine=quarantine_reporter(ctx.bus, reports))
    library = WeightLibrary(store, snapshot_every=settings.snapshot_every,
                            cache_entries=settings.payload_cache_entries)

    def announced(stored: StoredVersion) -> None:
        ctx.policy_version = max(ctx.policy_version, stored.version)

    announcer = Announcer(ctx.bus, on_announced=announced)
    tree = settings.tree
    servicer = WeightServicer(library, on_stored=announcer.announce, egress=LinkLimit(settings.egress_gbps),
                              tree=(lambda: FanoutTree(tree.fanout, tree.lease_s, node=tree.node, zone=tree.zone))
                              if tree.fanout else None)
    server, port = await start_weight_server(servicer, host=settings.grpc_host, port=settings.grpc_port,
                                             bearer_token=settings.bearer_token)
    announcer.endpoint = f"{settings.advertise_host}:{port}"
    ctx.grpc_endpoint = announcer.endpoint
    ctx.ready = True
    await announcer.announce_latest(store)
    try:
        await ctx.stop.wait()
    finally:
        # Lets running pushes and fetches finish within the grace period.
        await server.stop(ctx.settings.shutdown_grace_s)
        await library.drain()
        await reports.drain()


def main(argv: list[str] | None = None) -> int:
    return run_main("publisher", PublisherSettings, body, argv)
