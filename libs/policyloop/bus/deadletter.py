"""Dead letters: messages that cannot be decoded, are invalid, or exhausted their deliveries
are copied to the DLQ stream with the reason, the origin and the delivery count.

Two paths lead here. A handler that sees a bad message, or fails on its last delivery,
dead-letters it and acks it. A message whose holder kept dying never reaches a handler's last
attempt: the server stops delivering it and, the next time a replica pulls, emits a
MAX_DELIVERIES advisory, which
`watch_max_deliveries` turns into a dead letter (and, in a work-queue stream, deletes the
original, which would otherwise sit there forever). Both paths use the message id
`dlq:<stream>:<seq>`, so a message is dead-lettered once even when both fire.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import nats.errors
import nats.js.errors
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import api

from policyloop.bus.connection import Bus
from policyloop.bus.topology import dlq_subject
from policyloop.common.clock import now_ms
from policyloop.contracts.v1 import bus_pb2
from policyloop.telemetry.logging import get_logger
from policyloop.telemetry.metrics import BUS_DEAD_LETTERED

log = get_logger(__name__)

ADVISORY_MAX_DELIVERIES = "$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES"


def dead_letter_id(stream: str, stream_seq: int) -> str:
    return f"dlq:{stream}:{stream_seq}"


async def publish_dead_letter(
    bus: Bus,
    *,
    origin_stream: str,
    origin_subject: str,
    stream_seq: int,
    consumer: str,
    payload: bytes,
    headers: dict[str, str] | None,
    reason: str,
    kind: str,
    delivery_count: int,
    service: str,
) -> None:
    letter = bus_pb2.DeadLetter(
        origin_stream=origin_stream,
        origin_subject=origin_subject,
        stream_sequence=stream_seq,
        consumer=consumer,
        payload=payload,
        headers={k: str(v) for k, v in (headers or {}).items()},
        reason=f"{kind}: {reason}",
        delivery_count=delivery_count,
        service=service,
        dead_lettered_unix_ms=now_ms(),
    )
    await bus.publish(dlq_subject(origin_stream), letter, dead_letter_id(origin_stream, stream_seq))
    BUS_DEAD_LETTERED.labels(stream=origin_stream, kind=kind).inc()
    log.warning(
        "dead_lettered", stream=origin_stream, subject=origin_subject, seq=stream_seq,
        kind=kind, reason=reason, deliveries=delivery_count,
    )


async def dead_letter_delivered(bus: Bus, msg: Msg, *, reason: str, kind: str, service: str) -> None:
    """Copies a delivered message to the DLQ, then acks it (the copy is durable first)."""
    meta = msg.metadata
    await publish_dead_letter(
        bus,
        origin_stream=meta.stream,
        origin_subject=msg.subject,
        stream_seq=meta.sequence.stream,
        consumer=meta.consumer or "",
        payload=msg.data,
        headers=msg.headers,
        reason=reason,
        kind=kind,
        delivery_count=meta.num_delivered,
        service=service,
    )
    await msg.ack()


async def dead_letter_stored(
    bus: Bus, *, stream: str, consumer: str, stream_seq: int, deliveries: int, service: str,
    last_failure: str | None = None,
) -> bool:
    """Dead-letters the message at `stream_seq` that exhausted its deliveries, with the last
    failure its handler saw here when one did. Returns False when the message is gone already
    (acknowledged late, or handled by another replica)."""
    try:
        stored = await bus.js.get_msg(stream, stream_seq)
    except nats.js.errors.NotFoundError:
        return False
    headers = dict(stored.headers or {})
    await publish_dead_letter(
        bus,
        origin_stream=stream,
        origin_subject=stored.subject or "",
        stream_seq=stream_seq,
        consumer=consumer,
        payload=stored.data or b"",
        headers=headers,
        reason=f"no acknowledgement after {deliveries} deliveries; the last failure seen: {last_failure}"
        if last_failure else f"no acknowledgement after {deliveries} deliveries (the holder timed out or died each "
                             "time)",
        kind="max_deliveries",
        delivery_count=deliveries,
        service=service,
    )
    if bus.topology.streams[stream].retention == api.RetentionPolicy.WORK_QUEUE:
        try:
            await bus.js.delete_msg(stream, stream_seq)
        except nats.js.errors.NotFoundError:
            pass
    return True


async def watch_max_deliveries(bus: Bus, stream: str, consumer: str, service: str,
                               last_failure: Callable[[int], str | None] = lambda _: None) -> Subscription:
    """Subscribes to the server's MAX_DELIVERIES advisories for one consumer; `last_failure`
    gives the last error this process's handler met on a message (by stream sequence), if any."""

    async def on_advisory(msg: Msg) -> None:
        try:
            event = json.loads(msg.data)
            await dead_letter_stored(
                bus,
                stream=stream,
                consumer=consumer,
                stream_seq=int(event["stream_seq"]),
                deliveries=int(event.get("deliveries", 0)),
                service=service,
                last_failure=last_failure(int(event["stream_seq"])),
            )
        except (TimeoutError, ValueError, KeyError, nats.errors.Error) as exc:
            log.error("advisory_failed", stream=stream, consumer=consumer, error=repr(exc))

    return await bus.nc.subscribe(f"{ADVISORY_MAX_DELIVERIES}.{stream}.{consumer}", cb=on_advisory)
