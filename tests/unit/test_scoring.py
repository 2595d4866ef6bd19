"""The reward service's scorers: the built-in verifiers, the registry keyed by the typed scorer's
kind, and the gateway's checks of what a run asks of the learner."""

from __future__ import annotations

import re

import pytest

from policyloop.contracts.v1 import bus_pb2
from policyloop.scorers.kinds import verify
from policyloop.scorers.registry import ScorerRegistry, default_registry, sandbox_job
from policyloop.scorers.score import UnscorableTrajectory, scorer_kind

STOP, LENGTH = bus_pb2.FINISH_REASON_STOP, bus_pb2.FINISH_REASON_LENGTH
KIND = bus_pb2.BuiltinVerifier.Kind


def builtin(kind: int, answer: str = "", **parameters: object) -> bus_pb2.Scorer:
    return bus_pb2.Scorer(builtin=bus_pb2.BuiltinVerifier(kind=kind, **parameters), answer=answer)  # type: ignore[arg-type]


def traj(text: str, scorer: bus_pb2.Scorer | None, finish: int = STOP) -> bus_pb2.Trajectory:
    return bus_pb2.Trajectory(trajectory_id="t/0", response_text=text, finish_reason=finish, scorer=scorer)


def breakdown(t: bus_pb2.Trajectory) -> dict[str, float]:
    reward, parts = verify(t)
    assert reward == pytest.approx(sum(p.value * p.weight for p in parts))
    return {p.name: p.value for p in parts}


EXACT_46 = builtin(KIND.KIND_EXACT_ANSWER, "46", pattern=r"-?[0-9]+")  # the arithmetic environment's format


def test_exact_answer_in_the_environments_format_is_strict() -> None:
    assert verify(traj("46", EXACT_46))[0] == pytest.approx(1.1)
    assert breakdown(traj("47", EXACT_46)) == {"format": 1.0, "exact_answer": 0.0}
    assert breakdown(traj("46 ", EXACT_46)) == {"format": 0.0, "exact_answer": 0.0}
    assert breakdown(traj("forty-six", EXACT_46)) == {"format": 0.0, "exact_answer": 0.0}
    assert breakdown(traj("46", EXACT_46, LENGTH)) == {"format": 0.0, "exact_answer": 0.0}


def test_exact_answer_without_a_format_knows_nothing_of_integers() -> None:
    """A general verifier: no environment's format rule applies to an answer that looks numeric."""
    plain = builtin(KIND.KIND_EXACT_ANSWER, "46")
    assert breakdown(traj(" 46\n", plain)) == {"format": 1.0, "exact_answer": 1.0}
    assert breakdown(traj("forty-six", plain)) == {"format": 1.0, "exact_answer": 0.0}
    assert breakdown(traj("46", plain, LENGTH)) == {"format": 0.0, "exact_answer": 0.0}


def test_other_verifiers() -> None:
    assert breakdown(traj(" Paris", builtin(KIND.KIND_EXACT_ANSWER, "Paris")))["exact_answer"] == 1.0
    near = builtin(KIND.KIND_NUMERIC_TOLERANCE, "3.14159", tolerance=0.01)
    assert breakdown(traj("3.14", near))["within_tolerance"] == 1.0
    assert breakdown(traj("3.2", near))["within_tolerance"] == 0.0
    assert breakdown(traj("abc123", builtin(KIND.KIND_REGEX, pattern=r"[a-z]+\d+")))["regex"] == 1.0


def test_the_format_weight_is_the_scorers() -> None:
    weighted = builtin(KIND.KIND_EXACT_ANSWER, "Paris", format_weight=0.5)
    assert verify(traj("Paris", weighted))[0] == pytest.approx(1.5)
    assert verify(traj("Paris", builtin(KIND.KIND_EXACT_ANSWER, "Paris")))[0] == pytest.approx(1.1)  # 0: 0.1


def test_unscorable_names_what_is_missing() -> None:
    with pytest.raises(UnscorableTrajectory, match="^scorer: 'unit_tests' is not a built-in verifier"):
        verify(traj("1", bus_pb2.Scorer(unit_tests=bus_pb2.UnitTestScorer())))
    with pytest.raises(UnscorableTrajectory, match="^scorer.answer: the exact_answer verifier needs it"):
        verify(traj("1", builtin(KIND.KIND_EXACT_ANSWER)))
    with pytest.raises(UnscorableTrajectory, match="^scorer.answer: 'x' is not a number"):
        verify(traj("1", builtin(KIND.KIND_NUMERIC_TOLERANCE, "x")))
    with pytest.raises(UnscorableTrajectory, match="^scorer: 'exact_answer' is not a code scorer"):
        sandbox_job(traj("1", EXACT_46))


def test_scorer_kinds_key_the_registry() -> None:
    assert scorer_kind(EXACT_46) == "exact_answer"
    assert scorer_kind(bus_pb2.Scorer(reward_code=bus_pb2.RewardCodeScorer(source="x"))) == "reward_code"
    assert scorer_kind(bus_pb2.Scorer()) == ""
    assert scorer_kind(builtin(7, "1")) == "unknown_7"  # a kind from a newer contract

    async def never(job: bus_pb2.SandboxJob) -> bus_pb2.SandboxResult:
        raise AssertionError("the built-in verifiers run no sandbox job")

    registry = default_registry(never)
    assert registry.kinds == ["environment_reward", "exact_answer", "judge", "numeric_tolerance", "regex",
                              "reward_code", "reward_model", "unit_tests"]
    assert registry.scorer_for(traj("46", EXACT_46)) is not registry.scorer_for(
        traj("1", bus_pb2.Scorer(unit_tests=bus_pb2.UnitTestScorer())))
    with pytest.raises(UnscorableTrajectory, match="^scorer: the trajectory names none"):
        registry.scorer_for(traj("1", None))
    with pytest.raises(UnscorableTrajectory, match="^scorer: 'unknown_7' is not one this service runs"):
        registry.scorer_for(traj("1", builtin(7, "1")))
    with pytest.raises(UnscorableTrajectory, match="is not one this service runs"):
        ScorerRegistry().scorer_for(traj("46", EXACT_46))


def test_an_environment_reward_is_the_sum_of_its_step_rewards_by_model_turn() -> None:
    scored = bus_pb2.Trajectory(scorer=bus_pb2.Scorer(environment_reward=bus_pb2.EnvironmentRewardScorer()), turns=[
        bus_pb2.Turn(role=bus_pb2.Turn.ROLE_MODEL, reward=0.2), bus_pb2.Turn(role=bus_pb2.Turn.ROLE_ENVIRONMENT),
        bus_pb2.Turn(role=bus_pb2.Turn.ROLE_MODEL), bus_pb2.Turn(role=bus_pb2.Turn.ROLE_ENVIRONMENT),
        bus_pb2.Turn(role=bus_pb2.Turn.ROLE_MODEL, reward=1.0)])
    reward, parts = verify(scored)
    assert reward == pytest.approx(1.2)
    # Each component names the model turn it rewards (the second gave none).
    assert [(p.name, p.value) for p in parts] == [("turn_0", 0.2), ("turn_2", 1.0)]
    assert verify(bus_pb2.Trajectory(scorer=scored.scorer)) == (0.0, [])


async def test_the_registry_scores_by_kind_and_code_scorers_go_to_the_sandbox() -> None:
    jobs: list[bus_pb2.SandboxJob] = []

    async def sandbox(job: bus_pb2.SandboxJob) -> bus_pb2.SandboxResult:
        jobs.append(job)
        nonce = job.stdin.decode().splitlines()[0]
        return bus_pb2.SandboxResult(job_id=job.job_id, stdout=f'\n{nonce} {{"reward": 0.25}}\n'.encode())

    registry = default_registry(sandbox)
    assert (await registry.score(traj("46", EXACT_46)))[0] == pytest.approx(1.1) and not jobs
    coded = traj("x", bus_pb2.Scorer(reward_code=bus_pb2.RewardCodeScorer(source="def reward(p, c, m): ..."),
                                     answer="7"))
    coded.metadata["mine"] = "kept"
    reward, parts = await registry.score(coded)
    assert reward == 0.25 and [p.name for p in parts] == ["reward_code"]
    [job] = jobs
    assert job.files["reward.py"] == b"def reward(p, c, m): ..." and job.limits.wall_seconds == 10.0
    call = job.stdin.decode().splitlines()[1]
    assert '"metadata": {"mine": "kept", "answer": "7"}' in call  # the task's metadata and its answer


def test_the_code_environment_is_one_the_gateway_takes() -> None:
    """Its tests come with each task (metadata.tests), with no shared test_code."""
    from policyloop.envs.code import code_environment
    from policyloop.gateway.validation import validate_environment

    env = code_environment()
    assert not env.unit_tests.test_code and all(t.metadata["tests"] for t in env.tasks)
    validate_environment(env)


def test_a_multi_turn_environment_may_carry_an_eval_split() -> None:
    """The evaluator scores it through the episode loop (tests/integration/test_multiturn.py)."""
    from policyloop.contracts.v1 import loop_pb2
    from policyloop.gateway.validation import validate_environment

    exact = loop_pb2.BuiltinVerifier(kind=loop_pb2.BuiltinVerifier.KIND_EXACT_ANSWER)
    validate_environment(loop_pb2.Environment(
        name="tools", version="v1", max_turns=3, tools=["python"], builtin=exact,
        tasks=[loop_pb2.TaskSpec(prompt_text="<tools>1+2=", answer="3")],
        eval_tasks=[loop_pb2.TaskSpec(prompt_text="<tools>3+4=", answer="7")]))


def test_a_run_asking_for_what_the_learner_does_not_do_is_refused() -> None:
    from policyloop.contracts.v1 import loop_pb2, status_pb2
    from policyloop.gateway.errors import FailedPrecondition, InvalidField
    from policyloop.gateway.validation import check_run_against_learner
    from policyloop.rl.losses import loss_settings, to_proto

    learner = status_pb2.LearnerStatus(loop=status_pb2.LoopConfig(model="policy", max_lag=1), full_model=True,
                                       loss=to_proto(loss_settings(kind="ppo", tis_cap=2.0, kl_coef=0.0)))

    def run(**fields: object) -> loop_pb2.StartRunRequest:
        return loop_pb2.StartRunRequest(environments=[loop_pb2.EnvironmentMix(environment="a@v1", weight=1)],
                                        **fields)

    check_run_against_learner(run(), learner)  # nothing asked: the cluster's settings
    check_run_against_learner(run(model="policy", max_lag=1, loss=loop_pb2.LossSettings(kind="ppo", tis_cap=2)),
                              learner)
    for request, field in [(run(max_lag=0), "max_lag"), (run(max_lag=-1), "max_lag"), (run(model="other"), "model"),
                           (run(loss=loop_pb2.LossSettings(kind="gspo")), "loss.kind"),
                           (run(loss=loop_pb2.LossSettings(tis_cap=3)), "loss.tis_cap"),
                           (run(loss=loop_pb2.LossSettings(beta=0.5)), "loss.beta")]:  # the learner's ppo has none
        with pytest.raises(FailedPrecondition, match=rf"^{re.escape(field)}:"):
            check_run_against_learner(request, learner)
    with pytest.raises(InvalidField, match=r"^loss.beta: not a setting of the ppo loss"):
        check_run_against_learner(run(loss=loop_pb2.LossSettings(kind="ppo", beta=1)), None)  # without a learner
    check_run_against_learner(run(max_lag=5, loss=loop_pb2.LossSettings(kind="gspo")), None)


@pytest.mark.parametrize(("loss", "expected"), [
    ({"clip_low": -0.5}, "greater than or equal to 0"), ({"normalization": "batch"}, "'token'"),
    ({"tis_cap": -1.0}, "equal to 0"), ({"clip_high": float("inf")}, "finite"), ({"constant": float("nan")}, "finite"),
    ({"kind": "adam"}, "one of ppo"), ({"beta": 0.0}, "greater than 0"),
])
def test_a_malformed_loss_value_is_invalid_naming_the_setting_whatever_the_learner_runs(loss: dict, expected: str
                                                                                          ) -> None:
    """Not FAILED_PRECONDITION advising the learner to start with it: no learner takes it."""
    from policyloop.contracts.v1 import loop_pb2, status_pb2
    from policyloop.gateway.errors import FailedPrecondition, InvalidField
    from policyloop.gateway.validation import check_run_against_learner

    request = loop_pb2.StartRunRequest(loss=loop_pb2.LossSettings(**loss))
    learner = status_pb2.LearnerStatus(loop=status_pb2.LoopConfig(model="policy", max_lag=1), full_model=True,
                                       loss=loop_pb2.LossSettings(kind="ppo", clip_low=0.2))
    key = next(iter(loss))
    for running in (learner, None):
        with pytest.raises(InvalidField, match=rf"^loss.{key}: .*({expected}).*got {re.escape(repr(loss[key]))}"
                           ) as refused:
            check_run_against_learner(request, running)
        assert not isinstance(refused.value, FailedPrecondition)


def test_the_harness_runs_each_top_level_test_function_once() -> None:
    from policyloop.contracts.code_scorer import test_functions

    source = "def test_b():\n    pass\ndef test_a():\n    pass\ndef test_a():\n    pass\n" \
             "async def test_async():\n    pass\ntest_assigned = lambda: None\ndef helper():\n    pass\n" \
             "class TestThing:\n    def test_method(self):\n        pass\n"
    assert test_functions(source) == ["test_a", "test_b"]
    with pytest.raises(SyntaxError):
        test_functions("def test_x(:\n    pass")
