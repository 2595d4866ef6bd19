"""rollout service: TASKS → ROLLOUTS, and it follows WEIGHTS.

In this version a rollout replica has no engine yet: for each Task it publishes one Rollout per
group member carrying the task's identity and prompt and an empty response (the engine and the
sampling come with the loop issue). What it already does for real is the bus contract: a Task is
acked only after all of its group's Rollouts are acknowledged by ROLLOUTS, each under its
stable trajectory id, so a redelivered Task produces no duplicates.
"""

from __future__ import annotations

import asyncio

import nats.errors
from nats.js import api
from pydantic import Field

from policyloop.bus import Delivery, PullWorker, rollouts_subject
from policyloop.contracts.v1 import bus_pb2
from policyloop.contracts.validate import validate_task
from policyloop.runtime import ServiceContext, ServiceSettings, run_main, run_pull_workers
from policyloop.telemetry.logging import get_logger
from policyloop.trajectories import group_members

log = get_logger(__name__)


class RolloutSettings(ServiceSettings):
    concurrency: int = Field(4, description="Tasks this replica works on at once.")
    model: str = Field("policy", description="Model whose WeightsPublished events this replica follows.")


async def follow_weights(ctx: ServiceContext, model: str) -> None:
    """Records the newest announced version of `model` (the engine will load it later)."""
    from policyloop.bus import weights_subject

    async def on_event(msg) -> None:  # type: ignore[no-untyped-def]
        event = bus_pb2.WeightsPublished()
        event.ParseFromString(msg.data)
        ctx.detail["announced_version"] = max(int(ctx.detail.get("announced_version", 0)), event.version)
        log.info("weights_announced", version=event.version, endpoint=event.fetch_endpoint)

    sub = await ctx.bus.js.subscribe(
        weights_subject(model), cb=on_event, ordered_consumer=True,
        deliver_policy=api.DeliverPolicy.LAST_PER_SUBJECT,
    )
    try:
        await ctx.stop.wait()
    finally:
        try:
            await sub.unsubscribe()
        except nats.errors.Error:
            pass


async def body(ctx: ServiceContext) -> None:
    settings: RolloutSettings = ctx.settings  # type: ignore[assignment]
    ctx.detail["tasks_done"] = 0

    async def handle(delivery: Delivery[bus_pb2.Task]) -> None:
        task = delivery.message
        for rollout in group_members(task, settings.instance_id):
            await ctx.bus.publish(rollouts_subject(task.environment), rollout, rollout.trajectory_id)
        ctx.detail["tasks_done"] = int(ctx.detail["tasks_done"]) + 1

    worker = PullWorker(
        ctx.bus, ctx.bus.topology.consumers["rollout"], bus_pb2.Task, handle,
        service="rollout", concurrency=settings.concurrency, validator=validate_task,
    )
    weights = asyncio.create_task(follow_weights(ctx, settings.model))
    try:
        await run_pull_workers(ctx, worker)
    finally:
        await asyncio.gather(weights, return_exceptions=True)


def main(argv: list[str] | None = None) -> int:
    return run_main("rollout", RolloutSettings, body, argv)
