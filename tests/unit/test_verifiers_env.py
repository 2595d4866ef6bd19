"""verifiers environments before they run: the CLI's tasks are the environment's dataset rows (read
with the official library), the gateway refuses a malformed one naming the field, and the session's
job installs the pinned verifiers beside the environment's own files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from policyloop.cluster.client import build_environment, read_verifiers
from policyloop.contracts.v1 import bus_pb2, loop_pb2
from policyloop.contracts.validate import validate_task
from policyloop.envs.verifiers_env import (
    DEFAULT_MEMORY_BYTES,
    DEFAULT_STEP_SECONDS,
    VERIFIERS_REQUIREMENT,
    dataset_tasks,
    row_task,
    verifiers_job,
)
from policyloop.gateway.errors import InvalidField
from policyloop.gateway.feeding import nth_task
from policyloop.gateway.validation import validate_environment

ENVIRONMENTS = Path(__file__).resolve().parents[2] / "examples" / "environments" / "verifiers"
ROW = row_task({"prompt": [{"role": "user", "content": "What is 2 + 3?"}], "answer": "5", "example_id": 0})


def sums_environment(tasks: list[loop_pb2.TaskSpec] | None = None, **fields: object) -> loop_pb2.Environment:
    driver = read_verifiers("vf-sums", ENVIRONMENTS / "vf_sums.py", arguments_json='{"count": 4}')
    for name, value in fields.items():
        if isinstance(value, list):
            getattr(driver, name).extend(value)
        else:
            setattr(driver, name, value)
    return build_environment("sums", "v1", tasks or [ROW], "exact_answer", driver=driver)


def test_the_dataset_rows_are_the_tasks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(ENVIRONMENTS))
    train, held_out = dataset_tasks("vf-sums", {"count": 5, "eval_count": 3})
    assert (len(train), len(held_out)) == (5, 3)
    row = json.loads(train[0].prompt_text)
    # The row as verifiers formats it (the prompt as chat messages), its answer the task's answer.
    assert row["prompt"][-1]["role"] == "user" and row["prompt"][-1]["content"].startswith("What is")
    assert train[0].answer == row["answer"]


def test_a_verifiers_environment_is_scored_by_its_rubric_and_travels_on_each_task() -> None:
    env = sums_environment()
    assert env.WhichOneof("scorer") == "environment_reward" and env.WhichOneof("driver") == "verifiers"
    validate_environment(env)
    run = loop_pb2.StartRunRequest(run_id="r", environments=[loop_pb2.EnvironmentMix(environment="sums@v1", weight=1)])
    task = nth_task("r", run, {"sums@v1": env}, 0)
    assert task.verifiers == env.verifiers and task.prompt_text == ROW.prompt_text
    validate_task(task)


@pytest.mark.parametrize(("fields", "tasks", "field"), [
    ({"environment_id": "vf sums; rm"}, None, "environment.verifiers.environment_id"),
    ({"arguments_json": "[1, 2]"}, None, "environment.verifiers.arguments_json"),
    ({"arguments_json": "{count: 4"}, None, "environment.verifiers.arguments_json"),
    ({"requirements": ["--index-url=http://x"]}, None, "environment.verifiers.requirements[0]"),
    ({"episode_seconds": -1.0}, None, "environment.verifiers.episode_seconds"),
    ({}, [loop_pb2.TaskSpec(prompt_text="What is 2 + 3?")], "environment.tasks[0].prompt_text"),
    ({}, [loop_pb2.TaskSpec(prompt_text='{"question": "2 + 3"}')], "environment.tasks[0].prompt_text"),
])
def test_a_malformed_verifiers_environment_is_refused_naming_its_field(
        fields: dict, tasks: list | None, field: str) -> None:
    with pytest.raises(InvalidField) as refused:
        validate_environment(sums_environment(tasks, **fields))
    assert refused.value.field == field


def test_the_session_installs_the_pinned_verifiers_beside_the_environment() -> None:
    environment = sums_environment().verifiers
    job = verifiers_job(environment, job_id="j", run_id="r")
    assert job.command == ["python3", "-I", "verifiers_worker.py", "vf-sums", '{"count": 4}']
    assert set(job.files) == {"verifiers_worker.py", "env/vf_sums.py"}
    assert list(job.dependencies.requirements) == [VERIFIERS_REQUIREMENT]
    assert job.limits.memory_bytes == DEFAULT_MEMORY_BYTES
    assert job.session.step_seconds == DEFAULT_STEP_SECONDS  # the first exchange loads the environment
    assert job.session.prepared  # forked from a process that loaded it once
    # An environment that names its own verifiers release gets that one, not a second.
    environment.requirements.append("verifiers==0.3.0")
    assert list(verifiers_job(environment, job_id="j", run_id="r").dependencies.requirements) == ["verifiers==0.3.0"]


def test_a_task_naming_no_verifiers_environment_is_refused() -> None:
    task = bus_pb2.Task(task_id="t", environment="sums@v1", group_size=1, prompt_text=ROW.prompt_text,
                        verifiers=bus_pb2.VerifiersEnvironment())
    with pytest.raises(ValueError, match="verifiers.environment_id"):
        validate_task(task)


@pytest.mark.parametrize(("flags", "said"), [
    ([], "TASKS: a JSONL file of tasks"),
    (["--verifiers", "vf-sums", "--env-source", str(ENVIRONMENTS / "vf_sums.py"), "--env-args", "{count: 4"],
     "--env-args: not JSON"),
])
def test_env_submit_refuses_what_names_no_tasks(flags: list[str], said: str) -> None:
    """Refused before any gateway is asked, with what is wrong (exit 2)."""
    from typer.testing import CliRunner

    from policyloop.cli import app

    result = CliRunner().invoke(app, ["env", "submit", "--name", "sums", *flags, "--gateway", "127.0.0.1:9"])
    assert result.exit_code == 2 and said in " ".join(result.output.split()), result.output
