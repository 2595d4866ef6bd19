"""gateway service: gRPC LoopService in front of the loop; feeds runs' Tasks into TASKS.

The logic is in policyloop.gateway (the servicer, request validation, the feeder); this is its
wiring: the Redis stores, the model to check prompts against, the gRPC server, the feeder and
the count of dead-lettered tasks by run.
"""

from __future__ import annotations

import asyncio

import redis.asyncio as aioredis

from policyloop.bus import PullWorker
from policyloop.contracts.v1 import bus_pb2, loop_pb2, loop_pb2_grpc, status_pb2
from policyloop.gateway.dead_letters import DeadLetterAccounting
from policyloop.gateway.feeder import RunFeeder
from policyloop.gateway.model_context import load_model_context
from policyloop.gateway.servicer import GatewayStores, LoopServicer
from policyloop.gateway.settings import GatewaySettings
from policyloop.releases.evals import EvalStore
from policyloop.releases.promotion import Promoter, PromotionLog
from policyloop.runtime import ServiceContext, model_directory, run_main
from policyloop.runtime.grpc_server import start_grpc_server
from policyloop.state import HeartbeatRegistry, IdempotencyKeys, connect_redis
from policyloop.state.catalog import EnvironmentCatalog, RunRegistry
from policyloop.state.progress import RunProgressStore
from policyloop.telemetry.logging import get_logger
from policyloop.weights.client import WeightClient

log = get_logger(__name__)


async def body(ctx: ServiceContext) -> None:
    settings: GatewaySettings = ctx.settings  # type: ignore[assignment]
    # Environments and run definitions are protobuf bytes: this client does not decode replies.
    raw: aioredis.Redis = await connect_redis(settings.redis_url, pool=settings.redis_pool, decode_responses=False,
                                              connect_timeout_s=settings.connect_timeout_s)
    stores = GatewayStores(
        environments=EnvironmentCatalog(raw, settings.namespace), runs=RunRegistry(raw, settings.namespace),
        versions=ctx.versions, progress=RunProgressStore(ctx.redis, settings.namespace),
        heartbeats=HeartbeatRegistry(ctx.redis, settings.namespace),
        evals=EvalStore(raw, settings.namespace), promotions=PromotionLog(ctx.bus),
    )
    publishers: dict[str, WeightClient] = {}

    def publisher(endpoint: str) -> WeightClient:
        return publishers.setdefault(endpoint, WeightClient(endpoint, bearer_token=settings.publisher_token))

    model = await asyncio.to_thread(load_model_context, await model_directory(settings.model_path)) \
        if settings.model_path else None
    if model is not None:
        log.info("model_context", model_path=model.path, context_tokens=model.context_tokens,
                 vocab_size=model.vocab_size, prompts_counted_by=model.measure)
    wake = asyncio.Event()
    servicer = LoopServicer(stores, wake_feeder=wake, stop=ctx.stop, watch_poll_s=settings.watch_poll_s,
                            model=model, max_environment_bytes=settings.max_environment_bytes,
                            promoter=Promoter(ctx.bus, stores.runs, stores.evals, publisher))
    server, _health, port = await start_grpc_server(
        [lambda s: loop_pb2_grpc.add_LoopServiceServicer_to_server(servicer, s)],
        [loop_pb2.DESCRIPTOR.services_by_name["LoopService"].full_name],
        host=settings.grpc_host, port=settings.grpc_port, bearer_token=settings.bearer_token,
    )
    ctx.grpc_endpoint = f"{settings.advertise_host}:{port}"
    ctx.ready = True
    status = status_pb2.GatewayStatus()
    ctx.status = lambda: status

    def backpressure(full: bool) -> None:
        status.backpressure = full

    feeder = RunFeeder(
        ctx.bus, stores.environments, stores.runs, IdempotencyKeys(ctx.redis, settings.namespace),
        owner=settings.instance_id, lease_s=settings.feeder_lease_s,
        backpressure_wait_s=settings.backpressure_wait_s, stop=ctx.stop, wake=wake,
        on_backpressure=backpressure, max_waiting_demonstrations=settings.max_waiting_demonstrations,
    )
    feeding = asyncio.create_task(feeder.run())
    accounting = DeadLetterAccounting(stores.runs, stores.progress.outcomes)
    dead_letters = PullWorker(ctx.bus, ctx.bus.topology.consumers["gateway"], bus_pb2.DeadLetter, accounting.handle,
                              service="gateway", concurrency=8)
    counting = asyncio.create_task(dead_letters.run(ctx.stop))
    try:
        await ctx.stop.wait()
    finally:
        await server.stop(settings.shutdown_grace_s)
        wake.set()
        await asyncio.wait({feeding, counting}, timeout=settings.shutdown_grace_s)
        feeding.cancel()
        await asyncio.gather(feeding, counting, return_exceptions=True)
        await dead_letters.drain(settings.shutdown_grace_s)
        await asyncio.gather(*(client.close() for client in publishers.values()))
        await raw.aclose()


def main(argv: list[str] | None = None) -> int:
    return run_main("gateway", GatewaySettings, body, argv)
