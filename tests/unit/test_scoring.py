"""The reward service's verifiers."""

from __future__ import annotations

import re

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


def test_a_run_asking_for_what_the_learner_does_not_do_is_refused() -> None:
    from policyloop.contracts.v1 import loop_pb2
    from policyloop.envs.validation import FailedPrecondition, InvalidField, check_run_against_learner

    learner = {"model": "policy", "max_lag": 1, "loss": {"loss": "ppo", "tis_cap": 2.0, "kl_coef": 0.0}}

    def run(**fields: object) -> loop_pb2.StartRunRequest:
        return loop_pb2.StartRunRequest(environments=[loop_pb2.EnvironmentMix(environment="a@v1", weight=1)],
                                        **fields)

    check_run_against_learner(run(), learner)  # nothing asked: the cluster's settings
    check_run_against_learner(run(model="policy", max_lag=1, loss={"loss": "ppo", "tis_cap": "2"}), learner)
    for request, field in [(run(max_lag=0), "max_lag"), (run(max_lag=-1), "max_lag"), (run(model="other"), "model"),
                           (run(loss={"loss": "gspo"}), "loss[loss]"), (run(loss={"tis_cap": "3"}), "loss[tis_cap]"),
                           (run(loss={"kl_coef": "x"}), "loss[kl_coef]")]:
        with pytest.raises(FailedPrecondition, match=rf"^{re.escape(field)}:"):
            check_run_against_learner(request, learner)
    with pytest.raises(InvalidField, match=r"^loss\[lr\]: not a learner loss setting"):
        check_run_against_learner(run(loss={"lr": "1"}), None)  # names are checked with no learner up
    check_run_against_learner(run(max_lag=5, loss={"loss": "gspo"}), None)


def test_the_harness_runs_each_top_level_test_function_once() -> None:
    from policyloop.envs.code import test_functions

    source = "def test_b():\n    pass\ndef test_a():\n    pass\ndef test_a():\n    pass\n" \
             "async def test_async():\n    pass\ntest_assigned = lambda: None\ndef helper():\n    pass\n" \
             "class TestThing:\n    def test_method(self):\n        pass\n"
    assert test_functions(source) == ["test_a", "test_b"]
    with pytest.raises(SyntaxError):
        test_functions("def test_x(:\n    pass")
