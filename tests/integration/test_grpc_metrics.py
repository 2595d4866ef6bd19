"""Every gRPC server counts its calls by method and status code and times them: a real server
on loopback, real clients, the figures read from the process's Prometheus registry."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import REGISTRY

from policyloop.contracts.v1 import weights_pb2, weights_pb2_grpc
from policyloop.runtime.grpc_server import start_grpc_server


def calls(method: str, code: str) -> float:
    return REGISTRY.get_sample_value("policyloop_grpc_requests_total", {"method": method, "code": code}) or 0.0


def timed(method: str) -> float:
    return REGISTRY.get_sample_value("policyloop_grpc_request_seconds_count", {"method": method}) or 0.0


class Refusing(weights_pb2_grpc.WeightServiceServicer):
    async def ListVersions(self, request, context):  # type: ignore[no-untyped-def]
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "model: refused")

    async def Fetch(self, request, context):  # type: ignore[no-untyped-def]
        for i in range(3):
            yield weights_pb2.WeightChunk(data=bytes([i]))


@pytest.mark.parametrize("token", ["", "s3cret"])
async def test_calls_are_counted_by_method_and_code(token: str) -> None:
    service = weights_pb2.DESCRIPTOR.services_by_name["WeightService"].full_name
    server, _, port = await start_grpc_server(
        [lambda s: weights_pb2_grpc.add_WeightServiceServicer_to_server(Refusing(), s)], [service],
        host="127.0.0.1", port=0, bearer_token=token)
    before = {key: calls(*key) for key in [("Health/Check", "OK"), ("Health/Check", "NOT_FOUND"),
                                           ("WeightService/ListVersions", "INVALID_ARGUMENT"),
                                           ("WeightService/ListVersions", "UNAUTHENTICATED"),
                                           ("WeightService/Fetch", "OK")]}
    fetches = timed("WeightService/Fetch")
    metadata = (("authorization", f"Bearer {token}"),) if token else ()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            health_stub = health_pb2_grpc.HealthStub(channel)
            await health_stub.Check(health_pb2.HealthCheckRequest(service=service))
            with pytest.raises(grpc.aio.AioRpcError):
                await health_stub.Check(health_pb2.HealthCheckRequest(service="no.such.Service"))
            stub = weights_pb2_grpc.WeightServiceStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.ListVersions(weights_pb2.ListVersionsRequest(), metadata=metadata)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            chunks = [c async for c in stub.Fetch(weights_pb2.FetchRequest(model="m"), metadata=metadata)]
            assert len(chunks) == 3
            if token:
                with pytest.raises(grpc.aio.AioRpcError):
                    await stub.ListVersions(weights_pb2.ListVersionsRequest())  # no token
    finally:
        await server.stop(None)
    assert calls("Health/Check", "OK") == before[("Health/Check", "OK")] + 1
    assert calls("Health/Check", "NOT_FOUND") == before[("Health/Check", "NOT_FOUND")] + 1
    assert calls("WeightService/ListVersions", "INVALID_ARGUMENT") == \
        before[("WeightService/ListVersions", "INVALID_ARGUMENT")] + 1
    assert calls("WeightService/ListVersions", "UNAUTHENTICATED") == \
        before[("WeightService/ListVersions", "UNAUTHENTICATED")] + (1 if token else 0)
    assert calls("WeightService/Fetch", "OK") == before[("WeightService/Fetch", "OK")] + 1
    assert timed("WeightService/Fetch") == fetches + 1
