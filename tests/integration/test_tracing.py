"""Trace context across the bus against a real NATS: a span under which a message is published
is the parent of the span its consumer handles it in, and of what that handler publishes on, so
a task's life is one tree at a real OTLP/HTTP receiver. The services' own spans (feed, sample,
turn, tool call, sandbox job, score, train, publish version) are checked in
tests/e2e/test_protos_client.py and tests/integration/test_multiturn.py."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from policyloop.bus import Bus, Delivery, PermanentError, PullWorker, rollouts_subject, tasks_subject
from policyloop.contracts.v1 import bus_pb2
from policyloop.telemetry import tracing
from tests.helpers import eventually, publish_group, stored
from tests.otlp_receiver import OtlpReceiver, lineage, roots_and_children


@pytest.fixture
def receiver() -> Iterator[OtlpReceiver]:
    with OtlpReceiver() as received:
        tracing.setup_tracing("test", "test-0", tracing.TracingSettings(otlp_endpoint=received.endpoint,
                                                                        batch_delay_s=0.05))
        try:
            yield received
        finally:
            tracing.shutdown_tracing()


async def test_a_task_and_what_its_handlers_publish_form_one_trace(bus: Bus, receiver: OtlpReceiver) -> None:
    async def sample(delivery: Delivery[bus_pb2.Task]) -> None:
        task = delivery.message
        for i in range(2):
            with tracing.span("sample", attributes={tracing.TRAJECTORY_ID: f"{task.task_id}/{i}"}):
                traj = bus_pb2.Trajectory(trajectory_id=f"{task.task_id}/{i}", task_id=task.task_id, run_id="r",
                                          environment=task.environment, sample_index=i, group_id=f"{task.task_id}/{i}")
                await publish_group(bus, rollouts_subject(task.environment), traj)

    async def score(delivery: Delivery[bus_pb2.TrajectoryGroup]) -> None:
        if delivery.message.trajectories[0].sample_index == 1:
            raise PermanentError("no scorer for this one")  # dead-lettered: its span says why

    topology = bus.topology.consumers
    stop = asyncio.Event()
    workers = [PullWorker(bus, topology["rollout"], bus_pb2.Task, sample, service="rollout"),
               PullWorker(bus, topology["reward"], bus_pb2.TrajectoryGroup, score, service="reward")]
    running = [asyncio.create_task(w.run(stop)) for w in workers]
    try:
        with tracing.span("feed task", attributes={tracing.TASK_ID: "t1"}):
            await bus.publish(tasks_subject("addition@v1"), bus_pb2.Task(
                task_id="t1", run_id="r", environment="addition@v1", prompt_text="1+1=", group_size=2), "t1")

        async def both_scored() -> bool:
            return workers[1].processed == 1 and workers[1].dead_lettered["invalid"] == 1

        await eventually(both_scored, what="both trajectories handled")
    finally:
        stop.set()
        await asyncio.gather(*running)
        for worker in workers:
            await worker.drain(1)
    await asyncio.to_thread(tracing.shutdown_tracing)  # exports what is left

    spans = receiver.snapshot()
    [root], children = roots_and_children(spans)
    assert root.name == "feed task" and {s.trace_id for s in spans} == {root.trace_id}
    for leaf in (s for s in spans if s.name == "process ROLLOUTS"):
        chain = lineage(spans, leaf)
        assert [s.name for s in chain] == ["feed task", "process TASKS", "sample", "process ROLLOUTS"]
        assert chain[-1].attributes["messaging.consumer.group.name"] == "reward"
        assert chain[1].attributes["messaging.destination.name"] == tasks_subject("addition@v1")
    failed = [s for s in spans if s.name == "process ROLLOUTS" and s.error]
    assert len(failed) == 1 and len([s for s in spans if s.name == "process ROLLOUTS"]) == 2
    # The DLQ copy keeps the context it arrived with: a dead letter can be found from its trace.
    [letter] = await stored(bus, "DLQ", bus_pb2.DeadLetter)
    assert "no scorer" in letter.reason


async def test_without_an_endpoint_nothing_is_recorded_and_the_context_goes_on(bus: Bus) -> None:
    tracing.shutdown_tracing()
    assert not tracing.enabled()
    upstream = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}
    with tracing.span("process TASKS", parent=tracing.extract(upstream)) as made:
        assert not made.is_recording()
        onward: dict[str, str] = {}
        tracing.inject(onward)
    assert onward["traceparent"].split("-")[1] == "0af7651916cd43dd8448eb211c80319c"
    with tracing.span("alone"):
        nothing: dict[str, str] = {}
        tracing.inject(nothing)
    assert "traceparent" not in nothing


async def test_tasks_outside_the_sample_ratio_are_not_traced_downstream_either() -> None:
    with OtlpReceiver() as receiver:
        tracing.setup_tracing("test", "test-0", tracing.TracingSettings(otlp_endpoint=receiver.endpoint,
                                                                        sample_ratio=0.0))
        try:
            with tracing.span("feed task") as root:
                headers: dict[str, str] = {}
                tracing.inject(headers)
            sampled = int(headers["traceparent"].rsplit("-", 1)[1], 16) & 1  # W3C trace-flags' sampled bit
            assert not root.is_recording() and not sampled
            with tracing.span("process TASKS", parent=tracing.extract(headers)) as child:
                assert not child.is_recording()  # the parent's decision is followed
        finally:
            tracing.shutdown_tracing()
        assert receiver.snapshot() == []
