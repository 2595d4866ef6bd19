"""Every RPC of every gRPC service in protos/, and every route of the Tinker HTTP front, refuses
what a client gets wrong with the code that says so: a missing or wrong token UNAUTHENTICATED
(HTTP 401), bytes that are not UTF-8 where a string goes INVALID_ARGUMENT naming the field (HTTP
4xx); never UNKNOWN, INTERNAL or a 5xx. The RPCs are read from the generated descriptors, so a
new one (or a new string field) is covered without touching this test."""

from __future__ import annotations

import asyncio
import importlib
import pkgutil
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import grpc
import pytest
from google.protobuf.descriptor import Descriptor, FieldDescriptor, MethodDescriptor, ServiceDescriptor

import policyloop.contracts.v1
from policyloop.contracts.v1 import loop_pb2, loop_pb2_grpc
from policyloop.weights.client import WeightClient, refused
from policyloop.weights.push import VersionPusher
from policyloop.weights.sync import sync_weights
from tests.conftest import ServiceLauncher
from tests.helpers import perturbed, random_weights

TOKEN = "s3cret"
BAD_UTF8 = b"\xff\xfe"
MAX_DEPTH = 4  # nested messages followed looking for strings (recursive types stop earlier)


def all_services() -> list[ServiceDescriptor]:
    """Every service the generated contracts define."""
    found = []
    for module in pkgutil.iter_modules(policyloop.contracts.v1.__path__):
        if module.name.endswith("_pb2"):
            descriptor = importlib.import_module(f"policyloop.contracts.v1.{module.name}").DESCRIPTOR
            found.extend(descriptor.services_by_name.values())
    return found


def string_fields(message: Descriptor, prefix: tuple[FieldDescriptor, ...] = ()
                  ) -> Iterator[tuple[FieldDescriptor, ...]]:
    """The path to every string field of `message`, nested ones included."""
    for field in message.fields:
        path = (*prefix, field)
        if field.type == FieldDescriptor.TYPE_STRING:
            yield path
        elif field.type == FieldDescriptor.TYPE_MESSAGE and len(path) < MAX_DEPTH and \
                field.message_type not in [f.message_type for f in prefix]:
            yield from string_fields(field.message_type, path)


def varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def bad_string(path: tuple[FieldDescriptor, ...]) -> bytes:
    """A message whose string at `path` holds bytes that are not UTF-8 (wire type 2 at each level)."""
    payload = BAD_UTF8
    for field in reversed(path):
        payload = varint(field.number << 3 | 2) + varint(len(payload)) + payload
    return payload


async def status_of(channel: grpc.aio.Channel, method: MethodDescriptor, body: bytes,
                    metadata: tuple[tuple[str, str], ...]) -> tuple[grpc.StatusCode, str]:
    """Calls `method` with the raw `body` (one message for a streaming request) and reads every
    answer; the status it ends with. Serializers None: the bytes go as they are."""
    path = f"/{method.containing_service.full_name}/{method.name}"
    kinds = {(False, False): channel.unary_unary, (True, False): channel.stream_unary,
             (False, True): channel.unary_stream, (True, True): channel.stream_stream}
    stub = kinds[(method.client_streaming, method.server_streaming)](path)

    async def one() -> AsyncIterator[bytes]:
        yield body

    call = stub(one() if method.client_streaming else body, metadata=metadata, timeout=20)
    try:
        if method.server_streaming:
            async for _ in call:
                pass
        else:
            await call
    except grpc.aio.AioRpcError as exc:
        return exc.code(), exc.details() or ""
    return grpc.StatusCode.OK, ""


@dataclass
class Servers:
    targets: dict[str, str]  # service full name -> host:port of the real process serving it


@pytest.fixture
async def servers(services: ServiceLauncher) -> Servers:
    token = {"POLICYLOOP_BEARER_TOKEN": TOKEN}
    gateway, publisher = services.start("gateway", env=token), services.start("publisher", env=token)
    await services.wait_healthy(gateway, publisher)
    return Servers({"policyloop.v1.LoopService": f"127.0.0.1:{gateway.ports['grpc']}",
                    "policyloop.v1.WeightService": f"127.0.0.1:{publisher.ports['grpc']}"})


async def refusals_of(target: str, service: ServiceDescriptor) -> list[str]:
    """What each of `service`'s methods answered that it should not have: '<method> <case>:
    <code> <details>' for every case that did not end with the code it must."""
    wrong = []
    async with grpc.aio.insecure_channel(target) as channel:
        for method in service.methods:
            first_string = next(string_fields(method.input_type), None)
            some_bad_bytes = bad_string(first_string) if first_string else b""
            cases = [("no token", b"", (), grpc.StatusCode.UNAUTHENTICATED, ""),
                     ("wrong token", some_bad_bytes, (("authorization", "Bearer nope"),),
                      grpc.StatusCode.UNAUTHENTICATED, "")]
            cases += [(f"invalid UTF-8 in {'.'.join(f.name for f in path)}", bad_string(path),
                       (("authorization", f"Bearer {TOKEN}"),), grpc.StatusCode.INVALID_ARGUMENT,
                       ".".join(f.name for f in path) + ":")
                      for path in string_fields(method.input_type)]
            for case, body, metadata, expected, names in cases:
                code, details = await status_of(channel, method, body, metadata)
                if code != expected or not details.startswith(names):
                    wrong.append(f"{method.name} {case}: {code.name} {details!r}")
    return wrong


async def test_every_rpc_refuses_bad_tokens_and_undecodable_strings_with_their_codes(servers: Servers) -> None:
    every = all_services()
    assert {s.full_name for s in every} == set(servers.targets), "a service this test does not start"
    assert sum(len(s.methods) for s in every) >= 14
    wrong = await asyncio.gather(*(refusals_of(servers.targets[s.full_name], s) for s in every))
    assert [line for lines in wrong for line in lines] == []


async def test_a_loss_value_that_is_no_number_is_invalid_naming_the_setting(servers: Servers) -> None:
    """Not FAILED_PRECONDITION advising the learner be started with it."""
    request = loop_pb2.StartRunRequest(environments=[loop_pb2.EnvironmentMix(environment="a@v1", weight=1)],
                                       loss={"clip_low": "abc"})
    async with grpc.aio.insecure_channel(servers.targets["policyloop.v1.LoopService"]) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await loop_pb2_grpc.LoopServiceStub(channel).StartRun(
                request, metadata=(("authorization", f"Bearer {TOKEN}"),), timeout=20)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.details().startswith("loss[clip_low]: Input should be a valid number"), refused.value.details()


async def test_a_replica_with_a_wrong_token_is_told_so_and_does_not_fall_back_to_a_keyframe(servers: Servers) -> None:
    """A refused delta is fetched again as a keyframe; a refused token is no refused delta."""
    target = servers.targets["policyloop.v1.WeightService"]
    first = random_weights(1)
    pushing, intruder = WeightClient(target, bearer_token=TOKEN), WeightClient(target, bearer_token="nope")
    try:
        pusher = VersionPusher(pushing, "policy")
        for weights in (first, perturbed(first, 2)):
            await pusher.push(weights, step=weights.version)
        with pytest.raises(grpc.aio.AioRpcError) as denied:
            await sync_weights(intruder, "policy", first.copy(), 2)
    finally:
        await asyncio.gather(pushing.close(), intruder.close())
    assert denied.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_failures_outside_the_publishers_handling_are_not_refused_deltas() -> None:
    def failure(code: grpc.StatusCode) -> grpc.aio.AioRpcError:
        return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), "details")

    assert not refused(failure(grpc.StatusCode.UNKNOWN))
    assert not refused(failure(grpc.StatusCode.UNAUTHENTICATED))
    assert refused(failure(grpc.StatusCode.DATA_LOSS)) and refused(failure(grpc.StatusCode.FAILED_PRECONDITION))
