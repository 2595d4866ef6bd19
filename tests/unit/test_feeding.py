"""A run's i-th task is a pure function of the run, so feeding can resume anywhere."""

from __future__ import annotations

from collections import Counter

from policyloop.contracts.v1 import bus_pb2, loop_pb2
from policyloop.gateway.feeding import nth_task, task_id, tasks_total
from tests.helpers import addition_environment


def run_request(**kw: object) -> loop_pb2.StartRunRequest:
    return loop_pb2.StartRunRequest(environments=[
        loop_pb2.EnvironmentMix(environment="a@1", weight=3.0),
        loop_pb2.EnvironmentMix(environment="b@1", weight=1.0),
    ], seed=5, **kw)  # type: ignore[arg-type]


ENVS = {"a@1": addition_environment(10, seed=1), "b@1": addition_environment(7, seed=2, group_size=2)}


def test_nth_task_is_deterministic_and_ids_are_stable() -> None:
    request = run_request()
    first = [nth_task("r", request, ENVS, i) for i in range(20)]
    again = [nth_task("r", request, ENVS, i) for i in range(20)]
    strip = lambda t: (t.task_id, t.environment, t.prompt_text, t.sampling.seed, dict(t.metadata),  # noqa: E731
                       t.scorer.SerializeToString())
    assert [strip(t) for t in first] == [strip(t) for t in again]
    assert [t.task_id for t in first] == [task_id("r", i) for i in range(20)]
    assert len({t.sampling.seed for t in first}) == 20


def test_mixing_weights_shape_the_draw() -> None:
    counts = Counter(nth_task("r", run_request(), ENVS, i).environment for i in range(2000))
    assert 0.70 < counts["a@1"] / 2000 < 0.80  # weight 3:1


def test_environment_defaults_fill_the_task() -> None:
    task = nth_task("r", run_request(), ENVS, 0)
    env = ENVS[task.environment]
    assert task.group_size == env.group_size
    assert task.sampling.max_new_tokens == env.sampling.max_new_tokens


def test_the_task_carries_its_environments_scorer_typed_and_its_own_answer() -> None:
    task = nth_task("r", run_request(), ENVS, 0)
    env = ENVS[task.environment]
    assert task.scorer.builtin == env.builtin
    assert any(s.prompt_text == task.prompt_text and s.answer == task.scorer.answer for s in env.tasks)
    assert "answer" not in task.metadata and "scorer" not in task.metadata  # metadata is the task's own


def test_code_scorers_travel_with_their_parameters_and_the_tasks_metadata() -> None:
    from policyloop.envs.code import code_environment

    env = code_environment()
    request = loop_pb2.StartRunRequest(environments=[loop_pb2.EnvironmentMix(environment="c@1", weight=1.0)])
    task = nth_task("r", request, {"c@1": env}, 0)
    assert task.scorer.WhichOneof("kind") == "unit_tests" and task.scorer.unit_tests == env.unit_tests
    assert task.metadata["tests"] and task.metadata["solution_prefix"] == task.prompt_text
    env.reward_code.CopyFrom(bus_pb2.RewardCodeScorer(source="def reward(p, c, m):\n    return 1\n"))
    task = nth_task("r", request, {"c@1": env}, 0)
    assert task.scorer.WhichOneof("kind") == "reward_code" and task.scorer.reward_code.source.startswith("def")


def test_tasks_total() -> None:
    assert tasks_total(run_request(), ENVS) == 17
    assert tasks_total(run_request(num_tasks=5), ENVS) == 5


def test_a_task_draws_the_environments_group_size_the_default_for_0_and_one_when_supervised() -> None:
    from policyloop.envs.spec import DEFAULT_GROUP_SIZE, group_size

    assert group_size(loop_pb2.Environment(group_size=3)) == 3
    assert group_size(loop_pb2.Environment()) == DEFAULT_GROUP_SIZE
    assert group_size(loop_pb2.Environment(group_size=3, supervised=True)) == 1
    unset = {"a@1": addition_environment(10, seed=1, group_size=0)}
    assert nth_task("r", loop_pb2.StartRunRequest(environments=[loop_pb2.EnvironmentMix(environment="a@1", weight=1)]),
                    unset, 0).group_size == DEFAULT_GROUP_SIZE
