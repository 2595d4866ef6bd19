"""The Tinker HTTP API (the routes the official `tinker` SDK 0.38 calls), served by a stateless
front: training requests go on TINKER in each client's seq_id order and the learner applies
them; retrieve_future answers from TINKER_RESULTS. What it keeps in Redis: the models (their
create request) and the request ids it handed out. Auth: the `X-API-Key` header must be the
cluster's key (any key when none is set; the SDK itself wants keys that start with "tml-")."""

from __future__ import annotations

import asyncio
import datetime
import hmac
import math
import re
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import nats.errors
import nats.js.errors
from aiohttp import web
from google.protobuf.message import DecodeError
from redis import asyncio as aioredis

from policyloop.bus import Bus, tinker_request_subject, tinker_result_subject, tinker_sample_subject
from policyloop.contracts.undecodable import decode_problem
from policyloop.contracts.v1 import tinker_pb2, tinker_wire_pb2
from policyloop.state.store import SCAN_BATCH
from policyloop.telemetry.logging import get_logger
from policyloop.tinker.sampling import SampleRequestError, parse_sample_request

log = get_logger(__name__)

API = "/api/v1"
PROTOBUF = "application/x-protobuf"
RESULTS_STREAM = "TINKER_RESULTS"
SAMPLE = "sample"  # a sample request's record (the others record their op)
SESSION_ID = re.compile(r"s[0-9a-f]{16}")  # what create_session hands out


def _iso(unix_ms: int) -> str:
    return datetime.datetime.fromtimestamp(unix_ms / 1000, datetime.UTC).isoformat()


def _error(status: int, message: str) -> web.Response:
    # A JSON body: the SDK raises at once with it (an empty 400 reads as a connection error, and
    # 5xx, 408, 409 and 429 are retried for minutes).
    return web.json_response({"detail": message}, status=status)


def _not_utf8(body: dict[str, Any]) -> str | None:
    """Where a string of a parsed JSON body is no UTF-8 (JSON's \\ud800 escapes decode to lone
    surrogates, which Redis and protobuf refuse to encode further on), or None."""
    pending: deque[tuple[str, Any]] = deque([("", body)])
    while pending:  # breadth first, without recursion: JSON may nest deeper than Python recurses
        path, value = pending.popleft()
        if isinstance(value, str) and not _encodes(value):
            return path
        if isinstance(value, dict):
            if not all(_encodes(key) for key in value):
                return f"{path or 'body'} (a key)"
            pending.extend((f"{path}.{key}" if path else key, item) for key, item in value.items())
        elif isinstance(value, list):
            pending.extend((f"{path}[{i}]", item) for i, item in enumerate(value))
    return None


def _encodes(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


class BadRequest(Exception):
    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class ModelOrder:
    """Puts one model's requests on TINKER in seq_id order (the SDK may send them concurrently)."""

    next_seq: int = 1
    moved: asyncio.Condition = field(default_factory=asyncio.Condition)


class TinkerApi:
    def __init__(self, bus: Bus, redis: aioredis.Redis, *, namespace: str, base_model: str, api_key: str = "",
                 tokenizer_id: str = "", poll_s: float = 25.0, order_wait_s: float = 30.0,
                 samplers_alive: Callable[[], Awaitable[bool]] | None = None) -> None:
        """`tokenizer_id`: what get_info names as the tokenizer (the SDK's get_tokenizer() loads
        it with AutoTokenizer.from_pretrained: a hub id or a directory the client can read).
        `samplers_alive`: whether a rollout replica takes sample requests now (their heartbeats);
        while none does, a waiting sample's try_again says so. None: not known here."""
        self.bus, self.redis, self.ns = bus, redis, namespace
        self.base_model, self.api_key, self.samplers_alive = base_model, api_key, samplers_alive
        self.tokenizer_id = tokenizer_id or base_model
        self.poll_s, self.order_wait_s = poll_s, order_wait_s
        self.orders: dict[str, ModelOrder] = {}

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._auth], client_max_size=64 * 1024 * 1024)
        json_routes = {
            "client/config": self._client_config, "create_session": self._create_session,
            "session_heartbeat": self._heartbeat, "telemetry": self._telemetry, "create_model": self._create_model,
            "get_info": self._get_info, "forward_backward": self._forward_backward, "optim_step": self._optim_step,
            "retrieve_future": self._retrieve_future, "save_weights_for_sampler": self._save_for_sampler,
            "create_sampling_session": self._create_sampling_session, "asample": self._asample,
            "save_weights": self._save_weights, "load_weights": self._load_weights,
        }
        for name, handler in json_routes.items():
            app.router.add_post(f"{API}/{name}", handler)
        app.router.add_post(f"{API}/sessions/{{session_id}}/finish", self._finish)
        app.router.add_get(f"{API}/get_server_capabilities", self._capabilities)
        app.router.add_get(f"{API}/samplers/{{sampler_id}}", self._get_sampler)
        app.router.add_get(f"{API}/training_runs", self._training_runs)
        app.router.add_get(f"{API}/training_runs/{{run_id}}", self._training_run)
        app.router.add_get(f"{API}/training_runs/{{run_id}}/checkpoints", self._run_checkpoints)
        app.router.add_get(f"{API}/checkpoints", self._all_checkpoints)
        app.router.add_post(f"{API}/weights_info", self._weights_info)
        app.router.add_get(f"{API}/healthz", self._healthz)
        app.router.add_route("*", f"{API}/{{route:.*}}", self._not_served)
        return app

    async def _not_served(self, request: web.Request) -> web.Response:
        return _error(404, f"{request.method} {request.path}: not served by this cluster's Tinker API (docs/tinker.md "
                           f"lists what is)")

    # -- plumbing -------------------------------------------------------------------------------

    @web.middleware
    async def _auth(self, request: web.Request, handler: Any) -> web.StreamResponse:
        # As bytes: compare_digest refuses str that is not ASCII, and a key may be anything.
        supplied = request.headers.get("X-API-Key", "").encode("utf-8", "surrogateescape")
        if self.api_key and not hmac.compare_digest(supplied, self.api_key.encode()):
            return _error(401, "X-API-Key is not this cluster's API key")
        try:
            return await handler(request)
        except BadRequest as exc:
            return _error(exc.status, str(exc))

    async def _json(self, request: web.Request) -> dict[str, Any]:
        try:
            body = await request.json()
        except (ValueError, LookupError, RecursionError) as exc:  # not JSON or UTF-8, unknown charset, too deep
            raise BadRequest(f"body: not JSON ({type(exc).__name__}: {exc})") from None
        if not isinstance(body, dict):
            raise BadRequest("body: a JSON object expected")
        where = _not_utf8(body)
        if where:
            raise BadRequest(f"{where}: not valid UTF-8 (a lone surrogate such as \\ud800); strings must be UTF-8")
        return body

    @staticmethod
    def _field(body: dict[str, Any], name: str, kind: type | tuple[type, ...], default: Any = ...) -> Any:
        value = body.get(name, default)
        if value is ...:
            raise BadRequest(f"{name}: required")
        if not isinstance(value, kind) or (isinstance(value, bool) and kind in (int, float, (int, float))):
            raise BadRequest(f"{name}: expected {getattr(kind, '__name__', kind)}, got {value!r}")
        if isinstance(value, int) and not isinstance(value, bool) and not 0 <= value < 2**31:
            raise BadRequest(f"{name}: {value} is outside [0, 2**31)")
        if isinstance(value, float) and not math.isfinite(value):
            raise BadRequest(f"{name}: not finite ({value})")
        return value

    def _seq_id(self, body: dict[str, Any]) -> int:
        """A training request's seq_id: from 1 (0 is the model's creation)."""
        seq_id = self._field(body, "seq_id", int)
        if seq_id < 1:
            raise BadRequest(f"seq_id: from 1, got {seq_id}")
        return seq_id

    @staticmethod
    def _query_int(request: web.Request, name: str, default: int) -> int:
        try:
            value = int(request.query.get(name, default))
        except ValueError:
            raise BadRequest(f"{name}: an integer, got {request.query.get(name)!r}") from None
        if not 0 <= value < 2**31:
            raise BadRequest(f"{name}: {value} is outside [0, 2**31)")
        return value

    def _session(self, body: dict[str, Any]) -> str:
        """A session id this API handed out (model and sampling ids are built on it)."""
        session = self._field(body, "session_id", str)
        if not SESSION_ID.fullmatch(session):
            raise BadRequest(f"session_id: {session!r} is not a session this API opened (create_session)")
        return session

    def _key(self, *parts: str) -> str:
        return ":".join((self.ns, "tinker", *parts))

    # -- session --------------------------------------------------------------------------------

    async def _client_config(self, _: web.Request) -> web.Response:
        # Custom losses run in the client (forward_backward_custom); no JWT exchange, no zstd bodies.
        # Chunks of a forward_backward one after another (they go on TINKER in seq_id order), each
        # small enough to be one bus message.
        return web.json_response({"custom_loss_server_side": False, "proto_compress_fwdbwd": False,
                                  "pjwt_auth_enabled": False, "sample_use_retrieve_futures": False,
                                  "parallel_fwdbwd_chunks": False,
                                  "fwdbwd_max_chunk_bytes_count": self._message_budget()})

    def _message_budget(self) -> int:
        """Bytes of a request or result that fit one bus message, with room for its envelope."""
        return int(self.bus.nc.max_payload * 3 // 4)

    async def _create_session(self, _: web.Request) -> web.Response:
        return web.json_response({"type": "create_session", "session_id": f"s{uuid.uuid4().hex[:16]}"})

    async def _heartbeat(self, _: web.Request) -> web.Response:
        return web.json_response({"type": "session_heartbeat"})

    async def _telemetry(self, _: web.Request) -> web.Response:
        return web.json_response({"status": "accepted"})

    async def _finish(self, _: web.Request) -> web.Response:
        return web.json_response({})

    async def _healthz(self, _: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _capabilities(self, _: web.Request) -> web.Response:
        return web.json_response({"supported_models": [
            {"model_name": self.base_model, "trainable": True, "sampleable": True}]})

    # -- training -------------------------------------------------------------------------------

    async def _create_model(self, request: web.Request) -> web.Response:
        body = await self._json(request)
        session = self._session(body)
        model_seq = self._field(body, "model_seq_id", int)
        base_model = self._field(body, "base_model", str)
        lora = self._field(body, "lora_config", dict, {})
        if base_model != self.base_model:
            raise BadRequest(f"base_model: this cluster trains {self.base_model!r}, not {base_model!r}")
        optimizer = self._field(body, "optimizer_config", dict, {"type": "adamw"})
        if optimizer.get("type", "adamw") != "adamw":
            raise BadRequest(f"optimizer_config.type: only 'adamw' is supported, not {optimizer.get('type')!r}")
        create = tinker_pb2.TinkerCreateModel(
            base_model=base_model, rank=self._field(lora, "rank", int, 32),
            train_mlp=self._field(lora, "train_mlp", bool, True),
            train_attn=self._field(lora, "train_attn", bool, True),
            train_unembed=self._field(lora, "train_unembed", bool, True))
        seed = lora.get("seed")
        if seed is not None:
            if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**63:
                raise BadRequest(f"lora_config.seed: an integer in [0, 2**63), got {seed!r}")
            create.seed = seed
        if not 1 <= create.rank <= 1024:
            raise BadRequest(f"lora_config.rank: {create.rank} is outside [1, 1024]")
        model_id = f"{session}:train:{model_seq}"
        if not await self.redis.set(self._key("model", model_id), create.SerializeToString(), nx=True):
            existing = tinker_pb2.TinkerCreateModel.FromString(await self.redis.get(self._key("model", model_id)))
            if existing != create:
                raise BadRequest(f"model_seq_id: model {model_id!r} exists with another configuration")
        request_id = f"{model_id}#0"
        await self._submit(tinker_pb2.TinkerRequest(request_id=request_id, model_id=model_id, seq_id=0,
                                                    create_model=create), ordered=False)
        return web.json_response({"request_id": request_id, "model_id": model_id})

    async def _model(self, model_id: Any) -> tinker_pb2.TinkerCreateModel:
        if not isinstance(model_id, str) or not model_id:
            raise BadRequest("model_id: required")
        raw = await self.redis.get(self._key("model", model_id))
        if raw is None:
            raise BadRequest(f"model_id: no model {model_id!r}", 404)
        return tinker_pb2.TinkerCreateModel.FromString(raw)

    async def _get_info(self, request: web.Request) -> web.Response:
        body = await self._json(request)
        create = await self._model(body.get("model_id"))
        return web.json_response({
            "type": "get_info", "model_id": body["model_id"], "is_lora": True, "lora_rank": create.rank,
            "model_name": self.base_model, "optimizer_config": {"type": "adamw"},
            "model_data": {"model_name": self.base_model, "tokenizer_id": self.tokenizer_id}})

    async def _forward_backward(self, request: web.Request) -> web.Response:
        if PROTOBUF not in request.headers.get("Content-Type", ""):
            raise BadRequest(f"Content-Type: forward_backward takes {PROTOBUF}", 415)
        if request.headers.get("Content-Encoding", "identity") not in ("identity", ""):
            raise BadRequest("Content-Encoding: compressed bodies are not taken (client/config says so)", 415)
        raw = await request.read()
        if len(raw) > self._message_budget():
            raise BadRequest(f"body: {len(raw)} bytes, more than one request may carry here "
                             f"({self._message_budget()}; client/config says so): send smaller chunks", 413)
        try:
            parsed = tinker_wire_pb2.ForwardBackwardRequest.FromString(raw)
        except DecodeError:
            problem = decode_problem(tinker_wire_pb2.ForwardBackwardRequest, raw)
            raise BadRequest(f"body: not a ForwardBackwardRequest: {problem}") from None
        await self._model(parsed.model_id)
        if parsed.seq_id < 1:
            raise BadRequest(f"seq_id: from 1, got {parsed.seq_id}")
        request_id = f"{parsed.model_id}#{parsed.seq_id}"
        await self._submit(tinker_pb2.TinkerRequest(request_id=request_id, model_id=parsed.model_id,
                                                    seq_id=parsed.seq_id, forward_backward=parsed))
        return web.json_response({"request_id": request_id, "model_id": parsed.model_id})

    async def _optim_step(self, request: web.Request) -> web.Response:
        body = await self._json(request)
        model_id = body.get("model_id")
        await self._model(model_id)
        seq_id = self._seq_id(body)
        if "optimizer_params" in body:
            raise BadRequest("optimizer_params: only Adam (adam_params) is supported")
        adam = self._field(body, "adam_params", dict)
        number = (int, float)
        params = tinker_pb2.TinkerAdamParams(
            learning_rate=self._field(adam, "learning_rate", number, 1e-4),
            beta1=self._field(adam, "beta1", number, 0.9),
            beta2=self._field(adam, "beta2", number, 0.95), eps=self._field(adam, "eps", number, 1e-12),
            weight_decay=self._field(adam, "weight_decay", number, 0.0),
            grad_clip_norm=self._field(adam, "grad_clip_norm", number, 0.0))
        request_id = f"{model_id}#{seq_id}"
        await self._submit(tinker_pb2.TinkerRequest(request_id=request_id, model_id=model_id, seq_id=seq_id,
                                                    optim_step=params))
        return web.json_response({"request_id": request_id, "model_id": model_id})

    async def _save_for_sampler(self, request: web.Request) -> web.Response:
        body = await self._json(request)
        model_id = body.get("model_id")
        await self._model(model_id)
        seq_id = self._seq_id(body)
        name = self._field(body, "path", str, "")
        if "/" in name:
            raise BadRequest(f"path: a name without '/', got {name!r}")
        request_id = f"{model_id}#{seq_id}"
        if not name:  # save_weights_and_get_sampling_client: the answer is a sampling session
            session_seq = self._field(body, "sampling_session_seq_id", int)
            await self.redis.set(self._key("unnamed", request_id), self._session_id(model_id, session_seq),
                                 ex=7 * 24 * 3600)
        await self._submit(tinker_pb2.TinkerRequest(request_id=request_id, model_id=model_id, seq_id=seq_id,
                                                    save_weights=tinker_pb2.TinkerSaveWeights(name=name,
                                                                                              for_sampler=True)))
        return web.json_response({"request_id": request_id, "model_id": model_id})

    async def _save_weights(self, request: web.Request) -> web.Response:
        body = await self._json(request)
        model_id = body.get("model_id")
        await self._model(model_id)
        seq_id = self._seq_id(body)
        save = tinker_pb2.TinkerSaveWeights(name=self._field(body, "path", str),
                                            overwrite=self._field(body, "overwrite", bool, False))
        request_id = f"{model_id}#{seq_id}"
        await self._submit(tinker_pb2.TinkerRequest(request_id=request_id, model_id=model_id, seq_id=seq_id,
                                                    save_weights=save))
        return web.json_response({"request_id": request_id, "model_id": model_id})

    async def _load_weights(self, request: web.Request) -> web.Response:
        """On an existing model (model_id, seq_id), or creating one from the state (session_id,
        model_seq_id: the model id is then <session>:train:<seq>, as the SDK assumes)."""
        body = await self._json(request)
        path = self._field(body, "path", str)
        load = tinker_pb2.TinkerLoadWeights(path=path, optimizer=self._field(body, "optimizer", bool, False))
        source = path.removeprefix("tinker://").split("/")[0] if path.startswith("tinker://") else ""
        if "model_id" in body:
            model_id = body["model_id"]
            await self._model(model_id)
            seq_id, ordered = self._seq_id(body), True
        else:
            session = self._session(body)
            model_id, seq_id, ordered = f"{session}:train:{self._field(body, 'model_seq_id', int)}", 0, False
            raw = await self.redis.get(self._key("model", source))
            if raw is None:
                raise BadRequest(f"path: no model {source!r} saved {path!r}", 404)
            await self.redis.set(self._key("model", model_id), raw)  # the same LoRA configuration
        request_id = f"{model_id}#{seq_id}"
        await self._submit(tinker_pb2.TinkerRequest(request_id=request_id, model_id=model_id, seq_id=seq_id,
                                                    load_weights=load), ordered=ordered)
        return web.json_response({"request_id": request_id, "model_id": model_id})

    @staticmethod
    def _session_id(model_id: str, sampling_seq: int) -> str:
        return f"{model_id.split(':train:')[0]}:sample:{sampling_seq}"

    async def _create_sampling_session(self, request: web.Request) -> web.Response:
        body = await self._json(request)
        session = self._session(body)
        seq = self._field(body, "sampling_session_seq_id", int)
        model_path = self._field(body, "model_path", str, "")
        sampling_id = f"{session}:sample:{seq}"
        if model_path:
            raw = await self.redis.get(self._key("sampler_path", model_path))
            if raw is None:
                raise BadRequest(f"model_path: no sampler weights saved as {model_path!r}", 404)
            weights = tinker_pb2.TinkerSamplingSession.FromString(raw)
        else:
            base_model = self._field(body, "base_model", str)
            if base_model != self.base_model:
                raise BadRequest(f"base_model: this cluster serves {self.base_model!r}, not {base_model!r}")
            weights = tinker_pb2.TinkerSamplingSession()
        weights.sampling_session_id, weights.model_path = sampling_id, model_path
        await self.redis.set(self._key("sampling", sampling_id), weights.SerializeToString())
        return web.json_response({"type": "create_sampling_session", "sampling_session_id": sampling_id})

    async def _sampling_session(self, sampling_id: Any) -> tinker_pb2.TinkerSamplingSession:
        if not isinstance(sampling_id, str) or not sampling_id:
            raise BadRequest("sampling_session_id: required")
        raw = await self.redis.get(self._key("sampling", sampling_id))
        if raw is None:
            raise BadRequest(f"sampling_session_id: no sampling session {sampling_id!r}", 404)
        return tinker_pb2.TinkerSamplingSession.FromString(raw)

    async def _get_sampler(self, request: web.Request) -> web.Response:
        session = await self._sampling_session(request.match_info["sampler_id"])
        return web.json_response({"sampler_id": session.sampling_session_id, "base_model": self.base_model,
                                  "model_path": session.model_path or None})

    async def _asample(self, request: web.Request) -> web.Response:
        body = await self._json(request)
        session = await self._sampling_session(body.get("sampling_session_id"))
        try:
            sample = parse_sample_request(body)
        except SampleRequestError as exc:
            raise BadRequest(str(exc)) from None
        # A result is one bus message: token ids and logprobs, 8 bytes per token (prompt logprobs 4).
        if sample.num_samples * sample.max_tokens * 8 + len(sample.prompt) * 4 > self._message_budget():
            raise BadRequest(f"num_samples: {sample.num_samples} samples of up to {sample.max_tokens} tokens do not "
                             f"fit one result ({self._message_budget()} bytes): ask for fewer in one call")
        sample.request_id = f"{session.sampling_session_id}#{self._field(body, 'seq_id', int)}#{uuid.uuid4().hex[:8]}"
        sample.session.CopyFrom(session)
        await self.redis.set(self._key("request", sample.request_id), SAMPLE, ex=24 * 3600)
        # A rollout replica with tinker_sampling takes it; the Nats-Msg-Id is the request id.
        await self.bus.publish(tinker_sample_subject(sample.request_id), sample, sample.request_id)
        return web.json_response({"request_id": sample.request_id, "sample_sequence_ids": [
            f"{sample.request_id}:{i}" for i in range(sample.num_samples)]})

    async def _submit(self, request: tinker_pb2.TinkerRequest, ordered: bool = True) -> None:
        """Records the request id, then puts the request on TINKER after the model's earlier
        seq_ids (waiting up to order_wait_s for a missing one: the SDK spends a seq_id on a
        request it never sends when it fails locally). Where each model's order stands is kept
        in Redis, so a restarted front goes on from it; one front orders a model's requests (a
        client's session sticks to one replica). The Nats-Msg-Id is the request id, so a retried
        HTTP call is stored once."""
        await self.redis.set(self._key("request", request.request_id), request.WhichOneof("op"), ex=7 * 24 * 3600)
        await self.redis.set(self._key("last_request", request.model_id), int(time.time() * 1000))
        if not ordered:
            await self.bus.publish(tinker_request_subject(request.model_id), request, request.request_id)
            return
        order = self.orders.get(request.model_id)
        if order is None:  # a model this front has not seen since it started: where its order stands
            stored = await self.redis.get(self._key("next_seq", request.model_id))
            order = self.orders.setdefault(request.model_id, ModelOrder(int(stored) if stored else 1))
        async with order.moved:
            if request.seq_id > order.next_seq:
                try:
                    await asyncio.wait_for(order.moved.wait_for(lambda: order.next_seq >= request.seq_id),
                                           self.order_wait_s)
                except TimeoutError:
                    log.warning("tinker_seq_gap", model=request.model_id, waited_for=order.next_seq,
                                seq=request.seq_id)
            await self.bus.publish(tinker_request_subject(request.model_id), request, request.request_id)
            order.next_seq = max(order.next_seq, request.seq_id + 1)
            await self.redis.set(self._key("next_seq", request.model_id), order.next_seq)
            order.moved.notify_all()

    # -- futures --------------------------------------------------------------------------------

    async def _retrieve_future(self, request: web.Request) -> web.Response:
        body = await self._json(request)
        request_id = self._field(body, "request_id", str)
        kind = await self.redis.get(self._key("request", request_id))
        if kind is None:
            raise BadRequest(f"request_id: no request {request_id!r}", 404)
        subject = tinker_result_subject(request_id)
        arrived: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()

        async def on_result(msg: Any) -> None:
            if not arrived.done():
                arrived.set_result(msg.data)

        sub = await self.bus.nc.subscribe(subject, cb=on_result)  # before the look: nothing slips between
        try:
            result = await self._stored_result(subject)
            if result is None:
                try:
                    result = tinker_pb2.TinkerResult.FromString(await asyncio.wait_for(arrived, self.poll_s))
                except TimeoutError:
                    return await self._try_again(request_id, kind.decode())
        finally:
            await sub.unsubscribe()
        if result.WhichOneof("outcome") == "saved" and result.saved.path:
            await self._record_checkpoint(result.model_id, result.saved.path)
        if result.WhichOneof("outcome") == "saved" and result.saved.weights_model:
            return await self._sampler_saved(request_id, result.saved)
        return self._answer(result)

    async def _record_checkpoint(self, model_id: str, path: str) -> None:
        checkpoint_id = path.removeprefix(f"tinker://{model_id}/")
        key = self._key("checkpoints", model_id)
        if not await self.redis.hexists(key, checkpoint_id):
            record = tinker_pb2.TinkerCheckpoint(checkpoint_id=checkpoint_id, path=path,
                                                 saved_unix_ms=int(time.time() * 1000))
            await self.redis.hset(key, checkpoint_id, record.SerializeToString())

    # -- listings (RestClient) ------------------------------------------------------------------

    async def _checkpoints(self, model_id: str) -> list[dict[str, Any]]:
        stored = await self.redis.hgetall(self._key("checkpoints", model_id))
        records = sorted((tinker_pb2.TinkerCheckpoint.FromString(raw) for raw in stored.values()),
                         key=lambda c: c.saved_unix_ms)
        return [{"checkpoint_id": c.checkpoint_id, "tinker_path": c.path,
                 "checkpoint_type": "training" if c.checkpoint_id.startswith("weights/") else "sampler",
                 "time": _iso(c.saved_unix_ms), "public": False} for c in records]

    async def _run(self, model_id: str) -> dict[str, Any]:
        create = await self._model(model_id)
        checkpoints = await self._checkpoints(model_id)
        last = await self.redis.get(self._key("last_request", model_id))

        def newest(kind: str) -> dict[str, Any] | None:
            return next((c for c in reversed(checkpoints) if c["checkpoint_type"] == kind), None)

        return {"training_run_id": model_id, "base_model": create.base_model, "model_owner": self.ns,
                "is_lora": True, "lora_rank": create.rank, "corrupted": False,
                "last_request_time": _iso(int(last) if last else 0), "last_checkpoint": newest("training"),
                "last_sampler_checkpoint": newest("sampler")}

    async def _model_ids(self) -> list[str]:
        prefix = self._key("model", "")
        keys = self.redis.scan_iter(match=f"{prefix}*", count=SCAN_BATCH)
        return sorted([key.decode()[len(prefix):] async for key in keys])

    async def _training_runs(self, request: web.Request) -> web.Response:
        limit, offset = self._query_int(request, "limit", 20), self._query_int(request, "offset", 0)
        ids = await self._model_ids()
        runs = [await self._run(i) for i in ids[offset:offset + limit]]
        return web.json_response({"training_runs": runs,
                                  "cursor": {"offset": offset, "limit": limit, "total_count": len(ids)}})

    async def _training_run(self, request: web.Request) -> web.Response:
        return web.json_response(await self._run(request.match_info["run_id"]))

    async def _run_checkpoints(self, request: web.Request) -> web.Response:
        model_id = request.match_info["run_id"]
        await self._model(model_id)
        return web.json_response({"checkpoints": await self._checkpoints(model_id)})

    async def _all_checkpoints(self, request: web.Request) -> web.Response:
        limit, offset = self._query_int(request, "limit", 100), self._query_int(request, "offset", 0)
        everything = [c for model_id in await self._model_ids() for c in await self._checkpoints(model_id)]
        return web.json_response({"checkpoints": everything[offset:offset + limit],
                                  "cursor": {"offset": offset, "limit": limit, "total_count": len(everything)}})

    async def _weights_info(self, request: web.Request) -> web.Response:
        body = await self._json(request)
        path = self._field(body, "tinker_path", str)
        model_id = path.removeprefix("tinker://").split("/")[0] if path.startswith("tinker://") else ""
        create = await self._model(model_id)
        checkpoint_id = path.removeprefix(f"tinker://{model_id}/")
        if not await self.redis.hexists(self._key("checkpoints", model_id), checkpoint_id):
            raise BadRequest(f"tinker_path: no checkpoint {path!r}", 404)
        return web.json_response({"base_model": create.base_model, "is_lora": True, "lora_rank": create.rank,
                                  "optimizer_config": {"type": "adamw"}, "train_mlp": create.train_mlp,
                                  "train_attn": create.train_attn, "train_unembed": create.train_unembed})

    async def _sampler_saved(self, request_id: str, saved: tinker_pb2.TinkerSaved) -> web.Response:
        """A published sampler version: its path (or, unnamed, a sampling session) now names it."""
        weights = tinker_pb2.TinkerSamplingSession(weights_model=saved.weights_model, version=saved.version,
                                                   fetch_endpoint=saved.fetch_endpoint, lora=saved.lora)
        if saved.path:
            await self.redis.set(self._key("sampler_path", saved.path), weights.SerializeToString())
            return web.json_response({"type": "save_weights_for_sampler", "path": saved.path})
        sampling_id = await self.redis.get(self._key("unnamed", request_id))
        if sampling_id is None:
            return web.json_response({"error": "the sampling session of this save is unknown", "category": "server"})
        weights.sampling_session_id = sampling_id.decode()
        await self.redis.set(self._key("sampling", weights.sampling_session_id), weights.SerializeToString())
        return web.json_response({"type": "save_weights_for_sampler",
                                  "sampling_session_id": weights.sampling_session_id})

    async def _try_again(self, request_id: str, kind: str) -> web.Response:
        """No result yet. A sample request waits on TINKER_SAMPLES for a replica: while no replica
        takes them, the SDK is told why (it logs the reason) and keeps waiting."""
        answer = {"type": "try_again", "request_id": request_id, "queue_state": "active"}
        if kind == SAMPLE and self.samplers_alive is not None and not await self.samplers_alive():
            answer.update(queue_state="paused_capacity", queue_state_reason=(
                "no rollout replica samples for the Tinker API now (one started with tinker_sampling=true "
                "takes the request when it is up)"))
        return web.json_response(answer)

    async def _stored_result(self, subject: str) -> tinker_pb2.TinkerResult | None:
        try:
            msg = await self.bus.js.get_last_msg(RESULTS_STREAM, subject)
        except nats.js.errors.NotFoundError:
            return None
        return tinker_pb2.TinkerResult.FromString(msg.data)

    @staticmethod
    def _answer(result: tinker_pb2.TinkerResult) -> web.Response:
        outcome = result.WhichOneof("outcome")
        if outcome == "error":
            return web.json_response({"error": result.error.message, "category": result.error.category or "server"})
        if outcome == "forward_backward":
            return web.Response(body=result.forward_backward.SerializeToString(), content_type=PROTOBUF)
        if outcome == "sample":
            return web.Response(body=result.sample.SerializeToString(), content_type=PROTOBUF)
        if outcome == "created":
            return web.json_response({"type": "create_model", "model_id": result.created.model_id})
        if outcome == "optim_step":
            return web.json_response({"type": "optim_step", "metrics": dict(result.optim_step.metrics)})
        if outcome == "saved":
            return web.json_response({"path": result.saved.path})
        if outcome == "loaded":
            return web.json_response({"type": "load_weights", "path": result.loaded.path})
        return web.json_response({"error": f"result of unknown kind {outcome!r}", "category": "server"})


