"""tinker service: the Tinker HTTP API. Training requests go on TINKER for the learner (started
with `tinker=true`); sampling runs on an engine through the SGLang client, with adapter versions
fetched from the publisher. This is the wiring; the logic is in policyloop.tinker."""

from __future__ import annotations

import asyncio

from aiohttp import web

from policyloop.engines.sglang_client import SGLangClient
from policyloop.models.resolve import hub_repo
from policyloop.rollout.engine_process import engine_url_or_start, stop_engine, wait_for_engine
from policyloop.runtime import ServiceContext, model_directory, run_main
from policyloop.state import HeartbeatRegistry, connect_redis
from policyloop.tinker.sampling import EngineSampler
from policyloop.tinker.server import TinkerApi
from policyloop.tinker.settings import TinkerSettings
from policyloop.weights.client import WeightClient


async def body(ctx: ServiceContext) -> None:
    settings: TinkerSettings = ctx.settings  # type: ignore[assignment]
    model_dir = await model_directory(settings.model_path)
    url, engine_proc = engine_url_or_start(settings.engine_url, model_dir,
                                           max_batch=settings.engine_max_batch, threads=settings.engine_threads)
    engine = SGLangClient(url, timeout_s=settings.generate_timeout_s)
    fetchers: dict[str, WeightClient] = {}

    def publisher_for(endpoint: str) -> WeightClient:
        return fetchers.setdefault(endpoint, WeightClient(endpoint, bearer_token=settings.publisher_token))

    # Models and sessions are protobuf.
    redis = await connect_redis(settings.redis_url, pool=settings.redis_pool, decode_responses=False)
    heartbeats = HeartbeatRegistry(ctx.redis, settings.namespace)

    async def fronts_alive() -> set[str]:
        return {beat.instance for beat in await heartbeats.alive("tinker")}

    runner: web.AppRunner | None = None
    api: TinkerApi | None = None
    try:
        await wait_for_engine(engine, engine_proc, settings.engine_start_timeout_s)
        api = TinkerApi(ctx.bus, redis, namespace=settings.namespace, base_model=settings.model_name(),
                        api_key=settings.api_key, sampler=EngineSampler(engine, publisher_for, settings.adapters_kept),
                        tokenizer_id=settings.tokenizer_id or hub_repo(model_dir) or str(model_dir.resolve()),
                        poll_s=settings.poll_s, order_wait_s=settings.order_wait_s,
                        max_sampling=settings.max_sampling, instance_id=settings.instance_id,
                        fronts_alive=fronts_alive)
        runner = web.AppRunner(api.app(), shutdown_timeout=settings.shutdown_grace_s)
        await runner.setup()
        site = web.TCPSite(runner, settings.api_host, settings.api_port)
        await site.start()
        ctx.ready = True
        await ctx.stop.wait()
    finally:
        if api is not None:
            await api.close()
        if runner is not None:
            await runner.cleanup()
        await redis.aclose()
        await engine.close()
        await asyncio.gather(*(client.close() for client in fetchers.values()))
        await stop_engine(engine_proc)


def main(argv: list[str] | None = None) -> int:
    return run_main("tinker", TinkerSettings, body, argv)
