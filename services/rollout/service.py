"""rollout service: TASKS → sampled groups → ROLLOUTS; follows WEIGHTS into its engine
(policyloop.rollout).

The replica talks to its engine only through the SGLang client (SGLang's native HTTP API): a
real SGLang server at `engine_url`, or the embedded engine, started as a child process when
`engine = embedded` and no URL is given.
"""

from __future__ import annotations

import asyncio
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
import redis.asyncio as aioredis

from policyloop.bus import PullWorker
from policyloop.contracts.v1 import status_pb2
from policyloop.engines.sglang_client import SGLangClient
from policyloop.rollout.engine_process import (
    engine_client,
    engine_url_or_start,
    name_base_version,
    stop_engine,
    wait_for_engine,
)
from policyloop.rollout.follower import WeightFollower, promoted_versions
from policyloop.rollout.health import EngineHealth
from policyloop.rollout.replica import RolloutReplica
from policyloop.rollout.settings import RolloutSettings
from policyloop.runtime import ServiceContext, model_directory, run_main, run_pull_workers
from policyloop.runtime.agreement import LoopAgreement
from policyloop.state import HeartbeatRegistry
from policyloop.weights.link import LinkLimit
from policyloop.weights.relay import RelayHoldings, RelayServicer, start_relay_server

if TYPE_CHECKING:
    from policyloop.rollout.adapters import PromotedAdapter


async def body(ctx: ServiceContext) -> None:
    from policyloop.models.tokenizer import load_tokenizer

    settings: RolloutSettings = ctx.settings  # type: ignore[assignment]
    settings.check_engine()
    model_dir = await model_directory(settings.model_path)
    # as its tokenizer.json defines it (AutoTokenizer may swap in a class that drops characters)
    tokenizer = await asyncio.to_thread(load_tokenizer, model_dir)
    url, engine_proc = engine_url_or_start(settings.engine_url, model_dir,
                                           max_batch=settings.engine_max_batch, threads=settings.engine_threads)
    client = engine_client(settings, url)
    status = status_pb2.RolloutStatus(loop=settings.loop_config(), engine_url=url)
    ctx.status = lambda: status
    runs_redis = None
    relay_server: grpc.aio.Server | None = None
    try:
        await wait_for_engine(client, engine_proc, settings.engine_start_timeout_s)
        ctx.policy_version = await name_base_version(client)
        if settings.role == "serving":
            await serve_promoted(ctx, settings, client, tokenizer, status, engine_proc, model_dir)
            return
        relay, relay_endpoint = None, ""
        if settings.relay.enabled:
            relay, relay_server, relay_endpoint = await start_relay(settings)
            status.relay_endpoint = relay_endpoint
        follower = WeightFollower(ctx, settings, client, status, base_dir=model_dir, relay=relay,
                                  relay_endpoint=relay_endpoint)
        engine_health = EngineHealth(client, settings.engine_health_interval_s, engine_proc, follower.resync)
        ctx.add_health_probe("engine", engine_health.probe)
        agreement = LoopAgreement(settings, HeartbeatRegistry(ctx.redis, settings.namespace))
        await agreement.check()
        ctx.add_health_probe("loop", agreement.probe)
        replica = RolloutReplica(ctx, settings, client, tokenizer, engine_health, status,
                                 ready=lambda: engine_health.ready() and agreement.agrees())
        if settings.lora_runs:
            runs_redis = await serve_lora_runs(ctx, settings, replica, client, follower)
        workers = [replica.pull_worker()]
        if settings.tinker_sampling:
            workers.append(tinker_sampling(ctx, settings, client, follower, engine_health, status))
        await serve_replica(ctx, workers, follower, engine_health, agreement)
    finally:
        if runs_redis is not None:
            await runs_redis.aclose()
        if relay_server is not None:
            await relay_server.stop(settings.shutdown_grace_s)
        await client.close()
        await stop_engine(engine_proc)


async def start_relay(settings: RolloutSettings) -> tuple[RelayHoldings, grpc.aio.Server, str]:
    """This replica's relay in the fan-out tree: what it verified, served to its children."""
    holdings = RelayHoldings()
    servicer = RelayServicer(holdings, wait_s=settings.relay.wait_s, egress=LinkLimit(settings.relay.egress_gbps))
    server, port = await start_relay_server(servicer, host=settings.relay.host, port=settings.relay.port,
                                            bearer_token=settings.publisher_token)
    return holdings, server, f"{settings.advertise_host}:{port}"


async def serve_lora_runs(ctx: ServiceContext, settings: RolloutSettings, replica: RolloutReplica,
                          client: SGLangClient, follower: WeightFollower) -> aioredis.Redis:
    """LoRA runs: the replica samples each task with its run's adapter, loaded as announced.
    Returns the Redis client it reads run definitions with (closed by the caller)."""
    from nats.js import api

    from policyloop.engines.adapters import ServedAdapters
    from policyloop.rollout.adapters import LoraRuns
    from policyloop.state import connect_redis
    from policyloop.state.catalog import RunRegistry

    # Run definitions are bytes.
    raw = await connect_redis(settings.redis_url, pool=settings.redis_pool, decode_responses=False)
    served = ServedAdapters(client, settings.weights_dir / "adapters", follower.publisher,
                            load_from=settings.adapter_source)
    replica.lora = LoraRuns(ctx.bus, RunRegistry(raw, settings.namespace), served, settings.model, replica.pacer_for,
                            on_serving=replica.serving_runs)
    await ctx.bus.js.subscribe(replica.lora.subscription_subject(), cb=replica.lora.on_event, ordered_consumer=True,
                               deliver_policy=api.DeliverPolicy.LAST_PER_SUBJECT)
    return raw


def tinker_sampling(ctx: ServiceContext, settings: RolloutSettings, client: SGLangClient, follower: WeightFollower,
                    engine_health: EngineHealth, status: status_pb2.RolloutStatus) -> PullWorker:  # type: ignore[type-arg]
    """The replica's share of the Tinker API's sample requests, on its engine."""
    from policyloop.tinker.sampling import EngineSampler, TinkerSampling

    sampling = TinkerSampling(ctx.bus, EngineSampler(client, follower.publisher, settings.tinker_adapters_kept),
                              concurrency=settings.tinker_concurrency, ready=engine_health.ready)
    status.tinker_sampling = True

    def current() -> status_pb2.RolloutStatus:
        status.tinker_samples_done = sampling.done
        return status

    ctx.status = current
    return sampling.pull_worker()


async def serve_replica(ctx: ServiceContext, workers: list[PullWorker], follower: WeightFollower,  # type: ignore[type-arg]
                        engine_health: EngineHealth, agreement: LoopAgreement) -> None:
    settings: RolloutSettings = ctx.settings  # type: ignore[assignment]
    watch_engine = asyncio.create_task(engine_health.run(ctx.stop))
    # A replica of LoRA runs keeps the base as loaded: full-model versions are not its runs'.
    follow = asyncio.create_task(follower.run() if not settings.lora_runs else ctx.stop.wait())
    watch_learner = asyncio.create_task(agreement.run(ctx.stop, settings.heartbeat_interval_s))
    try:
        await run_pull_workers(ctx, *workers)
    finally:
        await asyncio.gather(follow, watch_engine, watch_learner, return_exceptions=True)
    if watch_engine.done() and not watch_engine.cancelled() and watch_engine.exception() is not None:
        raise RuntimeError("the engine is gone") from watch_engine.exception()


async def serve_promoted(ctx: ServiceContext, settings: RolloutSettings, client: SGLangClient, tokenizer: Any,
                         status: status_pb2.RolloutStatus, engine_proc: subprocess.Popen | None,
                         model_dir: Path) -> None:
    """The serving role: the run's promoted version in the engine, the OpenAI endpoint in front."""
    from aiohttp import web

    from policyloop.serving.openai_api import OpenAIApi

    follower = WeightFollower(ctx, settings, client, status, promoted_versions(settings.serve_run), base_dir=model_dir)
    adapter = await promoted_adapter(ctx, settings, client, follower) if settings.lora_runs else None
    engine_health = EngineHealth(client, settings.engine_health_interval_s, engine_proc,
                                 follower.resync if adapter is None else adapter.resync)
    ctx.add_health_probe("engine", engine_health.probe)
    api = OpenAIApi(client, tokenizer, ctx.bus, settings.served_model_name or settings.serve_run,
                    adapter=adapter.adapter if adapter is not None else None)
    runner = web.AppRunner(api.app(), shutdown_timeout=settings.shutdown_grace_s)
    await runner.setup()
    site = web.TCPSite(runner, settings.openai_host, settings.openai_port)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]  # openai_port may be 0
    status.serving_run = settings.serve_run
    status.openai_url = f"http://{settings.advertise_host}:{port}/v1"
    watch_engine = asyncio.create_task(engine_health.run(ctx.stop))
    follow = asyncio.create_task(follower.run() if adapter is None else adapter.run(ctx.stop))
    ctx.ready = True
    try:
        await ctx.stop.wait()
    finally:
        await runner.cleanup()
        await asyncio.gather(follow, watch_engine, return_exceptions=True)


async def promoted_adapter(ctx: ServiceContext, settings: RolloutSettings, client: SGLangClient,
                           follower: WeightFollower) -> PromotedAdapter:
    """A LoRA run's serving replica: its promoted adapter beside the base, once the run exists
    (a replica may start before the run does)."""
    from policyloop.engines.adapters import ServedAdapters
    from policyloop.rl.settings import LoraSpec, adapter_model_name
    from policyloop.rollout.adapters import PromotedAdapter
    from policyloop.state import connect_redis
    from policyloop.state.catalog import RunRegistry

    # Run definitions are bytes.
    raw = await connect_redis(settings.redis_url, pool=settings.redis_pool, decode_responses=False)
    try:
        while (definition := await RunRegistry(raw, settings.namespace).definition(settings.serve_run)) is None:
            if ctx.stop.is_set():
                raise RuntimeError(f"stopped before run {settings.serve_run!r} was started")
            await asyncio.sleep(1.0)
    finally:
        await raw.aclose()
    if not definition.HasField("lora"):
        raise RuntimeError(f"run {settings.serve_run!r} trains the full model: serve it without lora_runs")
    served = ServedAdapters(client, settings.weights_dir / "adapters", follower.publisher,
                            load_from=settings.adapter_source)

    def serving(version: int) -> None:
        ctx.policy_version = version

    return PromotedAdapter(ctx.bus, served, settings.serve_run, LoraSpec.from_proto(definition.lora),
                           adapter_model_name(settings.model, settings.serve_run), on_version=serving)


def main(argv: list[str] | None = None) -> int:
    return run_main("rollout", RolloutSettings, body, argv)
