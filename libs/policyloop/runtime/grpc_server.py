"""gRPC servers with the standard health service and reflection, and an optional bearer token."""

from __future__ import annotations

import hmac
import inspect
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import grpc
from google.protobuf.message import Message
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from policyloop.contracts.undecodable import decode_problem
from policyloop.telemetry.metrics import GRPC_REQUESTS, GRPC_SECONDS

# Every kind of RPC by (request_streaming, response_streaming): a handler is remade as its own kind.
_HANDLER_KINDS: dict[tuple[bool, bool], tuple[str, Callable[..., grpc.RpcMethodHandler]]] = {
    (False, False): ("unary_unary", grpc.unary_unary_rpc_method_handler),
    (True, False): ("stream_unary", grpc.stream_unary_rpc_method_handler),
    (False, True): ("unary_stream", grpc.unary_stream_rpc_method_handler),
    (True, True): ("stream_stream", grpc.stream_stream_rpc_method_handler),
}


def _kind(handler: grpc.RpcMethodHandler) -> tuple[bool, bool]:
    return handler.request_streaming, handler.response_streaming


def _behaviour(handler: grpc.RpcMethodHandler) -> Callable[..., Any]:
    return getattr(handler, _HANDLER_KINDS[_kind(handler)][0])


def _remade(handler: grpc.RpcMethodHandler, behaviour: Callable[..., Any],
            request_deserializer: Callable[[bytes], Any] | None = None) -> grpc.RpcMethodHandler:
    """`handler` with another behaviour (and deserializer), of the same kind."""
    make = _HANDLER_KINDS[_kind(handler)][1]
    return make(behaviour, request_deserializer=request_deserializer or handler.request_deserializer,
                response_serializer=handler.response_serializer)


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Rejects every call without `authorization: Bearer <token>`. Health checks and
    reflection stay open: orchestrators probe without the secret, and the schema is public."""

    OPEN_METHODS = ("/grpc.health.v1.Health/", "/grpc.reflection.")

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

        async def deny(_request: object, context: grpc.aio.ServicerContext) -> None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")

        # One per kind, without a deserializer: a refused call's bytes are never parsed, so a
        # bad token is UNAUTHENTICATED whatever the request holds. A coroutine answers a
        # streaming call as well (gRPC's writer API), with no message.
        self._deny = {kind: make(deny) for kind, (_, make) in _HANDLER_KINDS.items()}

    async def intercept_service(self, continuation, handler_call_details):  # type: ignore[no-untyped-def]
        method = handler_call_details.method
        if method.startswith(self.OPEN_METHODS):
            return await continuation(handler_call_details)
        metadata = dict(handler_call_details.invocation_metadata or ())
        supplied = str(metadata.get("authorization", "")).encode()
        if hmac.compare_digest(supplied, self._expected):
            return await continuation(handler_call_details)
        handler = await continuation(handler_call_details)
        return None if handler is None else self._deny[_kind(handler)]


class _Undecodable:
    """What a request deserializer hands over for bytes that do not parse. A deserializer that
    raises makes gRPC answer UNKNOWN with the parser's text, and it has no context to abort
    with; the call's behaviour refuses this with INVALID_ARGUMENT instead."""

    def __init__(self, problem: str) -> None:
        self.problem = problem


def _tolerant(deserialize: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    message_class = getattr(deserialize, "__self__", None)  # generated code passes Message.FromString

    def parse(data: bytes) -> Any:
        try:
            return deserialize(data)
        except Exception as exc:  # noqa: BLE001 - any parser's failure is the client's bytes
            if isinstance(message_class, type) and issubclass(message_class, Message):
                return _Undecodable(decode_problem(message_class, data) or f"request: {exc}")
            return _Undecodable(f"request: does not parse ({type(exc).__name__}: {exc})")
    return parse


async def _refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
    if isinstance(request, _Undecodable):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.problem)


async def _checked_requests(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
    async for request in requests:
        await _refuse(request, context)
        yield request


def _checked(behaviour: Callable[..., Any], request_streaming: bool) -> Callable[..., Any]:
    """`behaviour`, refusing an undecodable request (the one, or any of a stream) first."""
    async def arguments(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if request_streaming:
            return _checked_requests(request, context)
        await _refuse(request, context)
        return request

    if inspect.isasyncgenfunction(behaviour):
        async def checked_stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            async for item in behaviour(await arguments(request, context), context):
                yield item
        return checked_stream

    async def checked(request: Any, context: grpc.aio.ServicerContext) -> Any:
        answer = behaviour(await arguments(request, context), context)
        return await answer if inspect.isawaitable(answer) else answer
    return checked


class RequestDecodeInterceptor(grpc.aio.ServerInterceptor):
    """Requests whose bytes do not parse (a string field that is not UTF-8, broken framing) are
    INVALID_ARGUMENT naming the field, on every method of every service (decode_problem)."""

    async def intercept_service(self, continuation, handler_call_details):  # type: ignore[no-untyped-def]
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        return _remade(handler, _checked(_behaviour(handler), handler.request_streaming),
                       _tolerant(handler.request_deserializer))


class RpcMetricsInterceptor(grpc.aio.ServerInterceptor):
    """Counts every call by method and status code and times it (policyloop_grpc_requests_total,
    policyloop_grpc_request_seconds). Reflection streams are left out: they are tooling."""

    async def intercept_service(self, continuation, handler_call_details):  # type: ignore[no-untyped-def]
        handler = await continuation(handler_call_details)
        method = handler_call_details.method.rsplit(".", 1)[-1]  # "/pkg.Service/Method" → "Service/Method"
        if handler is None or handler_call_details.method.startswith("/grpc.reflection."):
            return handler
        timed = _timed_stream if handler.response_streaming else _timed_unary
        return _remade(handler, timed(_behaviour(handler), method))


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
    if not inspect.isasyncgenfunction(behaviour):  # a coroutine writing with context.write()
        return _timed_unary(behaviour, method)

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
    # Metrics first: a call the token check refuses is counted too (UNAUTHENTICATED). The token
    # before the request's bytes: a caller without it learns nothing from how they are checked.
    interceptors: list[grpc.aio.ServerInterceptor] = [RpcMetricsInterceptor()]
    if bearer_token:
        interceptors.append(BearerTokenInterceptor(bearer_token))
    interceptors.append(RequestDecodeInterceptor())
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
