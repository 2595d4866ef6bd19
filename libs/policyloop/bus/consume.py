"""Pull consumption with explicit acks, heartbeats for long work, bounded redelivery with
backoff, dead letters, and a graceful stop that finishes or naks what it holds.

A handler receives a decoded `Delivery` and returns when the message's effect is durable
(typically: the next stream acknowledged its publish). The worker then acks. A handler that
raises `PermanentError` sends the message to the DLQ; any other exception naks it with a
growing delay until its last delivery, which dead-letters it.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

import nats.errors
import nats.js.errors
from google.protobuf.message import DecodeError, Message
from nats.aio.msg import Msg
from opentelemetry.trace import SpanKind

from policyloop.bus.connection import MSG_ID_HEADER, TYPE_HEADER, Bus, is_transient
from policyloop.bus.deadletter import dead_letter_delivered, watch_max_deliveries
from policyloop.bus.topology import ConsumerSpec
from policyloop.telemetry import tracing
from policyloop.telemetry.logging import get_logger
from policyloop.telemetry.metrics import BUS_CONSUMED, BUS_HANDLER_SECONDS

log = get_logger(__name__)

M = TypeVar("M", bound=Message)

DEFAULT_RETRY_DELAYS_S: tuple[float, ...] = (0.5, 2.0, 5.0, 15.0, 30.0)
ENSURE_TIMEOUT_S = 3.0  # creating/updating the stream and consumer on (re)bind
ENSURE_AGAIN_S = 2.0    # after binding to a consumer that could not be ensured
REMEMBERED_FAILURES = 10_000  # the newest nacked messages' last failures a worker keeps


class PermanentError(Exception):
    """The message can never be handled (invalid content): dead-letter it now."""


@dataclass
class Delivery(Generic[M]):
    message: M
    subject: str
    msg_id: str
    stream_seq: int
    delivery_count: int
    raw: Msg

    async def in_progress(self) -> None:
        """Resets the ack timer; the worker also does this on a timer while a handler runs."""
        await self.raw.in_progress()


Handler = Callable[[Delivery[M]], Awaitable[None]]
Validator = Callable[[M], None]  # raises ValueError naming the bad field


def decode_message(msg: Msg, message_type: type[M]) -> M:
    """Decodes a bus payload, refusing a payload declared as another type."""
    declared = (msg.headers or {}).get(TYPE_HEADER)
    expected = message_type.DESCRIPTOR.full_name
    if declared and declared != expected:
        raise PermanentError(f"payload type {declared}, expected {expected}")
    decoded = message_type()
    try:
        decoded.ParseFromString(msg.data)
    except DecodeError as exc:
        raise PermanentError(f"cannot decode {len(msg.data)} bytes as {expected}: {exc}") from exc
    return decoded


def retry_delay(delivery_count: int, delays: Sequence[float] = DEFAULT_RETRY_DELAYS_S) -> float:
    """Delay before redelivering a message whose handler failed on delivery `delivery_count`."""
    return delays[min(max(delivery_count, 1), len(delays)) - 1]


class PullWorker(Generic[M]):
    """Runs a handler over one durable pull consumer with bounded concurrency."""

    def __init__(
        self,
        bus: Bus,
        consumer: ConsumerSpec,
        message_type: type[M],
        handler: Handler[M],
        *,
        service: str,
        concurrency: int = 1,
        validator: Validator[M] | None = None,
        fetch_timeout_s: float = 1.0,
        retry_delays_s: Sequence[float] = DEFAULT_RETRY_DELAYS_S,
        ready: Callable[[], bool] | None = None,
    ) -> None:
        self.bus = bus
        self.consumer = consumer
        self.message_type = message_type
        self.handler = handler
        self.service = service
        self.concurrency = max(1, concurrency)
        self.validator = validator
        self.dead_lettered: Counter[str] = Counter()  # by kind: invalid, max_deliveries
        # The last failure of messages this worker nacked, by stream sequence: the reason its
        # dead letter gives when the server's advisory ends it (a last delivery that never
        # reached the handler, e.g. one that arrived as a fetch timed out, says nothing itself).
        self.failures: OrderedDict[int, str] = OrderedDict()
        self.fetch_timeout_s = fetch_timeout_s
        self.retry_delays_s = tuple(retry_delays_s)
        # While this says no (e.g. the rollout's engine is down), nothing new is taken: a message
        # taken now would only fail and use up one of its deliveries.
        self.ready = ready
        self.heartbeat_s = max(0.5, consumer.ack_wait_s / 3)
        self.in_flight: dict[asyncio.Task[None], Msg] = {}
        # Messages whose handlers run, each with when its next in-progress is due: one loop beats
        # for all of them (a timer task per message costs more than the handling of a small one).
        self._beating: dict[int, tuple[Msg, float]] = {}
        self._beater: asyncio.Task[None] | None = None
        self.processed = 0
        self.last_error: str | None = None
        self._bound_generation = -1
        self._ensure_again_at: float | None = None  # bound without having ensured the consumer
        self._sub = None
        self._advisory_sub = None

    @property
    def busy(self) -> int:
        return len(self.in_flight)

    @property
    def bound(self) -> bool:
        return self._sub is not None

    async def _bind(self) -> None:
        """(Re)creates the consumer and the pull subscription: after a server restart the
        consumer may be gone, and a subscription made before it would wait forever."""
        try:
            await asyncio.wait_for(self._ensure(), timeout=ENSURE_TIMEOUT_S)
            self._ensure_again_at = None
        except Exception as exc:
            if not is_transient(exc):
                raise
            # In a cluster electing its meta leader nothing can be created for seconds, while
            # the (replicated) consumer goes on serving pulls: bind to it now, and bind again
            # (creating it, were it gone) shortly.
            log.warning("consumer_not_ensured", consumer=self.consumer.durable, error=repr(exc))
            self._ensure_again_at = time.monotonic() + ENSURE_AGAIN_S
        if self._sub is not None:
            try:
                await self._sub.unsubscribe()
            except (TimeoutError, nats.errors.Error):
                pass
        self._sub = await self.bus.js.pull_subscribe_bind(
            durable=self.consumer.durable, stream=self.consumer.stream
        )
        if self._advisory_sub is None:
            self._advisory_sub = await watch_max_deliveries(
                self.bus, self.consumer.stream, self.consumer.durable, self.service, self.failures.get
            )
        self._bound_generation = self.bus.reconnects
        log.info("consumer_bound", stream=self.consumer.stream, consumer=self.consumer.durable)

    async def _ensure(self) -> None:
        await self.bus.ensure_stream(self.bus.topology.streams[self.consumer.stream])
        await self.bus.ensure_consumer(self.consumer)

    async def run(self, stop: asyncio.Event) -> None:
        """Fetches and handles messages until `stop` is set. Does not wait for in-flight
        handlers: call `drain` after."""
        while not stop.is_set():
            try:
                if (self._sub is None or self._bound_generation != self.bus.reconnects
                        or (self._ensure_again_at is not None and time.monotonic() >= self._ensure_again_at)):
                    await self._bind()
                if self.ready is not None and not self.ready():
                    await _sleep_or_stop(stop, min(0.2, self.fetch_timeout_s))
                    continue
                free = self.concurrency - len(self.in_flight)
                if free <= 0:
                    await asyncio.wait(list(self.in_flight), return_when=asyncio.FIRST_COMPLETED,
                                       timeout=self.fetch_timeout_s)
                    continue
                try:
                    msgs = await self._sub.fetch(free, timeout=self.fetch_timeout_s)  # type: ignore[union-attr]
                except (TimeoutError, nats.errors.TimeoutError):
                    # Nothing to take (nats-py raises either kind, depending on the batch size).
                    continue
                for msg in msgs:
                    if stop.is_set():
                        # Taken after the stop signal: hand it straight back.
                        await self._nak(msg, delay=None, outcome="requeued")
                        continue
                    task = asyncio.create_task(self._handle(msg))
                    self.in_flight[task] = msg
                    task.add_done_callback(self._forget)
            except asyncio.CancelledError:
                raise
            except (TimeoutError, nats.errors.Error, OSError) as exc:
                # Server gone or consumer lost: wait, then re-bind.
                self.last_error = repr(exc)
                log.warning("consume_error", consumer=self.consumer.durable, error=repr(exc))
                self._sub = None
                await _sleep_or_stop(stop, 0.5)

    def _forget(self, task: asyncio.Task[None]) -> None:
        self.in_flight.pop(task, None)

    async def drain(self, grace_s: float) -> None:
        """Lets in-flight handlers finish for up to `grace_s`, then cancels the rest, which
        naks their messages so another replica gets them now rather than at ack timeout."""
        if self.in_flight:
            await asyncio.wait(list(self.in_flight), timeout=grace_s)
        for task in list(self.in_flight):
            task.cancel()
        if self.in_flight:
            await asyncio.wait(list(self.in_flight), timeout=5)
        if self._beater is not None and not self._beating:
            self._beater.cancel()
        for sub in (self._sub, self._advisory_sub):
            if sub is not None:
                try:
                    await sub.unsubscribe()
                except (TimeoutError, nats.errors.Error):
                    pass

    async def _handle(self, msg: Msg) -> None:
        stream, durable = self.consumer.stream, self.consumer.durable
        try:
            meta = msg.metadata
        except (ValueError, nats.errors.Error) as exc:
            # An ack subject that does not parse cannot be acked either: say so once per delivery.
            log.error("delivery_without_metadata", stream=stream, subject=msg.subject, reply=msg.reply,
                      error=repr(exc))
            return
        started = time.monotonic()
        try:
            message = decode_message(msg, self.message_type)
            if self.validator is not None:
                try:
                    self.validator(message)
                except ValueError as exc:
                    raise PermanentError(f"invalid {self.message_type.DESCRIPTOR.name}: {exc}") from exc
            delivery = Delivery(
                message=message,
                subject=msg.subject,
                msg_id=(msg.headers or {}).get(MSG_ID_HEADER, ""),
                stream_seq=meta.sequence.stream,
                delivery_count=meta.num_delivered,
                raw=msg,
            )
            beat_key = self._beat_for(msg)
            try:
                # The message's trace goes on under its handler (and into what it publishes).
                with tracing.span(f"process {stream}", parent=tracing.extract(msg.headers), kind=SpanKind.CONSUMER,
                                  attributes=self._span_attributes(delivery)):
                    await self.handler(delivery)
            finally:
                del self._beating[beat_key]
        except asyncio.CancelledError:
            await self._nak(msg, delay=None, outcome="requeued")
            raise
        except PermanentError as exc:
            await self._dead_letter(msg, str(exc), "invalid")
            return
        except Exception as exc:  # noqa: BLE001 - any handler failure is retried, then dead-lettered
            self.last_error = repr(exc)
            self._remember_failure(meta.sequence.stream, repr(exc))
            if meta.num_delivered >= self.consumer.max_deliver:
                await self._dead_letter(
                    msg, f"handler failed on all {meta.num_delivered} deliveries; last error: {exc!r}",
                    "max_deliveries",
                )
            else:
                delay = retry_delay(meta.num_delivered, self.retry_delays_s)
                log.warning("handler_failed", stream=stream, seq=meta.sequence.stream,
                            delivery=meta.num_delivered, retry_in_s=delay, error=repr(exc))
                await self._nak(msg, delay=delay, outcome="nacked")
            return
        finally:
            BUS_HANDLER_SECONDS.labels(stream, durable).observe(time.monotonic() - started)
        try:
            await msg.ack()
            self.processed += 1
            self.failures.pop(meta.sequence.stream, None)
            BUS_CONSUMED.labels(stream, durable, "acked").inc()
        except nats.errors.Error as exc:
            # The effect is durable; the message will be redelivered and the idempotent
            # handler will recognise it.
            log.warning("ack_failed", stream=stream, seq=meta.sequence.stream, error=repr(exc))

    def _span_attributes(self, delivery: Delivery[M]) -> dict[str, str | int]:
        return {"messaging.system": "nats", "messaging.destination.name": delivery.subject,
                "messaging.consumer.group.name": self.consumer.durable, "messaging.message.id": delivery.msg_id,
                "policyloop.stream_sequence": delivery.stream_seq, "policyloop.delivery_count": delivery.delivery_count}

    def _beat_for(self, msg: Msg) -> int:
        """Keeps `msg` from redelivery while its handler runs (until its key leaves `_beating`)."""
        key = id(msg)
        self._beating[key] = (msg, time.monotonic() + self.heartbeat_s)
        if self._beater is None or self._beater.done():
            self._beater = asyncio.create_task(self._heartbeats())
        return key

    async def _heartbeats(self) -> None:
        """Sends in-progress for every handled message once per heartbeat_s: ticking at half that,
        no message goes longer than 1.5 × heartbeat_s (half the ack wait) without one. Returns
        when no handler runs."""
        while self._beating:
            await asyncio.sleep(self.heartbeat_s / 2)
            now = time.monotonic()
            for key, (msg, due) in list(self._beating.items()):
                if due > now or key not in self._beating:
                    continue
                self._beating[key] = (msg, now + self.heartbeat_s)
                try:
                    await msg.in_progress()
                except nats.errors.Error as exc:
                    log.warning("in_progress_failed", error=repr(exc))

    async def _nak(self, msg: Msg, *, delay: float | None, outcome: str) -> None:
        try:
            await msg.nak(delay=delay)
            BUS_CONSUMED.labels(self.consumer.stream, self.consumer.durable, outcome).inc()
        except nats.errors.Error as exc:
            # Unreachable server: the ack timeout will redeliver it.
            log.warning("nak_failed", error=repr(exc))

    def _remember_failure(self, stream_seq: int, error: str) -> None:
        self.failures[stream_seq] = error
        self.failures.move_to_end(stream_seq)
        while len(self.failures) > REMEMBERED_FAILURES:
            self.failures.popitem(last=False)

    async def _dead_letter(self, msg: Msg, reason: str, kind: str) -> None:
        try:
            await dead_letter_delivered(self.bus, msg, reason=reason, kind=kind, service=self.service)
            self.dead_lettered[kind] += 1
            BUS_CONSUMED.labels(self.consumer.stream, self.consumer.durable, "dead_lettered").inc()
        except Exception as exc:  # noqa: BLE001 - keep the message: nak it for a later attempt
            log.error("dead_letter_failed", error=repr(exc))
            await self._nak(msg, delay=retry_delay(1, self.retry_delays_s), outcome="nacked")


async def _sleep_or_stop(stop: asyncio.Event, seconds: float) -> None:
    try:
        await asyncio.wait_for(stop.wait(), timeout=seconds)
    except TimeoutError:
        pass
