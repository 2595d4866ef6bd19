"""verifiers environments (the official library, pinned) trained unchanged: each episode runs the
environment's own rollout and rubric in a sandbox session, its chat completions answered by the
replica's engine through the session's channel. A tool environment written as its authors write
one (examples/environments/verifiers/vf_adder_tools.py) is submitted with the CLI and trained on the
cluster, its tool results observations the loss never sees (a single-turn one in the slow set's
example job, tests/e2e/test_environment_learning.py). An environment that fails fails its task
with the reason: retried, dead-lettered, never trained."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from policyloop.bus import Bus, tasks_subject
from policyloop.contracts.v1 import bus_pb2
from policyloop.contracts.validate import validate_trajectory
from policyloop.envs.verifiers_env import dataset_tasks
from policyloop.models.chat_format import parse_assistant
from policyloop.sandbox.runner import SandboxUnavailable, check_isolation
from tests.conftest import ServiceLauncher, prebuilt_model
from tests.helpers import checked_tool_turns, stored_samples, submit_and_start, the_one_dead_letter, trained_once

try:
    check_isolation()
except SandboxUnavailable as exc:  # pragma: no cover - depends on the machine
    pytest.skip(f"the sandbox cannot isolate jobs here: {exc}", allow_module_level=True)

ENVIRONMENTS = Path(__file__).resolve().parents[2] / "examples" / "environments" / "verifiers"
MODEL = bus_pb2.Turn.ROLE_MODEL
BROKEN = b"def load_environment():\n    raise FileNotFoundError('orders.parquet')\n"


@pytest.fixture(scope="module")
def chat_model_dir(request: pytest.FixtureRequest) -> Path:
    return prebuilt_model(request.config, "chat")


STEPS, GROUPS_PER_STEP, GROUP_SIZE = 2, 2, 2


@pytest.mark.timeout(420)
async def test_a_verifiers_tool_environment_trains_on_the_cluster(
        bus: Bus, services: ServiceLauncher, chat_model_dir: Path, redis_client) -> None:  # type: ignore[no-untyped-def]
    """Submitted with the CLI (its dataset the tasks, its eval dataset the held-out split), run
    through the gateway: the learner trains on its episodes, each sampled and trained once, with
    the rubric's rewards; its tool results are observations the loss never sees. A broken
    environment's task is retried, then dead-lettered with the reason."""


    loop = await services.start_loop(chat_model_dir, GROUPS_PER_STEP)
    gateway = loop["gateway"]
    await submit_and_start(gateway.ports["grpc"], "adder", [
        "--verifiers", "vf-adder-tools", "--env-source", str(ENVIRONMENTS / "vf_adder_tools.py"),
        "--env-args", '{"count": 12, "eval_count": 4}', "--max-turns", "3", "--max-new-tokens", "64"],
        tasks=12, group_size=GROUP_SIZE, run_id="adder-run", num_tasks=STEPS * GROUPS_PER_STEP)
    # Beside the run, a task of an environment that cannot load.
    [row], _ = dataset_tasks_on_path("vf-adder-tools", {"count": 1, "eval_count": 1})
    broken = bus_pb2.Task(
        task_id="broken", run_id="other", environment="broken@v1", group_size=1, prompt_text=row.prompt_text,
        sampling=bus_pb2.SamplingParams(max_new_tokens=16), max_turns=3,
        scorer=bus_pb2.Scorer(environment_reward=bus_pb2.EnvironmentRewardScorer()),
        verifiers=bus_pb2.VerifiersEnvironment(environment_id="vf_broken", files={"vf_broken.py": BROKEN}))
    await bus.publish(tasks_subject("broken@v1"), broken, "broken")
    episodes = STEPS * GROUPS_PER_STEP * GROUP_SIZE
    await trained_once(bus, redis_client, "adder-run", steps=STEPS, samples=episodes, timeout_s=360)
    tokenizer = AutoTokenizer.from_pretrained(chat_model_dir)
    calls = 0
    for traj in [t for t in await stored_samples(bus, "TRAJECTORIES") if t.run_id == "adder-run"]:
        validate_trajectory(traj)  # turns cover the response; only the model's tokens are trained on
        prompt = tokenizer.decode(traj.prompt_token_ids)
        # The row's question, with the environment's own tools (from its Python functions) offered.
        a, op, b = re.search(r"What is (\d+) ([+-]) (\d+)\?", prompt).groups()
        assert '"name": "add"' in prompt and '"name": "subtract"' in prompt
        model_turns = [t for t in traj.turns if t.role == MODEL]
        assert traj.turns[-1].role == MODEL and 1 <= len(model_turns) <= 3
        # The rubric's reward comes with the last answer: 1 when its last number is the result.
        numbers = re.findall(r"-?\d+", parse_assistant(model_turns[-1].text).content or "")
        result = int(a) + int(b) if op == "+" else int(a) - int(b)
        expected = 1.0 if numbers and numbers[-1] == str(result) else 0.0
        if len(model_turns) < 3 or traj.reward:  # a third turn may be cut by max_turns, unscored
            assert traj.reward == model_turns[-1].reward == expected
        calls += checked_tool_turns(traj, tokenizer.decode)  # the tool results: observations, never trained on
    assert calls >= 1, "the chat model called the environment's tools in none of the episodes"

    letter = await the_one_dead_letter(bus, "broken", timeout_s=180)
    assert "FileNotFoundError" in letter.reason and "orders.parquet" in letter.reason


def dataset_tasks_on_path(environment_id: str, arguments: dict) -> tuple[list, list]:
    """The environment's rows, read with verifiers from the examples (verifiers wants the main thread)."""
    sys.path.insert(0, str(ENVIRONMENTS))
    try:
        return dataset_tasks(environment_id, arguments)
    finally:
        sys.path.remove(str(ENVIRONMENTS))
