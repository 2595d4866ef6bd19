"""The evaluator's statistics and rules: the Wilson interval of a pass rate, the regression rule
(worse than the run's best by more than the interval) and promotion by rule."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from policyloop.contracts.v1 import bus_pb2, loop_pb2
from policyloop.evaluation.scoring import Outcome, environment_score, passed, version_eval, wilson_interval
from policyloop.releases.verdict import judge, promotable, rule_promotes
from policyloop.scorers.score import component


@given(st.integers(0, 10_000).flatmap(lambda n: st.tuples(st.integers(0, n), st.just(n))))
def test_the_wilson_interval_holds_the_rate_within_0_and_1(counts: tuple[int, int]) -> None:
    good, total = counts
    low, high = wilson_interval(good, total)
    rate = good / total if total else 0.5
    assert 0.0 <= low <= rate + 1e-12 and rate - 1e-12 <= high <= 1.0


def test_the_wilson_interval_narrows_with_more_tasks_and_is_never_empty() -> None:
    small, large = wilson_interval(5, 10), wilson_interval(500, 1000)
    assert small[1] - small[0] > large[1] - large[0] > 0
    assert wilson_interval(0, 20)[1] > 0 and wilson_interval(20, 20)[0] < 1
    assert abs(sum(wilson_interval(50, 100)) / 2 - 0.5) < 1e-9  # symmetric at one half


def result(version: int, good: int, total: int = 100) -> loop_pb2.VersionEval:
    return version_eval("r", "policy", version, version, [environment_score(
        "e@1", [Outcome("e@1", 1.0, i < good) for i in range(total)])], seconds=0.0, evaluator="t")


def test_a_version_regresses_only_when_its_whole_interval_is_below_the_best() -> None:
    history = [result(5, 40), result(10, 60), result(15, 55)]
    first = result(5, 40)
    judge(first, [])
    assert not first.regressed and first.best_version == 0
    close = result(20, 52)   # below 0.60, but 0.60 is within its interval (top ~0.62)
    judge(close, history)
    assert close.best_version == 10 and not close.regressed
    worse = result(20, 35)   # its interval's top (~0.45) is below the best's 0.60
    judge(worse, history)
    assert worse.regressed and worse.best_version == 10
    later_only = result(3, 0)
    judge(later_only, history)  # only versions before it count
    assert not later_only.regressed and later_only.best_version == 0


def test_promotion_by_rule_takes_passing_versions_on_its_cadence() -> None:
    ok, bad = result(10, 60), result(12, 10)
    bad.regressed = True
    assert promotable(ok, 0) and promotable(ok, 5) and not promotable(ok, 4)
    assert not promotable(bad, 0)


def test_a_task_passes_when_every_component_of_its_score_passed() -> None:
    exact = bus_pb2.Trajectory(scorer=bus_pb2.Scorer(builtin=bus_pb2.BuiltinVerifier(kind=1), answer="2"))
    assert passed(exact, 1.1, [component("format", 1.0, 0.1, ""), component("exact_answer", 1.0, 1.0, "")])
    assert not passed(exact, 0.1, [component("format", 1.0, 0.1, ""), component("exact_answer", 0.0, 1.0, "")])
    assert not passed(exact, 0.0, [])
    # An environment program's episode passes when the rewards it gave sum to 1 or more.
    program = bus_pb2.Trajectory(scorer=bus_pb2.Scorer(environment_reward=bus_pb2.EnvironmentRewardScorer()))
    assert passed(program, 1.2, [component("turn_0", 0.2, 1.0, ""), component("turn_1", 1.0, 1.0, "")])
    assert not passed(program, 0.2, [component("turn_0", 0.2, 1.0, ""), component("turn_1", 0.0, 1.0, "")])
    # A sample a model scored passes at a reward of 0.5 or more (a sigmoid reward model's P(good)).
    for scorer in (bus_pb2.Scorer(reward_model=bus_pb2.RewardModelScorer(model="rm")),
                   bus_pb2.Scorer(judge=bus_pb2.JudgeScorer(judge="j", template="{response}"))):
        judged = bus_pb2.Trajectory(scorer=scorer)
        assert passed(judged, 0.73, [component("reward_model", 0.73, 1.0, "")])
        assert not passed(judged, 0.27, [component("reward_model", 0.27, 1.0, "")])


def test_a_versions_pass_rate_is_over_all_its_environments_tasks() -> None:
    scores = [environment_score("a@1", [Outcome("a@1", 1.0, True)] * 3 + [Outcome("a@1", 0.0, False)]),
              environment_score("b@1", [Outcome("b@1", 0.0, False)] * 4)]
    total = version_eval("r", "policy", 7, 70, scores, seconds=1.5, evaluator="t")
    assert (scores[0].passed, scores[0].pass_rate, scores[0].mean_reward) == (3, 0.75, 0.75)
    assert total.pass_rate == 3 / 8 and total.pass_rate_low < 3 / 8 < total.pass_rate_high
    assert (total.version, total.step, total.seconds) == (7, 70, 1.5)


def test_the_rule_promotes_only_newer_versions_and_a_rollback_holds() -> None:
    ok = result(40, 60)
    assert rule_promotes(ok, None, 0)
    assert rule_promotes(ok, loop_pb2.Promotion(version=20, reason="rule: ..."), 0)
    assert not rule_promotes(ok, loop_pb2.Promotion(version=40, reason="by hand"), 0)
    assert not rule_promotes(ok, loop_pb2.Promotion(version=20, reason="rollback: bad answers"), 0)
    assert not rule_promotes(ok, loop_pb2.Promotion(version=20, reason="rollback"), 0)
    assert rule_promotes(ok, loop_pb2.Promotion(version=20, reason="by hand after the rollback"), 0)
    assert not rule_promotes(ok, None, 3)  # not a multiple of promote_every
