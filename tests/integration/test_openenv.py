"""OpenEnv environments through the real rollout and reward services, with the chat model: a real
OpenEnv server (the echo environment the pinned `openenv` library generates with `openenv init`,
served by its own `create_app` under uvicorn, no Docker) driven by the official client, a session
per episode. Its reset is the prompt, the model's prose is the action, the echo comes back as the
observation, and the rewards it gives (0.1 a character, at most 1) land on the model's turns. A server
that cannot be reached fails the task with the reason: retried, then dead-lettered."""

from __future__ import annotations

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
from tests.helpers import eventually, stored, stored_samples

pytest.importorskip("openenv.core", reason="the openenv extra (pip install policyloop[openenv])")

MODEL, ENVIRONMENT = bus_pb2.Turn.ROLE_MODEL, bus_pb2.Turn.ROLE_ENVIRONMENT
ECHO_APP = """from openenv.core.env_server import create_app
from echo_env.models import EchoAction, EchoObservation
from echo_env.server.echo_env_environment import EchoEnvironment
app = create_app(EchoEnvironment, EchoAction, EchoObservation, env_name="echo_env", max_concurrent_envs=16)
"""


@pytest.fixture(scope="module")
def chat_model_dir(request: pytest.FixtureRequest) -> Path:
    return prebuilt_model(request.config, "chat")


@pytest.fixture
def echo_server(tmp_path: Path) -> Iterator[str]:
    """The echo environment as `openenv init` makes it, served on a free port."""
    subprocess.run([sys.executable, "-m", "openenv.cli", "init", "echo_env", "-o", str(tmp_path)], check=True,
                   capture_output=True, timeout=120)
    (tmp_path / "echo_app.py").write_text(ECHO_APP)
    port = free_port()
    with open(tmp_path / "echo.log", "wb") as log:
        server = subprocess.Popen([sys.executable, "-m", "uvicorn", "echo_app:app", "--host", "127.0.0.1",
                                   "--port", str(port)], cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, server)
        yield url
    finally:
        server.kill()
        server.wait(timeout=10)


def _wait_healthy(url: str, server: subprocess.Popen) -> None:  # type: ignore[type-arg]
    import time

    deadline = time.monotonic() + 120
    while server.poll() is None and time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2):
                return
        except OSError:
            time.sleep(0.2)
    raise AssertionError(f"the echo server did not come up (exit {server.poll()})")


def echo_task(task_id: str, base_url: str, seed: int) -> bus_pb2.Task:
    return bus_pb2.Task(
        task_id=task_id, run_id="r", environment="echo@v1", group_size=4, max_turns=2,
        prompt_text="Say something; it is echoed back to you.",
        sampling=bus_pb2.SamplingParams(max_new_tokens=64, temperature=1.0, seed=seed),
        scorer=bus_pb2.Scorer(environment_reward=bus_pb2.EnvironmentRewardScorer()),
        openenv=bus_pb2.OpenEnvServer(base_url=base_url, action_field="message", observation_field="echoed_message",
                                      step_seconds=20))


@pytest.mark.timeout(300)
async def test_an_openenv_server_drives_each_episode_in_a_session_of_its_own(
        bus: Bus, services: ServiceLauncher, chat_model_dir: Path, echo_server: str) -> None:
    reward = services.start("reward")
    rollout = services.start("rollout", env={"POLICYLOOP_MODEL_PATH": str(chat_model_dir), "POLICYLOOP_MAX_LAG": "-1"})
    await services.wait_healthy(reward, rollout, timeout_s=120)
    for seed in range(2):
        await bus.publish(tasks_subject("echo@v1"), echo_task(f"e{seed}", echo_server, seed), f"e{seed}")
    await bus.publish(tasks_subject("echo@v1"), echo_task("gone", f"http://127.0.0.1:{free_port()}", 9), "gone")

    async def all_scored() -> bool:
        return len(await stored_samples(bus, "TRAJECTORIES")) == 4 * 2

    await eventually(all_scored, timeout_s=240, what="every episode scored")
    tokenizer = AutoTokenizer.from_pretrained(chat_model_dir)
    for traj in await stored_samples(bus, "TRAJECTORIES"):
        validate_trajectory(traj)
        prompt = tokenizer.decode(traj.prompt_token_ids)
        # The task's instructions as the system turn, the reset's observation as the user's.
        assert "Say something" in prompt and "Echo Env environment ready!" in prompt
        model_turns = [t for t in traj.turns if t.role == MODEL]
        assert [t.role for t in traj.turns] == [MODEL, ENVIRONMENT, MODEL]  # echo is never done: max_turns ends it
        for turn in model_turns:
            said = parse_assistant(turn.text).content or turn.text
            assert turn.reward == pytest.approx(min(0.1 * len(said), 1.0))  # the echo's reward
        observed = traj.turns[1]
        assert not any(traj.loss_mask[observed.start:observed.end])
        assert (parse_assistant(model_turns[0].text).content or model_turns[0].text) in observed.text
        assert traj.reward == pytest.approx(sum(t.reward for t in model_turns))

    async def dead_lettered() -> bool:
        return len(await stored(bus, "DLQ", bus_pb2.DeadLetter)) == 1

    await eventually(dead_lettered, timeout_s=120, what="the unreachable server's task dead-lettered")
    [letter] = await stored(bus, "DLQ", bus_pb2.DeadLetter)
    assert "OpenEnv server" in letter.reason and "no session" in letter.reason
    with urllib.request.urlopen(f"http://127.0.0.1:{rollout.ports['http']}/metrics", timeout=5) as r:
        assert 'policyloop_environment_failures_total{environment="echo@v1"}' in r.read().decode()
