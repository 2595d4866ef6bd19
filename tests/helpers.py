"""Small helpers shared by the tests: reading streams back, waiting for conditions."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import nats.js.errors
from google.protobuf.message import Message

from policyloop.bus import Bus

M = TypeVar("M", bound=Message)


async def stored_messages(bus: Bus, stream: str) -> list[tuple[str, bytes, dict]]:
    """Every message currently stored in `stream`, as (subject, payload, headers)."""
    info = await bus.js.stream_info(stream)
    out = []
    if info.state.messages == 0:
        return out
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        try:
            msg = await bus.js.get_msg(stream, seq)
        except nats.js.errors.NotFoundError:
            continue
        out.append((msg.subject or "", msg.data or b"", dict(msg.headers or {})))
    return out


async def stored(bus: Bus, stream: str, message_type: type[M]) -> list[M]:
    decoded = []
    for _, data, _ in await stored_messages(bus, stream):
        message = message_type()
        message.ParseFromString(data)
        decoded.append(message)
    return decoded


async def eventually(check: Callable[[], Awaitable[bool]], timeout_s: float = 20.0,
                     interval_s: float = 0.1, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if await check():
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout_s}s")
        await asyncio.sleep(interval_s)
