"""Health probes a container runtime runs inside the container (`policyloop probe`): the
service's own /healthz, and the gRPC health protocol where the service serves gRPC. Kept free
of heavy imports: a probe runs every few seconds."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from dataclasses import dataclass


@dataclass(frozen=True)
class ProbeResult:
    ok: bool
    what: str      # e.g. "http://127.0.0.1:9100/healthz"
    detail: str    # the reason when not ok, else the service's answer in brief


def probe_http(host: str, port: int, timeout_s: float = 3.0) -> ProbeResult:
    url = f"http://{host}:{port}/healthz"
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            body = response.read(4096)
            return ProbeResult(response.status == 200, url, _brief(body))
    except urllib.error.HTTPError as exc:  # 503: the service answers but is not healthy
        return ProbeResult(False, url, f"HTTP {exc.code}: {_brief(exc.read(4096))}")
    except (OSError, ValueError) as exc:
        return ProbeResult(False, url, repr(exc))


async def grpc_serving(target: str, timeout_s: float = 2.0) -> tuple[bool, str]:
    """The gRPC health protocol's overall status ("" service) at `target`: (serving, why not)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    async with grpc.aio.insecure_channel(target) as channel:
        try:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=timeout_s
            )
        except grpc.aio.AioRpcError as exc:
            return False, f"grpc health: {exc.code().name}"
    serving = reply.status == health_pb2.HealthCheckResponse.SERVING
    return serving, "" if serving else f"grpc health: {health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)}"


def probe_grpc(host: str, port: int, timeout_s: float = 3.0) -> ProbeResult:
    target = f"{host}:{port}"
    serving, reason = asyncio.run(grpc_serving(target, timeout_s))
    return ProbeResult(serving, f"grpc://{target}", reason or "SERVING")


def _brief(body: bytes) -> str:
    try:
        checks = json.loads(body).get("checks")
    except (ValueError, AttributeError):
        return body[:200].decode(errors="replace")
    return json.dumps(checks, separators=(",", ":")) if checks is not None else ""
