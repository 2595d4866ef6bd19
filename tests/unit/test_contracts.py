"""The generated code matches protos/, and bus messages are checked beyond decoding."""

from __future__ import annotations

import pytest

from policyloop.contracts.generate import generate, stale_files
from policyloop.contracts.v1 import bus_pb2
from policyloop.contracts.validate import (
    InvalidMessage,
    validate_group,
    validate_sandbox_job,
    validate_scorer,
    validate_task,
    validate_trajectory,
)


def test_committed_generated_code_is_fresh() -> None:
    assert stale_files(generate()) == [], "run `make protos` and commit the result"


def test_stale_files_notices_a_change() -> None:
    files = generate()
    name = sorted(files)[0]
    files[name] += "\n# changed\n"
    assert stale_files(files) == [name]


def trajectory(**kw: object) -> bus_pb2.Trajectory:
    base = dict(trajectory_id="t/0", task_id="t", group_size=2, sample_index=0,
                response_token_ids=[5, 6, 7], behaviour_logprobs=[-0.1, -0.2, -0.3],
                loss_mask=[True, True, False],
                version_spans=[bus_pb2.VersionSpan(version=3, start=0, end=2),
                               bus_pb2.VersionSpan(version=4, start=2, end=3)])
    base.update(kw)
    return bus_pb2.Trajectory(**base)  # type: ignore[arg-type]


def test_valid_trajectory_passes() -> None:
    validate_trajectory(trajectory())
    validate_trajectory(trajectory(response_token_ids=[], behaviour_logprobs=[], loss_mask=[], version_spans=[]))


@pytest.mark.parametrize(("change", "field"), [
    ({"trajectory_id": ""}, "trajectory_id"),
    ({"sample_index": 2}, "sample_index"),
    ({"behaviour_logprobs": [-0.1]}, "behaviour_logprobs"),
    ({"loss_mask": [True]}, "loss_mask"),
    ({"version_spans": [bus_pb2.VersionSpan(version=3, start=0, end=2)]}, "version_spans"),
    ({"version_spans": [bus_pb2.VersionSpan(version=3, start=1, end=3)]}, "version_spans[0]"),
    ({"version_spans": [bus_pb2.VersionSpan(version=3, start=0, end=2),
                        bus_pb2.VersionSpan(version=4, start=1, end=3)]}, "version_spans[1]"),
])
def test_invalid_trajectory_names_the_field(change: dict, field: str) -> None:
    with pytest.raises(InvalidMessage) as err:
        validate_trajectory(trajectory(**change))
    assert err.value.field == field


def group(*members: bus_pb2.Trajectory, group_id: str = "t") -> bus_pb2.TrajectoryGroup:
    return bus_pb2.TrajectoryGroup(group_id=group_id, trajectories=members)


def test_a_whole_group_or_a_part_of_one_passes() -> None:
    validate_group(group(trajectory(group_id="t"), trajectory(trajectory_id="t/1", sample_index=1, group_id="t")))
    validate_group(group(trajectory(trajectory_id="t/1", sample_index=1, group_id="t")))


@pytest.mark.parametrize(("message", "field"), [
    (group(trajectory(group_id="t"), group_id=""), "group_id"),
    (group(), "trajectories"),
    (group(trajectory(group_id="other")), "trajectories[0].group_id"),
    (group(trajectory(group_id="t"), trajectory(group_id="t")), "trajectories[1].sample_index"),
    (group(trajectory(group_id="t", run_id="a"), trajectory(trajectory_id="t/1", sample_index=1, group_id="t",
                                                            run_id="b")), "trajectories[1].run_id"),
    (group(trajectory(group_id="t", environment="e"), trajectory(trajectory_id="t/1", sample_index=1, group_id="t",
                                                                 environment="f")), "trajectories[1].environment"),
    (group(trajectory(group_id="t"), trajectory(trajectory_id="t/1", sample_index=1, group_id="t", loss_mask=[True])),
     "trajectories[1].loss_mask"),
])
def test_an_invalid_group_names_the_member_and_its_field(message: bus_pb2.TrajectoryGroup, field: str) -> None:
    with pytest.raises(InvalidMessage) as err:
        validate_group(message)
    assert err.value.field == field and str(err.value).startswith(f"{field}: ")


def test_task_and_job_checks() -> None:
    validate_task(bus_pb2.Task(task_id="a", environment="e@1", prompt_token_ids=[1], group_size=1))
    with pytest.raises(InvalidMessage, match="group_size"):
        validate_task(bus_pb2.Task(task_id="a", environment="e@1", prompt_text="x"))
    with pytest.raises(InvalidMessage, match="sampling.ignore_eos"):
        validate_task(bus_pb2.Task(task_id="a", environment="e@1", prompt_text="x", group_size=1, max_turns=3,
                                   tools=["python"], sampling=bus_pb2.SamplingParams(ignore_eos=True)))
    with pytest.raises(InvalidMessage, match="leaves the scratch"):
        validate_sandbox_job(bus_pb2.SandboxJob(job_id="j", command=["true"], files={"../x": b""}))
    with pytest.raises(InvalidMessage, match="command"):
        validate_sandbox_job(bus_pb2.SandboxJob(job_id="j"))
    for limits in (bus_pb2.SandboxLimits(wall_seconds=-1), bus_pb2.SandboxLimits(cpu_seconds=float("nan")),
                   bus_pb2.SandboxLimits(wall_seconds=float("inf"))):
        with pytest.raises(InvalidMessage, match=r"limits\.(wall|cpu)_seconds"):
            validate_sandbox_job(bus_pb2.SandboxJob(job_id="j", command=["true"], limits=limits))


KIND = bus_pb2.BuiltinVerifier.Kind


def builtin(kind: int, answer: str = "", **parameters: object) -> bus_pb2.Scorer:
    return bus_pb2.Scorer(builtin=bus_pb2.BuiltinVerifier(kind=kind, **parameters), answer=answer)  # type: ignore[arg-type]


def test_valid_scorers_pass() -> None:
    for scorer in (builtin(KIND.KIND_EXACT_ANSWER, "46"), builtin(KIND.KIND_EXACT_ANSWER, "46", pattern=r"-?[0-9]+"),
                   builtin(KIND.KIND_NUMERIC_TOLERANCE, "3.1", tolerance=0.1),
                   builtin(KIND.KIND_REGEX, pattern=r"\d+"),
                   bus_pb2.Scorer(unit_tests=bus_pb2.UnitTestScorer(test_code="def test_a(): pass")),
                   bus_pb2.Scorer(reward_code=bus_pb2.RewardCodeScorer(source="def reward(p, c, m): return 1",
                                                                       timeout_seconds=3)),
                   bus_pb2.Scorer(reward_model=bus_pb2.RewardModelScorer(
                       model="rm", normalization=bus_pb2.RewardModelScorer.NORMALIZATION_SIGMOID, scale=2, shift=-1)),
                   bus_pb2.Scorer(judge=bus_pb2.JudgeScorer(judge="j", template="Rate {response}", max_score=10)),
                   bus_pb2.Scorer(judge=bus_pb2.JudgeScorer(judge="j", template="{response}", labels={"yes": 1},
                                                            verdict=bus_pb2.JudgeScorer.VERDICT_LABEL))):
        validate_scorer(scorer)
        validate_task(bus_pb2.Task(task_id="a", environment="e@1", prompt_text="x", group_size=1, scorer=scorer))
        validate_trajectory(trajectory(scorer=scorer))
    validate_trajectory(trajectory())  # no scorer is valid: the reward service dead-letters it as unscorable


@pytest.mark.parametrize(("scorer", "field"), [
    (bus_pb2.Scorer(answer="46"), "scorer"),
    (builtin(KIND.KIND_UNSPECIFIED, "46"), "scorer.builtin.kind"),
    (builtin(9, "46"), "scorer.builtin.kind"),
    (builtin(KIND.KIND_EXACT_ANSWER), "scorer.answer"),
    (builtin(KIND.KIND_EXACT_ANSWER, "46", format_weight=float("nan")), "scorer.builtin.format_weight"),
    (builtin(KIND.KIND_NUMERIC_TOLERANCE, "forty"), "scorer.answer"),
    (builtin(KIND.KIND_NUMERIC_TOLERANCE, "46", tolerance=-1), "scorer.builtin.tolerance"),
    (builtin(KIND.KIND_REGEX), "scorer.builtin.pattern"),
    (builtin(KIND.KIND_REGEX, pattern="(unclosed"), "scorer.builtin.pattern"),
    (builtin(KIND.KIND_EXACT_ANSWER, "46", pattern="(unclosed"), "scorer.builtin.pattern"),  # the answer's format
    (bus_pb2.Scorer(unit_tests=bus_pb2.UnitTestScorer(timeout_seconds=float("inf"))),
     "scorer.unit_tests.timeout_seconds"),
    (bus_pb2.Scorer(reward_code=bus_pb2.RewardCodeScorer()), "scorer.reward_code.source"),
    (bus_pb2.Scorer(reward_code=bus_pb2.RewardCodeScorer(source="x", timeout_seconds=-2)),
     "scorer.reward_code.timeout_seconds"),
    (bus_pb2.Scorer(reward_model=bus_pb2.RewardModelScorer()), "scorer.reward_model.model"),
    (bus_pb2.Scorer(reward_model=bus_pb2.RewardModelScorer(model="rm", normalization=5)),  # type: ignore[arg-type]
     "scorer.reward_model.normalization"),
    (bus_pb2.Scorer(reward_model=bus_pb2.RewardModelScorer(model="rm", shift=float("nan"))),
     "scorer.reward_model.shift"),
    (bus_pb2.Scorer(reward_model=bus_pb2.RewardModelScorer(model="rm", timeout_seconds=float("inf"))),
     "scorer.reward_model.timeout_seconds"),
    (bus_pb2.Scorer(judge=bus_pb2.JudgeScorer(template="{response}")), "scorer.judge.judge"),
    (bus_pb2.Scorer(judge=bus_pb2.JudgeScorer(judge="j", template="{prompt}")), "scorer.judge.template"),
    (bus_pb2.Scorer(judge=bus_pb2.JudgeScorer(judge="j", template="{response}", verdict=9)),  # type: ignore[arg-type]
     "scorer.judge.verdict"),
    (bus_pb2.Scorer(judge=bus_pb2.JudgeScorer(judge="j", template="{response}", labels={"yes": float("nan")})),
     "scorer.judge.labels"),
    (bus_pb2.Scorer(judge=bus_pb2.JudgeScorer(judge="j", template="{response}", max_tokens=10**6)),
     "scorer.judge.max_tokens"),
    (bus_pb2.Scorer(judge=bus_pb2.JudgeScorer(judge="j", template="{response}", max_score=float("inf"))),
     "scorer.judge.max_score"),
])
def test_invalid_scorer_names_the_field(scorer: bus_pb2.Scorer, field: str) -> None:
    for validate, message in ((validate_task, bus_pb2.Task(task_id="a", environment="e@1", prompt_text="x",
                                                            group_size=1, scorer=scorer)),
                              (validate_trajectory, trajectory(scorer=scorer))):
        with pytest.raises(InvalidMessage) as err:
            validate(message)  # type: ignore[operator]
        assert err.value.field == field
