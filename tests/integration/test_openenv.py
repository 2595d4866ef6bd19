"""OpenEnv environments trained on the cluster with the chat model: a real OpenEnv server (the
example's sums quiz, examples/environments/openenv/sums_quiz.py, written with the pinned `openenv`
library's Environment and served by its own `create_app` under uvicorn, no Docker) driven by the
official client, a session per episode. It is submitted with the CLI and the learner trains on its
episodes: the reset's question is the prompt, the model's prose is the action, the verdicts come
back as observations the loss never sees, and the rewards the server gives land on the model's
turns. A server that cannot be reached fails its task with the reason: retried, then
dead-lettered, never trained. Beside it, the echo environment the library itself generates
(`openenv init`) runs a group as it comes: its reward, 0.1 a character, lands on each turn."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from policyloop.bus import Bus, tasks_subject
from policyloop.common.ports import free_port
from policyloop.contracts.v1 import bus_pb2
from policyloop.contracts.validate import validate_trajectory
from policyloop.models.chat_format import parse_assistant
from tests.conftest import ServiceLauncher, prebuilt_model
from tests.helpers import (
    eventually,
    openenv_server,
    stored_samples,
    submit_and_start,
    the_one_dead_letter,
    trained_once,
)

pytest.importorskip("openenv.core", reason="the openenv extra (pip install policyloop[openenv])")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "environments" / "openenv"
MODEL, ENVIRONMENT = bus_pb2.Turn.ROLE_MODEL, bus_pb2.Turn.ROLE_ENVIRONMENT
STEPS, GROUPS_PER_STEP, GROUP_SIZE = 2, 2, 4


@pytest.fixture(scope="module")
def chat_model_dir(request: pytest.FixtureRequest) -> Path:
    return prebuilt_model(request.config, "chat")


ECHO_APP = """from openenv.core.env_server import create_app
from echo_env.models import EchoAction, EchoObservation
from echo_env.server.echo_env_environment import EchoEnvironment
app = create_app(EchoEnvironment, EchoAction, EchoObservation, env_name="echo_env", max_concurrent_envs=16)
"""


@pytest.fixture
def quiz_server(tmp_path: Path) -> Iterator[str]:
    with openenv_server(EXAMPLE, "sums_quiz:app", tmp_path) as url:
        yield url


@pytest.fixture
def echo_server(tmp_path: Path) -> Iterator[str]:
    """The echo environment as `openenv init` makes it, served on a free port."""
    subprocess.run([sys.executable, "-m", "openenv.cli", "init", "echo_env", "-o", str(tmp_path)], check=True,
                   capture_output=True, timeout=120)
    (tmp_path / "echo_app.py").write_text(ECHO_APP)
    with openenv_server(tmp_path, "echo_app:app", tmp_path) as url:
        yield url


def last_number(text: str) -> int | None:
    numbers = re.findall(r"-?\d+", text)
    return int(numbers[-1]) if numbers else None


@pytest.mark.timeout(420)
async def test_an_openenv_environment_trains_on_the_cluster(
        bus: Bus, services: ServiceLauncher, chat_model_dir: Path, quiz_server: str, echo_server: str,
        redis_client, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]


    loop = await services.start_loop(chat_model_dir, GROUPS_PER_STEP)
    gateway, rollout = loop["gateway"], loop["rollout"]
    tasks = tmp_path / "quiz.jsonl"
    tasks.write_text("\n".join(json.dumps({"metadata": {"seed": str(seed)}}) for seed in range(12)))
    await submit_and_start(gateway.ports["grpc"], "quiz", [
        str(tasks), "--openenv", quiz_server, "--action-field", "answer", "--observation-field", "message",
        "--max-turns", "2", "--max-new-tokens", "48"], tasks=12, group_size=GROUP_SIZE, run_id="quiz-run",
        num_tasks=STEPS * GROUPS_PER_STEP)
    # Beside the run, a task of a server nobody runs.
    gone = bus_pb2.Task(
        task_id="gone", run_id="other", environment="gone@v1", group_size=1, max_turns=2,
        sampling=bus_pb2.SamplingParams(max_new_tokens=16), metadata={"seed": "1"},
        scorer=bus_pb2.Scorer(environment_reward=bus_pb2.EnvironmentRewardScorer()),
        openenv=bus_pb2.OpenEnvServer(base_url=f"http://127.0.0.1:{free_port()}", action_field="answer",
                                      step_seconds=10))
    await bus.publish(tasks_subject("gone@v1"), gone, "gone")
    episodes = STEPS * GROUPS_PER_STEP * GROUP_SIZE
    await trained_once(bus, redis_client, "quiz-run", steps=STEPS, samples=episodes, timeout_s=300)
    # Once the run is trained (so that its steps are the quiz's alone), a group of the echo environment.
    echo = bus_pb2.Task(
        task_id="echo", run_id="other", environment="echo@v1", group_size=2, max_turns=2,
        prompt_text="Say something; it is echoed back to you.", metadata={"seed": "1"},
        sampling=bus_pb2.SamplingParams(max_new_tokens=32, temperature=1.0),
        scorer=bus_pb2.Scorer(environment_reward=bus_pb2.EnvironmentRewardScorer()),
        openenv=bus_pb2.OpenEnvServer(base_url=echo_server, action_field="message",
                                      observation_field="echoed_message", step_seconds=20))
    await bus.publish(tasks_subject("echo@v1"), echo, "echo")
    tokenizer = AutoTokenizer.from_pretrained(chat_model_dir)
    for traj in [t for t in await stored_samples(bus, "TRAJECTORIES") if t.run_id == "quiz-run"]:
        validate_trajectory(traj)  # turns cover the response; only the model's tokens are trained on
        # The reset's observation, the question, is the user's turn.
        a, op, b = re.search(r"What is (\d) ([+-]) (\d)\?", tokenizer.decode(traj.prompt_token_ids)).groups()
        result = int(a) + int(b) if op == "+" else int(a) - int(b)
        model_turns = [t for t in traj.turns if t.role == MODEL]
        replies = [parse_assistant(t.text).content or t.text for t in model_turns]
        # The server's rule, recomputed: 0.75 for the right answer, 0.25 for the expression
        # restated; the second try counts half. Right: done.
        rights = [last_number(reply) == result for reply in replies]
        assert [t.reward for t in model_turns] == pytest.approx([
            weight * (0.75 * right + 0.25 * (f"{a} {op} {b}" in reply))
            for weight, right, reply in zip((1.0, 0.5), rights, replies, strict=False)])
        # Right at the first try: done. Else a second try, unless the first used the token budget up.
        assert len(model_turns) == 1 if rights[0] else 1 <= len(model_turns) <= 2
        assert traj.reward == pytest.approx(sum(t.reward for t in model_turns))
        if len(model_turns) == 2:  # the verdict: an observation, never trained on
            verdict = traj.turns[1]
            assert verdict.role == ENVIRONMENT and f"No. Try again: What is {a} {op} {b}?" in verdict.text
            assert not any(traj.loss_mask[verdict.start:verdict.end])

    async def echoed() -> bool:
        return len([t for t in await stored_samples(bus, "TRAJECTORIES") if t.task_id == "echo"]) == 2

    await eventually(echoed, timeout_s=120, what="the echo environment's group scored")
    for traj in [t for t in await stored_samples(bus, "TRAJECTORIES") if t.task_id == "echo"]:
        validate_trajectory(traj)
        # The task's instructions as the system turn, the reset's observation as the user's.
        assert "Say something" in tokenizer.decode(traj.prompt_token_ids)
        # Never done: max_turns ends it (or the token budget, when the first turn used it up).
        assert [t.role for t in traj.turns] in ([MODEL, ENVIRONMENT, MODEL], [MODEL])
        for turn in traj.turns[::2]:
            said = parse_assistant(turn.text).content or turn.text
            assert turn.reward == pytest.approx(min(0.1 * len(said), 1.0))  # the echo's reward
        if len(traj.turns) == 3:
            assert (parse_assistant(traj.turns[0].text).content or traj.turns[0].text) in traj.turns[1].text

    letter = await the_one_dead_letter(bus, "gone", timeout_s=120)
    assert "OpenEnv server" in letter.reason and "no session" in letter.reason
    with urllib.request.urlopen(f"http://127.0.0.1:{rollout.ports['http']}/metrics", timeout=5) as r:
        assert 'policyloop_environment_failures_total{environment="gone@v1"}' in r.read().decode()
