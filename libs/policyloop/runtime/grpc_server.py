"""gRPC servers with the standard health service and reflection, and an optional bearer token."""

from __future__ import annotations

import hmac
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from policyloop.telemetry.metrics import GRPC_REQUESTS, GRPC_SECONDS


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Rejects every call without `authorization: Bearer <token>`. Health checks and
    reflection stay open: orchestrators probe without the secret, and the schema is public."""

    OPEN_METHODS = ("/grpc.health.v1.Health/", "/grpc.reflection.")

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

        async def deny(_request: object, context: grpc.aio.ServicerContext) -> None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")

        self._deny_unary = grpc.unary_unary_rpc_method_handler(deny)
        self._deny_stream = grpc.stream_unary_rpc_method_handler(deny)
        self._deny_unary_stream = grpc.unary_stream_rpc_method_handler(deny)

    async def intercept_service(self, continuation, handler_call_details):  # type: ignore[no-untyped-def]
        method = handler_call_details.method
        if method.startswith(self.OPEN_METHODS):
            return await continuation(handler_call_details)
        metadata = dict(handler_call_details.invocation_metadata or ())
        supplied = str(metadata.get("authorization", "")).encode()
        if hmac.compare_digest(supplied, self._expected):
            return await continuation(handler_call_details)
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        if handler.request_streaming:
            return self._deny_stream
        if handler.response_streaming:
            return self._deny_unary_stream
        return self._deny_unary


class RpcMetricsInterceptor(grpc.aio.ServerInterceptor):
    """Counts every call by method and status code and times it (policyloop_grpc_requests_total,
    policyloop_grpc_request_seconds). Reflection streams are left out: they are tooling."""

    async def intercept_service(self, continuation, handler_call_details):  # type: ignore[no-untyped-def]
        handler = await continuation(handler_call_details)
        method = handler_call_details.method.rsplit(".", 1)[-1]  # "/pkg.Service/Method" → "Service/Method"
        if handler is None or handler_call_details.method.startswith("/grpc.reflection."):
            return handler
        kinds = {
            (False, False): (handler.unary_unary, grpc.unary_unary_rpc_method_handler, _timed_unary),
            (True, False): (handler.stream_unary, grpc.stream_unary_rpc_method_handler, _timed_unary),
            (False, True): (handler.unary_stream, grpc.unary_stream_rpc_method_handler, _timed_stream),
            (True, True): (handler.stream_stream, grpc.stream_stream_rpc_method_handler, _timed_stream),
        }
        behaviour, make, timed = kinds[(handler.request_streaming, handler.response_streaming)]
        return make(timed(behaviour, method), request_deserializer=handler.request_deserializer,
                    response_serializer=handler.response_serializer)


def _record(method: str, context: grpc.aio.ServicerContext, started: float, failed: bool) -> None:
    code = context.code()
    name = getattr(code, "name", None) or ("UNKNOWN" if failed else "OK")
    GRPC_REQUESTS.labels(method, name).inc()
    GRPC_SECONDS.labels(method).observe(time.perf_counter() - started)


def _timed_unary(behaviour: Callable[..., Any], method: str) -> Callable[..., Any]:
    async def timed(request: Any, context: grpc.aio.ServicerContext) -> Any:
        started, failed = time.perf_counter(), True
        try:
            response = await behaviour(request, context)
            failed = False
            return response
        finally:
            _record(method, context, started, failed)
    return timed


def _timed_stream(behaviour: Callable[..., Any], method: str) -> Callable[..., Any]:
    async def timed(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        started, failed = time.perf_counter(), True
        try:
            async for item in behaviour(request, context):
                yield item
            failed = False
        finally:
            _record(method, context, started, failed)
    return timed


Registrar = Callable[[grpc.aio.Server], None]


async def start_grpc_server(
    registrars: Sequence[Registrar],
    service_names: Sequence[str],
    *,
    host: str,
    port: int,
    bearer_token: str = "",
) -> tuple[grpc.aio.Server, health.aio.HealthServicer, int]:
    """Starts a server with the given services plus health and reflection. Returns the server,
    its health servicer (to flip SERVING/NOT_SERVING) and the bound port."""
    # Metrics first: a call the token check refuses is counted too (UNAUTHENTICATED).
    interceptors: list[grpc.aio.ServerInterceptor] = [RpcMetricsInterceptor()]
    if bearer_token:
        interceptors.append(BearerTokenInterceptor(bearer_token))
    server = grpc.aio.server(
        interceptors=interceptors,
        options=[
            ("grpc.max_receive_message_length", 8 * 1024 * 1024),
            ("grpc.max_send_message_length", 8 * 1024 * 1024),
        ],
    )
    for register in registrars:
        register(server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for name in ("", *service_names):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    reflection.enable_server_reflection(
        (*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot listen on {host}:{port}")
    await server.start()
    return server, health_servicer, bound
