"""Turning an engine's answer into a trajectory: every token gets a logprob and a version, or
nothing is recorded."""

from __future__ import annotations

import pytest

from policyloop.contracts.v1 import bus_pb2
from policyloop.engines.protocol import GenerateResult, WeightVersionSpan
from policyloop.rollout.records import EngineResultError, generate_request, group_members, record_response


def result(**kw: object) -> GenerateResult:
    base = dict(rid="t/0", output_ids=[7, 8, 1], output_logprobs=[-0.1, -0.2, -0.3], finish_reason="stop",
                weight_version="4", prompt_tokens=3, completion_tokens=3)
    base.update(kw)
    return GenerateResult(**base)  # type: ignore[arg-type]


def fresh() -> bus_pb2.Trajectory:
    task = bus_pb2.Task(task_id="t", environment="e", prompt_token_ids=[5, 14, 6], group_size=2,
                        sampling=bus_pb2.SamplingParams(max_new_tokens=6, temperature=1.0, seed=10))
    return group_members(task, "r-0")[1]


def test_request_seeds_each_member() -> None:
    task = bus_pb2.Task(task_id="t", environment="e", prompt_token_ids=[5], group_size=2,
                        sampling=bus_pb2.SamplingParams(max_new_tokens=6, seed=10))
    members = group_members(task, "r")
    requests = [generate_request(task, m, [1]) for m in members]
    assert [r.sampling_params.sampling_seed for r in requests] == [10, 11]
    assert (requests[1].rid or "").startswith("t/1#") and requests[0].rid != requests[1].rid
    assert requests[0].sampling_params.stop_token_ids == (1,)


def test_a_good_answer_fills_every_token() -> None:
    traj = fresh()
    record_response(traj, result(), "78")
    assert list(traj.response_token_ids) == [7, 8, 1] and list(traj.loss_mask) == [True] * 3
    assert [(s.version, s.start, s.end) for s in traj.version_spans] == [(4, 0, 3)]
    assert traj.finish_reason == bus_pb2.FINISH_REASON_STOP and traj.response_text == "78"
    straddled = fresh()
    record_response(straddled, result(weight_versions=[WeightVersionSpan("3", 0, 1), WeightVersionSpan("4", 1, 3)]),
                    "78")
    assert [(s.version, s.start, s.end) for s in straddled.version_spans] == [(3, 0, 1), (4, 1, 3)]


@pytest.mark.parametrize(("bad", "field"), [
    ({"output_logprobs": None}, "output_token_logprobs"),
    ({"output_logprobs": [-0.1]}, "output_token_logprobs"),
    ({"weight_version": ""}, "weight_version"),
    ({"weight_versions": [WeightVersionSpan("3", 0, 1), WeightVersionSpan("4", 2, 3)]}, "weight_versions"),
    ({"weight_versions": [WeightVersionSpan("3", 0, 2)]}, "weight_versions"),
])
def test_a_bad_answer_is_refused_and_records_nothing(bad: dict, field: str) -> None:
    traj = fresh()
    before = traj.SerializeToString()
    with pytest.raises(EngineResultError, match=field):
        record_response(traj, result(**bad), "78")
    assert traj.SerializeToString() == before


def test_an_answer_without_integer_versions_is_refused_before_anything_is_recorded() -> None:
    """SGLang reports "default" until it is told a version: such a sample has no policy version."""
    for result in (
        GenerateResult(rid="a", output_ids=[7, 1], output_logprobs=[-0.5, -0.1], finish_reason="stop",
                       weight_version="default", prompt_tokens=2, completion_tokens=2),
        GenerateResult(rid="a", output_ids=[7, 1], output_logprobs=[-0.5, -0.1], finish_reason="stop",
                       weight_version="1", prompt_tokens=2, completion_tokens=2,
                       weight_versions=[WeightVersionSpan("default", 0, 1), WeightVersionSpan("1", 1, 2)]),
    ):
        traj = bus_pb2.Trajectory(trajectory_id="a/0")
        with pytest.raises(EngineResultError, match="weight_version"):
            record_response(traj, result, "7")
        assert not traj.response_token_ids and not traj.version_spans


def test_a_task_no_engine_takes_is_refused_naming_the_setting() -> None:
    from policyloop.rollout.records import TaskRequestError

    task = bus_pb2.Task(task_id="t", environment="e", prompt_token_ids=[5], group_size=1,
                        sampling=bus_pb2.SamplingParams(max_new_tokens=6, top_k=-5))
    with pytest.raises(TaskRequestError, match=r"top_k: must be -1 or >= 1"):
        generate_request(task, group_members(task, "r")[0], [1])
