"""Feeds running runs' Tasks into TASKS. Feeding a run is owned by one replica at a time through
a lease in Redis; the i-th task of a run is a pure function of the run (policyloop.gateway.feeding),
so a replica that takes over re-publishes under the same ids and nothing is enqueued twice. A
full TASKS stream (backpressure) pauses feeding; it never drops a task. A supervised run's
demonstrations go to TRAJECTORIES instead, paced by the learner's backlog in the same way."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import redis.exceptions
from opentelemetry.trace import SpanKind

from policyloop.bus import Bus, BusError, StreamFull, tasks_subject, trajectories_subject
from policyloop.contracts.v1 import bus_pb2, loop_pb2
from policyloop.gateway.feeding import nth_item
from policyloop.ledger import record_generated
from policyloop.state import IdempotencyKeys
from policyloop.state.catalog import EnvironmentCatalog, RunRegistry
from policyloop.telemetry import tracing
from policyloop.telemetry.logging import get_logger

log = get_logger(__name__)


class RunFeeder:
    """`owner` names this replica on the leases; `lease_s` is the lease on feeding one run (another
    replica takes over after it lapses); `backpressure_wait_s` the pause before retrying when TASKS
    is full; `on_backpressure` hears whether TASKS was full at the last publish."""

    def __init__(self, bus: Bus, environments: EnvironmentCatalog, runs: RunRegistry, leases: IdempotencyKeys,
                 *, owner: str, lease_s: float, backpressure_wait_s: float, stop: asyncio.Event,
                 wake: asyncio.Event, on_backpressure: Callable[[bool], None] = lambda full: None,
                 max_waiting_demonstrations: int = 4096) -> None:
        self.bus = bus
        self.environments = environments
        self.runs = runs
        self.leases = leases
        self.owner = owner
        self.lease_s = lease_s
        self.backpressure_wait_s = backpressure_wait_s
        self.stop = stop
        self.wake = wake
        self.on_backpressure = on_backpressure
        self.max_waiting_demonstrations = max_waiting_demonstrations
        self.demonstrations_unchecked = 0  # fed since the learner's backlog was last read
        # How often a feed renews its lease and reads its run's state (a lapsed lease must stay impossible).
        self.check_every_s = min(1.0, lease_s / 4)

    async def run(self) -> None:
        """Looks for running runs with tasks left to feed (new ones, or ones whose feeder died)
        until stopped; `wake` starts a look at once. Runs are fed side by side, each by a task of
        its own, so that they share TASKS (one run's long feed never holds up another's)."""
        feeding: dict[str, asyncio.Task[None]] = {}
        try:
            while not self.stop.is_set():
                self.wake.clear()
                for run_id in [r for r, task in feeding.items() if task.done()]:
                    del feeding[run_id]
                try:
                    for run_id in await self.runs.run_ids():
                        if run_id in feeding:
                            continue
                        run = await self.runs.get(run_id)
                        if run and run.state == loop_pb2.RUN_STATE_RUNNING and run.tasks_enqueued < run.tasks_total:
                            feeding[run_id] = asyncio.create_task(self._feed_logged(run_id))
                except (redis.exceptions.RedisError, BusError, OSError) as exc:
                    log.warning("feeder_error", error=repr(exc))
                try:
                    await asyncio.wait_for(self.wake.wait(), timeout=self.lease_s / 2)
                except TimeoutError:
                    pass
        finally:
            for task in feeding.values():
                task.cancel()
            await asyncio.gather(*feeding.values(), return_exceptions=True)

    async def _feed_logged(self, run_id: str) -> None:
        try:
            await self.feed(run_id)
        except (redis.exceptions.RedisError, BusError, OSError) as exc:
            log.warning("feeder_error", run=run_id, error=repr(exc))

    async def feed(self, run_id: str) -> None:
        """Publishes the run's remaining tasks while this replica holds the run's lease."""
        lease = f"feeder:{run_id}"
        if not await self.leases.claim(lease, self.lease_s, self.owner) \
                and await self.leases.owner(lease) != self.owner:
            return
        try:
            request = await self.runs.definition(run_id)
            run = await self.runs.get(run_id)
            if request is None or run is None:
                return
            envs = {m.environment: await self.environments.get(m.environment) for m in request.environments}
            index = recorded = run.tasks_enqueued
            checked = float("-inf")
            try:
                while index < run.tasks_total and not self.stop.is_set():
                    # The lease, the run's state and the count enqueued go to Redis once per
                    # check interval, not per task: three round trips a task cost more than its
                    # publish. A takeover re-publishes at most an interval's tasks, under the
                    # same ids (deduplicated); a stopped run's extra tasks are acked unsampled.
                    if time.monotonic() - checked >= self.check_every_s:
                        if not await self.leases.extend(lease, self.lease_s, self.owner):
                            return  # another replica took over
                        current = await self.runs.get(run_id)
                        if current is None or current.state != loop_pb2.RUN_STATE_RUNNING:
                            return
                        recorded = await self._record_enqueued(run_id, index, recorded)
                        checked = time.monotonic()
                    item = nth_item(run_id, request, envs, index)  # type: ignore[arg-type]
                    try:
                        await self.publish(item, lora=request.HasField("lora"))
                    except StreamFull:
                        self.on_backpressure(True)
                        recorded = await self._record_enqueued(run_id, index, recorded)
                        await asyncio.sleep(self.backpressure_wait_s)
                        checked = float("-inf")
                        continue
                    self.on_backpressure(False)
                    index += 1
            finally:
                if await self.leases.owner(lease) == self.owner:  # never behind a replica that took over
                    await self._record_enqueued(run_id, index, recorded)
        finally:
            await self.leases.release(lease, self.owner)

    async def _record_enqueued(self, run_id: str, index: int, recorded: int) -> int:
        if index != recorded:
            await self.runs.set_enqueued(run_id, index)
        return index

    async def publish(self, item: bus_pb2.Task | bus_pb2.Trajectory, *, lora: bool = False) -> None:
        """A task starts its trace: every trajectory of its group is sampled, scored and trained
        under it (policyloop.telemetry.tracing); a LoRA run's (`lora`) goes to the replicas of LoRA
        runs. A demonstration goes straight to the learner."""
        if isinstance(item, bus_pb2.Trajectory):
            await self._learner_has_room()
            with tracing.span("feed demonstration", kind=SpanKind.PRODUCER, attributes={
                    tracing.TASK_ID: item.task_id, tracing.RUN_ID: item.run_id, tracing.ENVIRONMENT: item.environment}):
                group = bus_pb2.TrajectoryGroup(group_id=item.group_id, trajectories=[item])
                await self.bus.publish(trajectories_subject(item.environment), group, item.group_id)
            await record_generated(self.bus, [item], self.owner)  # for the ledger's audit, as a replica's group
            self.demonstrations_unchecked += 1
            return
        task = item
        with tracing.span("feed task", kind=SpanKind.PRODUCER, attributes={
                tracing.TASK_ID: task.task_id, tracing.RUN_ID: task.run_id,
                tracing.ENVIRONMENT: task.environment, "policyloop.group_size": task.group_size}):
            await self.bus.publish(tasks_subject(task.environment, lora=lora), task, task.task_id)

    async def _learner_has_room(self) -> None:
        """Demonstrations go straight to TRAJECTORIES, which has no room limit to push back (it
        keeps what the learner has not taken): feeding raises StreamFull while the learner's
        backlog is at `max_waiting_demonstrations` (read once per eighth of it fed), and the run's
        feed pauses as it does on a full TASKS."""
        if self.demonstrations_unchecked < max(1, self.max_waiting_demonstrations // 8):
            return
        backlog = await self.bus.backlog("learner")
        if backlog.pending >= self.max_waiting_demonstrations:
            raise StreamFull(trajectories_subject("*"), "TRAJECTORIES")
        self.demonstrations_unchecked = 0
