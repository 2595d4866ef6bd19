"""Asking the sandbox service to run a job: request/reply over the SANDBOX stream.

The job is stored in SANDBOX (any replica takes it; one that dies mid-job leaves it to another)
and the result comes back on a private inbox. Each attempt is a new job id: a caller that died
and retries must get a result of its own (scoring is pure, so running twice is harmless),
whereas JetStream would deduplicate a reused id and no reply would reach the new inbox.
"""

from __future__ import annotations

import asyncio
import time
import uuid

from policyloop.bus import Bus, sandbox_subject
from policyloop.contracts.v1 import bus_pb2

PUBLISH_MARGIN_S = 30.0


class SandboxTimeout(TimeoutError):
    """No result within the deadline (the sandboxes are busy or down): try again later."""


async def run_in_sandbox(bus: Bus, job: bus_pb2.SandboxJob, *, kind: str = "python", timeout_s: float = 120.0
                         ) -> bus_pb2.SandboxResult:
    """Runs `job` (its job_id gets a unique suffix) on some sandbox replica and returns its result."""
    original, job = job, bus_pb2.SandboxJob()
    job.CopyFrom(original)  # the caller's job stays as it was
    job.job_id = f"{job.job_id or 'job'}#{uuid.uuid4().hex[:12]}"
    job.reply_subject = bus.nc.new_inbox()
    # After that no one reads the result (the wait starts once the publish is acked: a margin
    # covers publishes retried through a NATS restart).
    job.expires_unix_ms = int((time.time() + timeout_s + PUBLISH_MARGIN_S) * 1000)
    replied: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()

    async def on_reply(msg) -> None:  # type: ignore[no-untyped-def]
        if not replied.done():
            replied.set_result(msg.data)

    sub = await bus.nc.subscribe(job.reply_subject, cb=on_reply)
    try:
        await bus.publish(sandbox_subject(kind), job, job.job_id)
        try:
            data = await asyncio.wait_for(replied, timeout_s)
        except TimeoutError as exc:
            raise SandboxTimeout(f"sandbox job {job.job_id}: no result within {timeout_s}s") from exc
    finally:
        await sub.unsubscribe()
    return bus_pb2.SandboxResult.FromString(data)
