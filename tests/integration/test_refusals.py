"""Every RPC of every gRPC service in protos/, and every route of the Tinker HTTP front, refuses
what a client gets wrong with the code that says so: a missing or wrong token UNAUTHENTICATED
(HTTP 401), bytes that are not UTF-8 where a string goes INVALID_ARGUMENT naming the field (HTTP
4xx); never UNKNOWN, INTERNAL or a 5xx. The RPCs are read from the generated descriptors, so a
new one (or a new string field) is covered without touching this test."""

from __future__ import annotations

import asyncio
import importlib
import json
import pkgutil
import re
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import aiohttp
import grpc
import pytest
from aiohttp import web
from google.protobuf.descriptor import Descriptor, FieldDescriptor, MethodDescriptor, ServiceDescriptor
from yarl import URL

import policyloop.contracts.v1
from policyloop.bus import Bus
from policyloop.contracts.v1 import loop_pb2, loop_pb2_grpc, tinker_wire_pb2
from policyloop.state import connect_redis
from policyloop.tinker.server import PROTOBUF, TinkerApi
from policyloop.weights.client import WeightClient, refused
from policyloop.weights.push import VersionPusher
from policyloop.weights.sync import sync_weights
from tests.conftest import Server, ServiceLauncher
from tests.helpers import perturbed, random_weights, serving_http

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
    lines = [line for method_lines in wrong for line in method_lines]
    assert not lines, "\n".join(lines)


async def test_a_loss_value_that_is_no_number_is_invalid_naming_the_setting(servers: Servers) -> None:
    """Not FAILED_PRECONDITION advising the learner be started with it."""
    request = loop_pb2.StartRunRequest(environments=[loop_pb2.EnvironmentMix(environment="a@v1", weight=1)],
                                       loss=loop_pb2.LossSettings(normalization="batch"))
    async with grpc.aio.insecure_channel(servers.targets["policyloop.v1.LoopService"]) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await loop_pb2_grpc.LoopServiceStub(channel).StartRun(
                request, metadata=(("authorization", f"Bearer {TOKEN}"),), timeout=20)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.details().startswith("loss.normalization: Input should be 'token'"), refused.value.details()


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


# -- the Tinker HTTP front --------------------------------------------------------------------

API_KEY = "tml-refusals-test-key"
LONE_SURROGATE = "\ud800"  # valid JSON ("\\ud800"), but no UTF-8 string
# Every string a Tinker route reads from a JSON body, each holding what is no UTF-8.
TINKER_STRINGS = ("session_id", "model_id", "base_model", "path", "request_id", "sampling_session_id",
                  "model_path", "tinker_path", "type")


@dataclass
class Front:
    url: str
    app: web.Application


@pytest.fixture
async def tinker_front(bus: Bus, redis_server: Server) -> AsyncIterator[Front]:
    """The front as the tinker service runs it (sample requests go on TINKER_SAMPLES)."""
    redis = await connect_redis(redis_server.url, decode_responses=False)
    api = TinkerApi(bus, redis, namespace="test", base_model="policyloop/tiny", api_key=API_KEY, poll_s=1.0)
    app = api.app()
    try:
        async with serving_http(app) as url:
            yield Front(url, app)
    finally:
        await redis.aclose()


def tinker_routes(app: web.Application) -> list[tuple[str, str]]:
    """(method, path) of every route, each path parameter `{}` to fill in (the catch-all too)."""
    routes = []
    for route in app.router.routes():
        path = re.sub(r"\{[^}]+\}", "{}", route.resource.canonical)  # type: ignore[union-attr]
        routes += [(method, path) for method in ([route.method] if route.method != "*" else ["GET", "POST"])]
    return routes


def bad_requests(method: str, path: str) -> Iterator[tuple[str, str, dict[str, str], bytes]]:
    """(case, url path, headers, body): strings that are no UTF-8 wherever this route takes them."""
    key = {"X-API-Key": API_KEY}
    as_json = key | {"Content-Type": "application/json"}
    yield "path", path.replace("{}", "%FF%FE"), key, b""
    yield "query", path.replace("{}", "x") + "?limit=%FF&offset=%ED%A0%80", key, b""
    if method != "POST":
        return
    filled = path.replace("{}", "x")
    yield "body bytes", filled, as_json, b'{"session_id": "\xff\xfe", "model_id": "\xff\xfe"}'
    surrogates = {name: LONE_SURROGATE for name in TINKER_STRINGS} | {"seq_id": 1, "model_seq_id": 0}
    yield "lone surrogates", filled, as_json, json.dumps(surrogates).encode()
    yield "a lone surrogate as a key", filled, as_json, json.dumps({LONE_SURROGATE: 1}).encode()
    for field_path in string_fields(tinker_wire_pb2.ForwardBackwardRequest.DESCRIPTOR):
        name = ".".join(f.name for f in field_path)
        yield f"protobuf {name}", filled, key | {"Content-Type": PROTOBUF}, bad_string(field_path)


async def tinker_answers(front: Front) -> list[str]:
    """What each route answered that it should not have."""
    wrong = []
    async with aiohttp.ClientSession() as http:
        async def status(method: str, path: str, headers: dict[str, str], body: bytes) -> tuple[int, str]:
            url = URL(front.url + path, encoded=True)  # the bytes as written: %FF stays %FF
            async with http.request(method, url, headers=headers, data=body) as response:
                return response.status, await response.text()

        for method, path in tinker_routes(front.app):
            for case, key in [("no key", {}), ("wrong key", {"X-API-Key": "tml-nope"}),
                              ("a key that is no ASCII", {"X-API-Key": "tml-schl\u00fcssel"})]:
                code, text = await status(method, path.replace("{}", "x"), key, b"{}")
                if code != 401:
                    wrong.append(f"{method} {path} {case}: {code} {text[:200]!r}")
            for case, url_path, headers, body in bad_requests(method, path):
                code, text = await status(method, url_path, headers, body)
                if code >= 500:
                    wrong.append(f"{method} {path} {case}: {code} {text[:200]!r}")
    return wrong


async def test_every_tinker_route_refuses_bad_keys_and_strings_that_are_no_utf8_with_a_4xx(
        tinker_front: Front) -> None:
    assert len(tinker_routes(tinker_front.app)) >= 20
    wrong = await tinker_answers(tinker_front)
    assert not wrong, "\n".join(wrong)
