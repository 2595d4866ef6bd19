"""The HTTP side every service exposes: Prometheus `/metrics` and `/healthz`."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest


@dataclass
class HealthReport:
    healthy: bool
    detail: dict[str, object] = field(default_factory=dict)


HealthCheck = Callable[[], HealthReport]


def build_app(health: HealthCheck) -> web.Application:
    async def metrics(_: web.Request) -> web.Response:
        return web.Response(body=generate_latest(REGISTRY), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def healthz(_: web.Request) -> web.Response:
        report = health()
        body = json.dumps({"healthy": report.healthy, **report.detail})
        return web.Response(
            status=200 if report.healthy else 503, text=body, content_type="application/json"
        )

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/healthz", healthz)
    return app


async def start_http(health: HealthCheck, host: str, port: int) -> tuple[web.AppRunner, int]:
    """Starts the server and returns it with the bound port (port 0 picks a free one)."""
    runner = web.AppRunner(build_app(health), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, bound
