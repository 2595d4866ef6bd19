"""tinker service: the Tinker HTTP API. Training requests go on TINKER for the learner (started
with `tinker=true`); sample requests go on TINKER_SAMPLES for the rollout replicas started with
`tinker_sampling=true`, which sample on their engines. The front keeps no engine and no model
weights. This is the wiring; the logic is in policyloop.tinker."""

from __future__ import annotations

from aiohttp import web

from policyloop.models.resolve import hub_repo
from policyloop.runtime import ServiceContext, model_directory, run_main
from policyloop.state import HeartbeatRegistry, connect_redis
from policyloop.tinker.server import TinkerApi
from policyloop.tinker.settings import TinkerSettings


async def body(ctx: ServiceContext) -> None:
    settings: TinkerSettings = ctx.settings  # type: ignore[assignment]
    model_dir = await model_directory(settings.model_path)
    # Models and sessions are protobuf.
    redis = await connect_redis(settings.redis_url, pool=settings.redis_pool, decode_responses=False)
    heartbeats = HeartbeatRegistry(ctx.redis, settings.namespace)

    async def samplers_alive() -> bool:
        return any(beat.healthy and beat.rollout.tinker_sampling for beat in await heartbeats.alive("rollout"))

    runner: web.AppRunner | None = None
    try:
        api = TinkerApi(ctx.bus, redis, namespace=settings.namespace, base_model=settings.model_name(),
                        api_key=settings.api_key,
                        tokenizer_id=settings.tokenizer_id or hub_repo(model_dir) or str(model_dir.resolve()),
                        poll_s=settings.poll_s, order_wait_s=settings.order_wait_s, samplers_alive=samplers_alive)
        runner = web.AppRunner(api.app(), shutdown_timeout=settings.shutdown_grace_s)
        await runner.setup()
        site = web.TCPSite(runner, settings.api_host, settings.api_port)
        await site.start()
        ctx.ready = True
        await ctx.stop.wait()
    finally:
        if runner is not None:
            await runner.cleanup()
        await redis.aclose()


def main(argv: list[str] | None = None) -> int:
    return run_main("tinker", TinkerSettings, body, argv)
