"""Supervised fine-tuning through the loop's own parts: supervised environments (validated, their
text made exact token ids by the gateway), their tasks fed as demonstrations, and the learner's
cross-entropy step on them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from policyloop.contracts.v1 import bus_pb2, loop_pb2
from policyloop.contracts.validate import InvalidMessage, validate_trajectory
from policyloop.gateway.errors import InvalidField
from policyloop.gateway.feeding import demonstration, nth_item, nth_task
from policyloop.gateway.model_context import load_model_context
from policyloop.gateway.validation import prepare_environment
from policyloop.models.tokenizer import EOS_ID, VOCAB
from policyloop.rl.logprobs import pack, token_logprobs
from policyloop.rl.losses import loss_settings
from policyloop.rl.objective import BatchCounts, objective
from policyloop.rl.trainer import grpo_loss
from tests.helpers import scored_group
from tests.tiny_model import build_tiny_model

IDS = {ch: i for i, ch in enumerate(VOCAB)}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny"))


def supervised_env(*tasks: loop_pb2.TaskSpec, **fields: object) -> loop_pb2.Environment:
    return loop_pb2.Environment(name="demos", version="v1", supervised=True, tasks=list(tasks), **fields)


def test_supervised_objective_is_the_mean_negative_log_likelihood_of_trained_tokens() -> None:
    logprobs = torch.tensor([[-0.5, -1.0, -2.0], [-0.25, -4.0, 0.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    counts = BatchCounts(tokens=5.0, sequences=2, width=3)
    result = objective(loss_settings(kind="cross_entropy", normalization="token"), logprobs, mask, mask, counts)
    loss = result.loss
    assert loss.item() == pytest.approx((0.5 + 1.0 + 0.25 + 4.0 + 0.0) / 5)
    assert set(result.statistics) == {"loss", "policy_loss"}  # no ratio, clip or weight to report
    loss.backward()
    assert torch.equal(logprobs.grad, -mask / 5)  # an untrained token gets no gradient
    by_sequence = objective(loss_settings(kind="cross_entropy", normalization="sequence"), logprobs.detach(), mask,
                            mask, counts).loss
    assert by_sequence.item() == pytest.approx(((0.5 + 1.0) / 2 + (0.25 + 4.0) / 3) / 2)


def test_a_supervised_step_is_cross_entropy_on_the_demonstrations(model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    demos = [[demonstration("r", "demos@v1", loop_pb2.TaskSpec(
        prompt_token_ids=[IDS[c] for c in prompt], demonstration_token_ids=[IDS[c] for c in answer] + [EOS_ID]), i)]
        for i, (prompt, answer) in enumerate([("1+2=", "3"), ("12+30=", "42")])]
    step = grpo_loss(model, demos, loss_settings(), pad_id=0, device=torch.device("cpu"))
    samples = [g[0] for g in demos]
    batch = pack([list(t.prompt_token_ids) for t in samples], [list(t.response_token_ids) for t in samples])
    with torch.no_grad():
        expected = -(token_logprobs(model, batch) * batch.response_mask).sum() / batch.response_mask.sum()
    assert step.loss.item() == pytest.approx(expected.item(), rel=1e-5)
    assert step.tokens == 2 + 3 and step.samples == 2
    with pytest.raises(ValueError, match="not both"):
        grpo_loss(model, [demos[0], scored_group("x", size=1)], loss_settings(), pad_id=0, device=torch.device("cpu"))


def test_a_demonstration_is_a_valid_trajectory_and_its_rules_are_enforced() -> None:
    demo = demonstration("r", "d@1", loop_pb2.TaskSpec(prompt_token_ids=[5, 6], demonstration_token_ids=[7, 8]), 3)
    validate_trajectory(demo)
    assert demo.trajectory_id == "r:000000003/0" and demo.scored and list(demo.loss_mask) == [True, True]
    # A multi-turn demonstration (an agent's session) trains only where the model wrote.
    turns = demonstration("r", "d@1", loop_pb2.TaskSpec(prompt_token_ids=[5], demonstration_token_ids=[7, 8, 9],
                                                        demonstration_loss_mask=[True, False, True]), 4)
    validate_trajectory(turns)
    assert list(turns.loss_mask) == [True, False, True]
    for spoil, field in [
        (lambda t: t.behaviour_logprobs.extend([0.0, 0.0]), "behaviour_logprobs"),
        (lambda t: t.version_spans.add(start=0, end=2, version=1), "version_spans"),
        (lambda t: setattr(t, "group_size", 2), "group_size"),
        (lambda t: t.ClearField("response_token_ids") or t.ClearField("loss_mask"), "response_token_ids"),
    ]:
        spoiled = bus_pb2.Trajectory()
        spoiled.CopyFrom(demo)
        spoil(spoiled)
        with pytest.raises(InvalidMessage) as refused:
            validate_trajectory(spoiled)
        assert refused.value.field == field


def test_a_run_of_a_supervised_environment_feeds_demonstrations_deterministically() -> None:
    env = supervised_env(loop_pb2.TaskSpec(prompt_token_ids=[5], demonstration_token_ids=[6, 7]))
    sampled = loop_pb2.Environment(name="sums", version="v1", tasks=[loop_pb2.TaskSpec(prompt_text="1+1=")],
                                   builtin=loop_pb2.BuiltinVerifier(kind=loop_pb2.BuiltinVerifier.KIND_REGEX,
                                                                    pattern="2"))
    request = loop_pb2.StartRunRequest(environments=[loop_pb2.EnvironmentMix(environment="demos@v1", weight=1),
                                                     loop_pb2.EnvironmentMix(environment="sums@v1", weight=1)])
    envs = {"demos@v1": env, "sums@v1": sampled}
    items = [nth_item("r", request, envs, i) for i in range(40)]
    again = [nth_item("r", request, envs, i) for i in range(40)]
    assert [(i.task_id, i.sampling.seed) for i in items if isinstance(i, bus_pb2.Task)] == \
        [(i.task_id, i.sampling.seed) for i in again if isinstance(i, bus_pb2.Task)]
    demos = [i for i in items if isinstance(i, bus_pb2.Trajectory)]
    assert demos and all(isinstance(i, bus_pb2.Task) for i in items if i not in demos)
    assert [d.trajectory_id for d in demos] == [d.trajectory_id for d in again if isinstance(d, bus_pb2.Trajectory)]
    assert all(list(d.response_token_ids) == [6, 7] and d.supervised for d in demos)
    index = next(i for i, item in enumerate(items) if isinstance(item, bus_pb2.Trajectory))
    with pytest.raises(ValueError, match="demonstration"):
        nth_task("r", request, envs, index)


def test_the_gateway_makes_text_demonstrations_exact_ids_ending_with_eos(model_dir: Path) -> None:
    model = load_model_context(model_dir)
    env = supervised_env(loop_pb2.TaskSpec(prompt_text="1+2=", demonstration_text="3"),
                         loop_pb2.TaskSpec(prompt_token_ids=[IDS["4"]], demonstration_token_ids=[IDS["5"]]))
    prepare_environment(env, model)
    assert list(env.tasks[0].prompt_token_ids) == [IDS[c] for c in "1+2="]
    assert list(env.tasks[0].demonstration_token_ids) == [IDS["3"], EOS_ID]
    assert list(env.tasks[1].demonstration_token_ids) == [IDS["5"]]  # ids are taken as given
    assert not env.HasField("builtin")  # without eval tasks it needs no scorer


# (a supervised environment spoiled, the field the refusal names)
REFUSALS = [
    (supervised_env(loop_pb2.TaskSpec(prompt_text="1+2=")), "environment.tasks[0].demonstration_text"),
    (supervised_env(loop_pb2.TaskSpec(prompt_text="1+2=", demonstration_text="3", demonstration_token_ids=[4])),
     "environment.tasks[0].demonstration_text"),
    (supervised_env(loop_pb2.TaskSpec(prompt_token_ids=[4], demonstration_token_ids=[-1])),
     "environment.tasks[0].demonstration_token_ids"),
    (supervised_env(loop_pb2.TaskSpec(prompt_token_ids=[4], demonstration_token_ids=[10_000])),
     "environment.tasks[0].demonstration_token_ids"),
    (supervised_env(loop_pb2.TaskSpec(prompt_token_ids=[4], demonstration_token_ids=[5] * 300)),
     "environment.tasks[0].demonstration_token_ids"),
    (supervised_env(loop_pb2.TaskSpec(prompt_token_ids=[4], demonstration_token_ids=[5]), max_turns=2,
                    tools=["python"]), "environment.max_turns"),
    (supervised_env(loop_pb2.TaskSpec(prompt_token_ids=[4], demonstration_token_ids=[5]),
                    eval_tasks=[loop_pb2.TaskSpec(prompt_text="1+1=", answer="2")]), "environment.scorer"),
    (supervised_env(loop_pb2.TaskSpec(prompt_token_ids=[4], demonstration_token_ids=[5]),
                    builtin=loop_pb2.BuiltinVerifier(kind=loop_pb2.BuiltinVerifier.KIND_EXACT_ANSWER),
                    eval_tasks=[loop_pb2.TaskSpec(prompt_text="1+1=", answer="2", demonstration_token_ids=[6])]),
     "environment.eval_tasks[0].demonstration_token_ids"),
    (loop_pb2.Environment(name="sums", version="v1", builtin=loop_pb2.BuiltinVerifier(
        kind=loop_pb2.BuiltinVerifier.KIND_REGEX, pattern="2"), tasks=[loop_pb2.TaskSpec(
            prompt_text="1+1=", demonstration_text="2")]), "environment.tasks[0].demonstration_text"),
    (supervised_env(loop_pb2.TaskSpec(prompt_token_ids=[4], demonstration_token_ids=[5, 6],
                                      demonstration_loss_mask=[True])), "environment.tasks[0].demonstration_loss_mask"),
    (supervised_env(loop_pb2.TaskSpec(prompt_token_ids=[4], demonstration_token_ids=[5, 6],
                                      demonstration_loss_mask=[False, False])),
     "environment.tasks[0].demonstration_loss_mask"),
]


@pytest.mark.parametrize(("env", "field"), REFUSALS)
def test_a_spoiled_supervised_environment_is_refused_naming_the_field(
        env: loop_pb2.Environment, field: str, model_dir: Path) -> None:
    with pytest.raises(InvalidField) as refused:
        prepare_environment(env, load_model_context(model_dir))
    assert refused.value.field == field


def test_text_demonstrations_need_the_models_tokenizer() -> None:
    env = supervised_env(loop_pb2.TaskSpec(prompt_token_ids=[4], demonstration_text="3"))
    with pytest.raises(InvalidField) as refused:
        prepare_environment(env, None)
    assert refused.value.field == "environment.tasks[0].demonstration_text"
    given = supervised_env(loop_pb2.TaskSpec(prompt_token_ids=[4], demonstration_token_ids=[5]))
    prepare_environment(given, None)  # ids need no tokenizer


def test_demonstrations_wait_for_a_full_step_of_their_own() -> None:
    """A step's batch is one kind: demonstrations do not share a step with samples, and do not
    make a short step of their own because samples completed among them."""
    from policyloop.rl.batching import GroupCollector

    def demo(i: int) -> bus_pb2.Trajectory:
        return demonstration("r", "d@1", loop_pb2.TaskSpec(prompt_token_ids=[5], demonstration_token_ids=[6]), i)

    collector = GroupCollector()
    for i in range(3):
        collector.add(demo(i))
    for traj in scored_group("rl", size=2):
        collector.add(traj)
    assert collector.complete_groups == 4 and not collector.has_batch(4)
    collector.add(demo(3))
    assert collector.has_batch(4)
    taken = collector.take(4)
    assert [g[0].trajectory_id for g in taken] == [demo(i).trajectory_id for i in range(4)]
    assert collector.complete_groups == 1 and collector.has_batch(1) and not collector.has_batch(2)
    for task in ("a", "b"):
        for traj in scored_group(task, size=2):
            collector.add(traj)
    collector.add(demo(4))
    assert [g[0].task_id for g in collector.take(3)] == ["rl", "a", "b"]  # the samples' full batch
    assert [g[0].trajectory_id for g in collector.take(3)] == [demo(4).trajectory_id]  # no full batch: what is held


def test_a_run_of_demonstrations_feeds_a_multiple_of_the_learners_batch() -> None:
    from policyloop.gateway.feeding import tasks_total

    demos = supervised_env(*[loop_pb2.TaskSpec(prompt_token_ids=[5], demonstration_token_ids=[6])] * 5)
    sums = loop_pb2.Environment(name="sums", version="v1", tasks=[loop_pb2.TaskSpec(prompt_text="1+1=")] * 5)
    envs = {"demos@v1": demos, "sums@v1": sums}

    def run(*names: str, num_tasks: int = 0) -> loop_pb2.StartRunRequest:
        return loop_pb2.StartRunRequest(num_tasks=num_tasks, environments=[
            loop_pb2.EnvironmentMix(environment=n, weight=1) for n in names])

    assert tasks_total(run("demos@v1"), envs, batch=4) == 8
    assert tasks_total(run("demos@v1", num_tasks=9), envs, batch=4) == 12
    assert tasks_total(run("demos@v1", num_tasks=8), envs, batch=4) == 8
    assert tasks_total(run("demos@v1", "sums@v1"), envs, batch=4) == 10  # samples finish their own batches
    assert tasks_total(run("demos@v1"), envs) == 5  # no learner known yet


def test_the_learner_names_what_the_model_cannot_train_on() -> None:
    from policyloop.rl.batching import ModelLimits

    limits = ModelLimits(vocab_size=20, context_tokens=6)
    fits = demonstration("r", "d@1", loop_pb2.TaskSpec(prompt_token_ids=[5, 6], demonstration_token_ids=[7, 1]), 0)
    assert limits.problem(fits) is None
    outside = demonstration("r", "d@1", loop_pb2.TaskSpec(prompt_token_ids=[5], demonstration_token_ids=[20]), 1)
    assert "vocabulary" in (limits.problem(outside) or "")
    too_long = demonstration("r", "d@1", loop_pb2.TaskSpec(prompt_token_ids=[5] * 4, demonstration_token_ids=[6] * 3),
                             2)
    assert "7 tokens, more than the model's context of 6" == limits.problem(too_long)
    assert ModelLimits(None, None).problem(outside) is None  # a model that says nothing: nothing refused
