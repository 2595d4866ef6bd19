"""Scorers keyed by the kind of a trajectory's typed scorer (`score.scorer_kind`): those of
scorers.kinds that run here, the code scorers as sandbox jobs, and those calling a model."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from policyloop.contracts.v1 import bus_pb2
from policyloop.scorers.kinds import SANDBOXED, SERVED, VERIFIERS
from policyloop.scorers.sandboxed import CodeJob
from policyloop.scorers.score import Score, TrajectoryScorer, UnscorableTrajectory, scorer_kind
from policyloop.scorers.settings import ScorerContext
from policyloop.scorers.verifiers import Verifier

# Runs a job in the sandbox service and returns its result (policyloop.sandbox.client.run_in_sandbox).
RunJob = Callable[[bus_pb2.SandboxJob], Awaitable[bus_pb2.SandboxResult]]


@dataclass(frozen=True)
class LocalScorer:
    """A verifier that runs in this process (no user code: a pure function of the trajectory)."""

    verify: Verifier

    async def score(self, traj: bus_pb2.Trajectory) -> Score:
        return self.verify(traj)


@dataclass(frozen=True)
class SandboxScorer:
    """Code that runs only in the sandbox: build the job, run it there, read its report."""

    build: Callable[[bus_pb2.Trajectory], CodeJob]
    read: Callable[[bus_pb2.Trajectory, CodeJob, bus_pb2.SandboxResult], Score]
    run_job: RunJob

    async def score(self, traj: bus_pb2.Trajectory) -> Score:
        job = self.build(traj)
        return self.read(traj, job, await self.run_job(job.job))


def sandbox_job(traj: bus_pb2.Trajectory) -> CodeJob:
    """The sandbox job that scores `traj` (its scorer is a code scorer)."""
    return SANDBOXED[_code_kind(traj)][0](traj)


def score_result(traj: bus_pb2.Trajectory, job: CodeJob, result: bus_pb2.SandboxResult) -> Score:
    """(reward, breakdown) from the sandbox's result of `job`."""
    return SANDBOXED[_code_kind(traj)][1](traj, job, result)


def _code_kind(traj: bus_pb2.Trajectory) -> str:
    kind = scorer_kind(traj.scorer)
    if kind not in SANDBOXED:
        raise UnscorableTrajectory(f"scorer: {kind or 'none'!r} is not a code scorer")
    return kind


class ScorerRegistry:
    def __init__(self) -> None:
        self._scorers: dict[str, TrajectoryScorer] = {}

    def register(self, kind: str, scorer: TrajectoryScorer) -> None:
        self._scorers[kind] = scorer

    @property
    def kinds(self) -> list[str]:
        return sorted(self._scorers)

    def scorer_for(self, traj: bus_pb2.Trajectory) -> TrajectoryScorer:
        kind = scorer_kind(traj.scorer)
        if not kind:
            raise UnscorableTrajectory("scorer: the trajectory names none (its task was fed without one)")
        if kind not in self._scorers:
            raise UnscorableTrajectory(f"scorer: {kind!r} is not one this service runs ({', '.join(self.kinds)})")
        return self._scorers[kind]

    async def score(self, traj: bus_pb2.Trajectory) -> Score:
        """(reward, breakdown) of `traj`; UnscorableTrajectory when no scorer here can score it."""
        return await self.scorer_for(traj).score(traj)

    async def close(self) -> None:
        """Closes the scorers that hold connections (to a model's engines)."""
        for scorer in self._scorers.values():
            close = getattr(scorer, "close", None)
            if close is not None:
                await close()


def default_registry(run_job: RunJob, context: ScorerContext | None = None) -> ScorerRegistry:
    """The built-in verifiers, the code scorers running their jobs through `run_job`, and the
    scorers calling the models the context's settings name (none reached without them)."""
    registry = ScorerRegistry()
    for kind, verify in VERIFIERS.items():
        registry.register(kind, LocalScorer(verify))
    for kind, (build, read) in SANDBOXED.items():
        registry.register(kind, SandboxScorer(build, read, run_job))
    for kind, build_served in SERVED.items():
        registry.register(kind, build_served(context or ScorerContext()))
    return registry
