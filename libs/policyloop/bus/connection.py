"""A connection to the bus: bounded connect, idempotent topology, acknowledged typed publish,
backlog figures."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import nats
import nats.errors
import nats.js.errors
from google.protobuf.message import Message
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.js import api
from nats.js.api import RawStreamMsg

from policyloop.bus.topology import ConsumerSpec, StreamSpec, Topology, build_topology
from policyloop.telemetry import tracing
from policyloop.telemetry.logging import get_logger
from policyloop.telemetry.metrics import BUS_BACKLOG, BUS_PUBLISHED

log = get_logger(__name__)

T = TypeVar("T")

TYPE_HEADER = "Pl-Type"          # the protobuf full name of the payload
MSG_ID_HEADER = "Nats-Msg-Id"
ERR_STREAM_FULL = 10077          # JetStream: maximum messages/bytes exceeded with discard new


class BusError(Exception):
    """Base of the bus layer's errors."""


class BusUnavailable(BusError):
    """No NATS server answered within the connect deadline."""


class StreamFull(BusError):
    """The stream is bounded with discard-new and full: slow down and retry later."""

    def __init__(self, subject: str, stream: str) -> None:
        super().__init__(f"stream {stream} is full; publish to {subject} refused (backpressure)")
        self.subject = subject
        self.stream = stream


class PublishFailed(BusError):
    """No publish acknowledgement after every attempt."""


def nats_servers(url: str) -> list[str]:
    """The servers of a NATS URL setting: one URL, or several of one cluster comma-separated
    ("nats://a:4222,nats://b:4222")."""
    servers = [part.strip() for part in url.split(",") if part.strip()]
    if not servers:
        raise ValueError(f"no NATS server in {url!r}")
    return servers


def is_transient(exc: BaseException) -> bool:
    """Whether `exc` is what a server restart or a JetStream leader election answers, so the
    same request can succeed a moment later: timeouts, no responders, a reconnecting client,
    and JetStream API errors of 5xx (503 "JetStream system temporarily unavailable" while the
    meta or stream leader is being elected; 500 from a leader that just stepped down)."""
    if isinstance(exc, nats.js.errors.APIError):
        return exc.err_code != ERR_STREAM_FULL and (exc.code is None or exc.code >= 500)
    return isinstance(exc, (
        TimeoutError,
        nats.errors.TimeoutError,
        nats.errors.NoRespondersError,
        nats.errors.ConnectionReconnectingError,
        nats.errors.OutboundBufferLimitError,
        nats.js.errors.NoStreamResponseError,
    ))


async def retry_transient(operation: Callable[[], Awaitable[T]], window_s: float, what: str) -> T:
    """Runs `operation`, again after transient failures (`is_transient`) for up to `window_s`."""
    deadline = time.monotonic() + window_s
    delay = 0.1
    while True:
        try:
            return await operation()
        except Exception as exc:
            if not is_transient(exc) or time.monotonic() + delay > deadline:
                raise
            log.warning("bus_retry", what=what, error=repr(exc))
        await asyncio.sleep(delay)
        delay = min(delay * 2, 2.0)


@dataclass(frozen=True)
class Backlog:
    stream: str
    consumer: str
    pending: int       # in the stream, not yet delivered to the consumer
    ack_pending: int   # delivered, not yet acknowledged
    redelivered: int
    waiting: int       # pull requests waiting for messages (idle replicas)


class Bus:
    """One NATS connection with JetStream, bound to the project's topology."""

    def __init__(self, nc: NatsClient, topology: Topology) -> None:
        self.nc = nc
        self.js = nc.jetstream()
        self.topology = topology
        # Increments on every reconnect so that pull workers know to re-bind.
        self.reconnects = 0
        self.closing = False

    @classmethod
    async def connect(
        cls,
        url: str,
        *,
        name: str,
        topology: Topology | None = None,
        connect_timeout_s: float = 10.0,
    ) -> Bus:
        """Connects within `connect_timeout_s` (retrying while the server starts), then keeps
        reconnecting forever: a server restart must not end a service. `url` may list several
        servers of one cluster, comma-separated: the client fails over between them."""
        servers = nats_servers(url)
        holder: dict[str, Bus] = {}

        async def on_reconnect() -> None:
            bus = holder.get("bus")
            if bus is not None:
                bus.reconnects += 1
            connected = bus.nc.connected_url if bus is not None else None
            log.info("nats_reconnected", url=connected.geturl() if connected else url)

        async def on_disconnect() -> None:
            if not holder.get("bus") or not holder["bus"].closing:
                log.warning("nats_disconnected", url=url)

        async def on_error(exc: Exception) -> None:
            log.warning("nats_error", error=repr(exc))

        deadline = time.monotonic() + connect_timeout_s
        last_error: Exception | None = None
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise BusUnavailable(f"no NATS server at {url} within {connect_timeout_s}s: {last_error!r}")
            try:
                nc = await asyncio.wait_for(
                    nats.connect(
                        servers=servers,
                        name=name,
                        connect_timeout=max(1, int(min(remaining, 2))),
                        allow_reconnect=True,
                        max_reconnect_attempts=-1,
                        reconnect_time_wait=0.5,
                        reconnected_cb=on_reconnect,
                        disconnected_cb=on_disconnect,
                        error_cb=on_error,
                    ),
                    timeout=remaining,
                )
                break
            except (TimeoutError, OSError, nats.errors.Error) as exc:
                last_error = exc
                await asyncio.sleep(min(0.25, max(0.0, deadline - time.monotonic())))
        bus = cls(nc, topology or build_topology())
        holder["bus"] = bus
        return bus

    async def close(self) -> None:
        self.closing = True
        if not self.nc.is_closed:
            try:
                await asyncio.wait_for(self.nc.drain(), timeout=5)
            except (TimeoutError, nats.errors.Error):
                await self.nc.close()

    # -- topology ---------------------------------------------------------------------------

    async def ensure_topology(self, retry_window_s: float = 60.0) -> None:
        """Creates every stream and consumer of the table, or updates them to match it.
        Safe to call from every service at start-up, concurrently. What fails only while the
        server restarts or a cluster elects a leader is retried for `retry_window_s`."""
        for stream in self.topology.streams.values():
            await retry_transient(lambda spec=stream: self.ensure_stream(spec), retry_window_s,
                                  f"ensure stream {stream.name}")
        for consumer in self.topology.consumers.values():
            await retry_transient(lambda spec=consumer: self.ensure_consumer(spec), retry_window_s,
                                  f"ensure consumer {consumer.durable}")

    async def ensure_stream(self, spec: StreamSpec) -> None:
        config = spec.config()
        try:
            await self.js.add_stream(config)
        except nats.js.errors.BadRequestError:
            # Exists with another configuration (a new capacity, another replica count: 2.9
            # scales a clustered stream up and down by update): bring it in line.
            await self.js.update_stream(config)

    async def ensure_consumer(self, spec: ConsumerSpec) -> None:
        # CONSUMER.CREATE with an existing durable name updates the editable fields on 2.9
        # (replica count included), so a config change in the table reaches existing consumers.
        await self.js.add_consumer(spec.stream, spec.config())

    # -- publish ----------------------------------------------------------------------------

    async def publish(
        self,
        subject: str,
        message: Message,
        msg_id: str,
        *,
        timeout_s: float = 5.0,
        attempts: int = 6,
        headers: dict[str, str] | None = None,
    ) -> api.PubAck:
        """Publishes and waits for JetStream's acknowledgement. Retries reuse `msg_id`, so a
        publish whose ack was lost is stored once (PubAck.duplicate tells). The message carries
        the current trace context (policyloop.telemetry.tracing)."""
        if not msg_id:
            raise ValueError("msg_id is required: it is how retries and redeliveries are deduplicated")
        payload = message.SerializeToString()
        all_headers = {MSG_ID_HEADER: msg_id, TYPE_HEADER: message.DESCRIPTOR.full_name}
        tracing.inject(all_headers)
        all_headers.update(headers or {})
        return await self.publish_bytes(subject, payload, all_headers, timeout_s=timeout_s, attempts=attempts)

    async def publish_bytes(
        self,
        subject: str,
        payload: bytes,
        headers: dict[str, str],
        *,
        timeout_s: float = 5.0,
        attempts: int = 6,
        retry_window_s: float = 30.0,
    ) -> api.PubAck:
        """Retries what a restarting server or a leader election answers (timeouts, no
        responders, JetStream 5xx such as 503 "JetStream system temporarily unavailable")
        until `attempts` were made and `retry_window_s` has passed: losing a stream's leader
        in a cluster leaves the stream without one for seconds."""
        if MSG_ID_HEADER not in headers:
            raise ValueError("headers must carry Nats-Msg-Id")
        delay = 0.1
        last_error: Exception | None = None
        deadline = time.monotonic() + retry_window_s
        attempt = 0
        while True:
            attempt += 1
            try:
                ack = await self.js.publish(subject, payload, timeout=timeout_s, headers=headers)
                BUS_PUBLISHED.labels(stream=ack.stream, duplicate=str(bool(ack.duplicate)).lower()).inc()
                return ack
            except nats.js.errors.APIError as exc:
                if exc.err_code == ERR_STREAM_FULL:
                    raise StreamFull(subject, self.topology.stream_for_subject(subject).name) from exc
                if not is_transient(exc):
                    raise
                last_error = exc
            except nats.errors.Error as exc:
                if not is_transient(exc):
                    raise
                last_error = exc
            if attempt >= attempts and time.monotonic() >= deadline:
                break
            log.warning("publish_retry", subject=subject, attempt=attempt, error=repr(last_error))
            await asyncio.sleep(delay)
            delay = min(delay * 2, 2.0)
        raise PublishFailed(f"publish to {subject} not acknowledged after {attempt} attempts: {last_error!r}")

    # -- reading back ------------------------------------------------------------------------

    async def read(self, stream: str, subject: str, start_seq: int = 1, *, timeout_s: float = 10.0,
                   retry_window_s: float = 60.0) -> AsyncIterator[tuple[int, Msg]]:
        """The messages of `stream` on `subject` (wildcards allowed) from stream sequence
        `start_seq` to the last stored now, in order, as (sequence, message). An ordered
        consumer: ephemeral, no acks, nothing left behind. Losing it (a server restart, the
        stream's leader dying in a cluster) starts a new one after the last message read."""
        next_seq = max(1, start_seq)
        deadline: float | None = None
        while True:
            try:
                config = api.ConsumerConfig(deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE,
                                            opt_start_seq=next_seq)
                sub = await self.js.subscribe(subject, stream=stream, ordered_consumer=True, config=config)
                try:
                    # Messages may already be on their way: what is to be read is what was
                    # delivered plus what is pending, in one snapshot.
                    info = await sub.consumer_info()
                    remaining = info.delivered.consumer_seq + (info.num_pending or 0)
                    for _ in range(remaining):
                        msg = await sub.next_msg(timeout=timeout_s)
                        seq = msg.metadata.sequence.stream
                        next_seq, deadline = seq + 1, None
                        yield seq, msg
                    return
                finally:
                    try:
                        await sub.unsubscribe()
                    except (TimeoutError, nats.errors.Error):
                        pass
            except Exception as exc:
                deadline = deadline or time.monotonic() + retry_window_s
                if not is_transient(exc) or time.monotonic() > deadline:
                    raise
                log.warning("read_retry", stream=stream, from_seq=next_seq, error=repr(exc))
                await asyncio.sleep(0.5)

    async def get_msg(self, stream: str, seq: int, *, retry_window_s: float = 60.0) -> RawStreamMsg:
        """One stored message by sequence, asked again while the stream has no leader."""
        return await retry_transient(lambda: self.js.get_msg(stream, seq), retry_window_s,
                                     f"get {stream} {seq}")

    async def stored(self, stream: str) -> AsyncIterator[tuple[int, RawStreamMsg]]:
        """Every message `stream` holds now, fetched one by one by sequence: for work queues,
        which take no second consumer (`read` is faster on the others)."""
        info = await self.js.stream_info(stream)
        if not info.state.messages:
            return
        for seq in range(info.state.first_seq, info.state.last_seq + 1):
            try:
                yield seq, await self.get_msg(stream, seq)
            except nats.js.errors.NotFoundError:  # acked (removed) or deleted meanwhile
                continue

    # -- backlog ----------------------------------------------------------------------------

    async def backlog(self, durable: str) -> Backlog:
        spec = self.topology.consumers[durable]
        info = await self.js.consumer_info(spec.stream, durable)
        figures = Backlog(
            stream=spec.stream,
            consumer=durable,
            pending=info.num_pending or 0,
            ack_pending=info.num_ack_pending or 0,
            redelivered=info.num_redelivered or 0,
            waiting=info.num_waiting or 0,
        )
        BUS_BACKLOG.labels(spec.stream, durable, "pending").set(figures.pending)
        BUS_BACKLOG.labels(spec.stream, durable, "ack_pending").set(figures.ack_pending)
        return figures

    async def all_backlogs(self) -> dict[str, Backlog]:
        return {name: await self.backlog(name) for name in self.topology.consumers}
