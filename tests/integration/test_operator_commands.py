"""The operator's container-side commands against real servers: `policyloop probe` (HTTP /healthz
and the gRPC health protocol), `policyloop audit` over a real NATS, `bootstrap --link`'s symlink;
and a service that cannot start (the learner's `device=cuda` where this torch has no GPU) exits."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import grpc
import pytest
import torch
import typer
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from policyloop.bus import Bus
from policyloop.cli.models import _replace_symlink
from policyloop.cluster.local import free_port
from policyloop.common.device import DeviceUnavailable, resolve_device
from policyloop.runtime import ServiceCannotStart, ServiceSettings, serve
from policyloop.runtime.probe import probe_grpc, probe_http
from tests.conftest import Server, ServiceLauncher
from tests.helpers import until


class _Health(BaseHTTPRequestHandler):
    status = 200

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        body = json.dumps({"checks": {"nats": "ok" if self.status == 200 else "disconnected"}}).encode()
        self.send_response(self.status if self.path == "/healthz" else 404)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def health_http() -> Iterator[tuple[int, type[_Health]]]:
    handler = type("Handler", (_Health,), {"status": 200})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1], handler
    server.shutdown()


def _probe_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "policyloop", "probe", *args], capture_output=True, text=True,
                          timeout=60)


def test_probe_passes_a_healthy_service_and_fails_an_unhealthy_or_absent_one(health_http) -> None:  # type: ignore[no-untyped-def]
    port, handler = health_http
    assert probe_http("127.0.0.1", port).ok
    assert _probe_cli("--http-port", str(port)).returncode == 0
    handler.status = 503
    unhealthy = probe_http("127.0.0.1", port)
    assert not unhealthy.ok and "HTTP 503" in unhealthy.detail and "disconnected" in unhealthy.detail
    assert _probe_cli("--http-port", str(port)).returncode == 1
    refused = probe_http("127.0.0.1", free_port(), timeout_s=1)
    assert not refused.ok and "Connection refused" in refused.detail


def test_probe_checks_the_grpc_health_protocol_where_there_is_a_grpc_port(health_http) -> None:  # type: ignore[no-untyped-def]
    http_port, _ = health_http
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    grpc_port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        assert probe_grpc("127.0.0.1", grpc_port).ok
        assert _probe_cli("--http-port", str(http_port), "--grpc-port", str(grpc_port)).returncode == 0
        servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        result = probe_grpc("127.0.0.1", grpc_port)
        assert not result.ok and "NOT_SERVING" in result.detail
        # Healthy over HTTP is not enough when the gRPC side says otherwise.
        assert _probe_cli("--http-port", str(http_port), "--grpc-port", str(grpc_port)).returncode == 1
    finally:
        server.stop(None)
    assert not probe_grpc("127.0.0.1", grpc_port, timeout_s=1).ok


async def test_audit_reports_an_empty_loop_as_clean(nats_server: Server) -> None:
    bus = await Bus.connect(nats_server.url, name="audit-test")
    try:
        await bus.ensure_topology()
    finally:
        await bus.close()
    result = subprocess.run([sys.executable, "-m", "policyloop", "audit", "--nats-url", nats_server.url,
                             "--settle-s", "1"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout[result.stdout.index("{"):])
    assert report["generated"] == 0 and report["lost"] == 0 and report["newest_version"] == 0 and report["settled"]


def test_bootstrap_link_is_relative_replaced_in_place_and_never_over_a_real_directory(tmp_path: Path) -> None:
    models = tmp_path / "models"
    first, second = models / "cache" / "a", models / "cache" / "b"
    first.mkdir(parents=True)
    second.mkdir(parents=True)
    link = models / "base"
    _replace_symlink(link, first)
    assert link.is_symlink() and not Path(link.readlink()).is_absolute() and link.resolve() == first.resolve()
    _replace_symlink(link, second)
    assert link.resolve() == second.resolve()
    moved = tmp_path / "elsewhere"
    models.rename(moved)  # a volume mounted at another path: the relative link still resolves
    assert (moved / "base").resolve() == (moved / "cache" / "b").resolve()
    with pytest.raises(typer.BadParameter, match="not a symlink"):
        _replace_symlink(moved / "cache", second)


def test_device_settings() -> None:
    assert resolve_device("cpu") == "cpu"
    assert resolve_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ValueError, match="auto, cpu or cuda"):
        resolve_device("tpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="refusal needs a torch without a GPU")
async def test_a_learner_asked_for_cuda_refuses_to_start_without_one(services: ServiceLauncher) -> None:
    with pytest.raises(DeviceUnavailable, match="device=cuda was asked for"):
        resolve_device("cuda")
    learner = services.start("learner", env={"POLICYLOOP_DEVICE": "cuda"})
    await until(lambda: learner.proc.poll() is not None, timeout_s=120, what="the learner to exit")
    assert learner.proc.returncode == 1
    events = [e for e in learner.log_events() if e.get("event") == "service_cannot_start"]
    assert events and "device=cuda was asked for" in events[0]["error"], learner.log()[-2000:]


async def test_a_body_that_cannot_start_ends_its_service_with_exit_code_1(nats_server: Server,
                                                                          redis_server: Server) -> None:
    """The body fails while the first heartbeat is in flight; the stop must not wait on it."""
    async def body(ctx: object) -> None:
        raise ServiceCannotStart("no device")

    settings = ServiceSettings(nats_url=nats_server.url, redis_url=redis_server.url)
    assert await asyncio.wait_for(serve("cannot-start", settings, body), timeout=60) == 1
