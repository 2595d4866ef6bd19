"""The reward service's verifiers."""

from __future__ import annotations

import pytest

from policyloop.contracts.v1 import bus_pb2
from policyloop.envs.scoring import UnscorableTrajectory, score_trajectory

STOP, LENGTH = bus_pb2.FINISH_REASON_STOP, bus_pb2.FINISH_REASON_LENGTH


def traj(text: str, finish: int = STOP, **metadata: str) -> bus_pb2.Trajectory:
    return bus_pb2.Trajectory(response_text=text, finish_reason=finish, metadata=metadata)


def breakdown(t: bus_pb2.Trajectory) -> dict[str, float]:
    reward, parts = score_trajectory(t)
    assert reward == pytest.approx(sum(p.value * p.weight for p in parts))
    return {p.name: p.value for p in parts}


def test_exact_integer_answer_is_strict() -> None:
    assert score_trajectory(traj("46", scorer="exact_answer", answer="46"))[0] == pytest.approx(1.1)
    assert breakdown(traj("47", scorer="exact_answer", answer="46")) == {"format": 1.0, "exact_answer": 0.0}
    assert breakdown(traj("46 ", scorer="exact_answer", answer="46")) == {"format": 0.0, "exact_answer": 0.0}
    assert breakdown(traj("46", LENGTH, scorer="exact_answer", answer="46")) == {"format": 0.0, "exact_answer": 0.0}


def test_other_verifiers() -> None:
    assert breakdown(traj(" Paris", scorer="exact_answer", answer="Paris"))["exact_answer"] == 1.0
    assert breakdown(traj("3.14", scorer="numeric_tolerance", answer="3.14159", tolerance="0.01"))[
        "within_tolerance"] == 1.0
    assert breakdown(traj("3.2", scorer="numeric_tolerance", answer="3.14159", tolerance="0.01"))[
        "within_tolerance"] == 0.0
    assert breakdown(traj("abc123", scorer="regex", pattern=r"[a-z]+\d+"))["regex"] == 1.0


def test_unscorable_names_what_is_missing() -> None:
    with pytest.raises(UnscorableTrajectory, match="metadata.scorer"):
        score_trajectory(traj("1", scorer="unit_tests"))
    with pytest.raises(UnscorableTrajectory, match="metadata.answer"):
        score_trajectory(traj("1", scorer="exact_answer"))


def test_the_code_environment_is_one_the_gateway_takes() -> None:
    """Its tests come with each task (metadata.tests), with no shared test_code."""
    from policyloop.envs.code import code_environment
    from policyloop.envs.validation import validate_environment

    env = code_environment()
    assert not env.unit_tests.test_code and all(t.metadata["tests"] for t in env.tasks)
    validate_environment(env)
