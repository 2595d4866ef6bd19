"""The trajectories a learner holds: taken from TRAJECTORIES, not acknowledged until the step
that trains on them has made a version the publisher stored (or they were dropped as stale)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence

from redis.exceptions import RedisError

from policyloop.bus import PermanentError
from policyloop.contracts.v1 import bus_pb2
from policyloop.rl.batching import Admission, GroupCollector, ModelLimits, RecentSteps, split_stale
from policyloop.state.outcomes import RunStanding, TaskOutcomes
from policyloop.telemetry.logging import get_logger

log = get_logger(__name__)

Groups = list[list[bus_pb2.Trajectory]]


async def standings(outcomes: TaskOutcomes, run_ids: Iterable[str]) -> dict[str, RunStanding]:
    """Each run's standing; one Redis cannot tell of now is left out (looked at again later)."""
    found = {}
    for run_id in run_ids:
        try:
            found[run_id] = await outcomes.standing(run_id)
        except (RedisError, OSError) as exc:
            log.warning("run_standing_unknown", run=run_id, error=repr(exc))
    return found


def refuse_unscored(group: Sequence[bus_pb2.Trajectory]) -> None:
    """PermanentError (a dead letter naming the sample) for a group the reward service did not score."""
    for traj in group:
        if not traj.scored:
            raise PermanentError(f"trajectory {traj.trajectory_id} was not scored by the reward service")


def refuse_untrainable(group: Sequence[bus_pb2.Trajectory], limits: ModelLimits) -> None:
    """PermanentError for a group with a sample the model cannot train on (ModelLimits.problem)."""
    for traj in group:
        problem = limits.problem(traj)
        if problem is not None:
            raise PermanentError(f"the model cannot train on trajectory {traj.trajectory_id}: {problem}")


class HeldTrajectories:
    """Groups filling and complete, each sample's TRAJECTORIES sequence (for the ledger), and a
    future per sample that its handler waits on: resolved by `release`, after which the pull
    worker acks the message."""

    def __init__(self, groups_per_step: int, trained: RecentSteps) -> None:
        self.groups_per_step = groups_per_step
        self.collector = GroupCollector(trained=trained)
        self._sequences: dict[str, int] = {}
        self._released: dict[str, asyncio.Future[None]] = {}
        self._enough = asyncio.Event()

    @property
    def trained(self) -> RecentSteps:
        return self.collector.trained

    def add(self, traj: bus_pb2.Trajectory, stream_seq: int) -> Admission:
        """Holds a new sample; a DUPLICATE (held, in the step under way, or trained) is not held."""
        admission = self.collector.add(traj)
        if admission is Admission.DUPLICATE:
            return admission
        self._sequences[traj.trajectory_id] = stream_seq
        self._released[traj.trajectory_id] = asyncio.get_running_loop().create_future()
        if self.collector.has_batch(self.groups_per_step):
            self._enough.set()
        return admission

    async def until_released(self, trajectory_id: str) -> bool:
        """Waits while the sample is held; False at once when it is not held (any more)."""
        future = self._released.get(trajectory_id)
        if future is None:
            return False
        await asyncio.shield(future)  # a cancelled handler must not cancel it for the others
        return True

    async def until_all_released(self, trajectory_ids: list[str]) -> list[bool]:
        """until_released for each sample of a group, looked up at once (before any waiting)."""
        futures = [self._released.get(t) for t in trajectory_ids]
        waiting = [asyncio.shield(f) for f in futures if f is not None]
        if waiting:
            await asyncio.gather(*waiting)
        return [f is not None for f in futures]

    def sequence(self, trajectory_id: str) -> int:
        return self._sequences.get(trajectory_id, 0)

    def release(self, samples: list[bus_pb2.Trajectory]) -> None:
        """Lets the handlers holding these samples return, and their messages be acked."""
        for traj in samples:
            self._sequences.pop(traj.trajectory_id, None)
            future = self._released.pop(traj.trajectory_id, None)
            if future is not None and not future.done():
                future.set_result(None)

    async def wait_for_batch(self, stop: asyncio.Event, timeout_s: float | None = None) -> bool:
        """Waits until a step's worth of complete groups is held (True), or until stopping or
        `timeout_s` passed first (False)."""
        waiter = asyncio.create_task(self._enough.wait())
        stopper = asyncio.create_task(stop.wait())
        await asyncio.wait({waiter, stopper}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()
        stopper.cancel()
        return self._enough.is_set() and not stop.is_set()

    def take(self, training_version: int, max_lag: int, runs: set[str] | None = None) -> tuple[Groups, Groups]:
        """(fresh, stale): one step's groups, oldest versions first (`runs`: only theirs, a batch
        they may not fill); the fresh ones count as trained from now on, so a redelivery arriving
        during the step is a duplicate."""
        self._enough.clear()
        fresh, stale = split_stale(self.collector.take(self.groups_per_step, runs), training_version, max_lag)
        self.collector.trained.add_step(t.trajectory_id for group in fresh for t in group)
        if self.collector.has_batch(self.groups_per_step):
            self._enough.set()
        return fresh, stale

    def discard_incomplete(self, run_id: str) -> Groups:
        """The run's groups still missing members, no longer held: the caller records and releases them."""
        return self.collector.discard_incomplete(run_id)
