"""What every scorer returns, and how a trajectory names its scorer."""

from __future__ import annotations

from typing import Protocol

from policyloop.contracts.v1 import bus_pb2

# (reward, breakdown): the reward is the breakdown's sum of value * weight.
Score = tuple[float, list[bus_pb2.RewardComponent]]


class TrajectoryScorer(Protocol):
    async def score(self, traj: bus_pb2.Trajectory) -> Score: ...


class UnscorableTrajectory(ValueError):
    """The trajectory names no scorer this service runs, or lacks what its scorer needs."""


def component(name: str, value: float, weight: float, detail: str) -> bus_pb2.RewardComponent:
    return bus_pb2.RewardComponent(name=name, value=value, weight=weight, detail=detail)


def scorer_kind(scorer: bus_pb2.Scorer) -> str:
    """The registry key of a scorer: a built-in verifier's kind (`exact_answer`,
    `numeric_tolerance`, `regex`), `unit_tests` or `reward_code`; "" when it names none."""
    kind = scorer.WhichOneof("kind")
    if kind == "builtin":
        value = bus_pb2.BuiltinVerifier.Kind.DESCRIPTOR.values_by_number.get(scorer.builtin.kind)
        # A kind from a newer contract than this service's: a name no scorer is registered under.
        name = value.name if value is not None else f"KIND_UNKNOWN_{scorer.builtin.kind}"
        return name.removeprefix("KIND_").lower()
    return kind or ""
