"""verifiers environments (the official library, pinned) trained unchanged: each episode runs the
environment's own rollout and rubric in a sandbox session, its chat completions answered by the
replica's engine through the session's channel. Two environments written as their authors write
them (examples/environments/verifiers): a single-turn one submitted with the CLI and trained on the
cluster, and a tool environment whose tool results are observations the loss never sees. An
environment that fails fails its task with the reason: retried, dead-lettered, never trained."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
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
from tests.helpers import eventually, stored, stored_samples

try:
    check_isolation()
except SandboxUnavailable as exc:  # pragma: no cover - depends on the machine
    pytest.skip(f"the sandbox cannot isolate jobs here: {exc}", allow_module_level=True)

ENVIRONMENTS = Path(__file__).resolve().parents[2] / "examples" / "environments" / "verifiers"
MODEL, ENVIRONMENT = bus_pb2.Turn.ROLE_MODEL, bus_pb2.Turn.ROLE_ENVIRONMENT
BROKEN = b"def load_environment():\n    raise FileNotFoundError('orders.parquet')\n"


@pytest.fixture(scope="module")
def chat_model_dir(request: pytest.FixtureRequest) -> Path:
    return prebuilt_model(request.config, "chat")


def tool_task(task_id: str, row: str, answer: str, environment: bus_pb2.VerifiersEnvironment) -> bus_pb2.Task:
    return bus_pb2.Task(
        task_id=task_id, run_id="r", environment="adder@v1", group_size=2, prompt_text=row,
        sampling=bus_pb2.SamplingParams(max_new_tokens=64, temperature=1.0, seed=len(task_id)), max_turns=3,
        scorer=bus_pb2.Scorer(answer=answer, environment_reward=bus_pb2.EnvironmentRewardScorer()),
        verifiers=environment)


@pytest.mark.timeout(360)
async def test_a_verifiers_tool_environment_runs_its_own_rollout_in_a_session(
        bus: Bus, services: ServiceLauncher, chat_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sandbox, reward = services.start("sandbox"), services.start("reward")
    rollout = services.start("rollout", env={"POLICYLOOP_MODEL_PATH": str(chat_model_dir), "POLICYLOOP_MAX_LAG": "-1"})
    await services.wait_healthy(sandbox, reward, rollout, timeout_s=120)
    monkeypatch.syspath_prepend(str(ENVIRONMENTS))
    rows, _ = dataset_tasks("vf-adder-tools", {}, count=3, eval_count=1)  # verifiers wants the main thread
    adder = bus_pb2.VerifiersEnvironment(environment_id="vf-adder-tools",
                                         files={"vf_adder_tools.py": (ENVIRONMENTS / "vf_adder_tools.py").read_bytes()})
    for i, row in enumerate(rows):
        await bus.publish(tasks_subject("adder@v1"), tool_task(f"a{i}", row.prompt_text, row.answer, adder), f"a{i}")
    broken = bus_pb2.VerifiersEnvironment(environment_id="vf_broken", files={"vf_broken.py": BROKEN})
    await bus.publish(tasks_subject("adder@v1"), tool_task("broken", rows[0].prompt_text, "0", broken), "broken")

    async def all_scored() -> bool:
        return len(await stored_samples(bus, "TRAJECTORIES")) == 2 * len(rows)

    await eventually(all_scored, timeout_s=300, what="every episode scored")
    tokenizer = AutoTokenizer.from_pretrained(chat_model_dir)
    calls = 0
    questions = {f"a{i}": json.loads(row.prompt_text)["prompt"][-1]["content"] for i, row in enumerate(rows)}
    for traj in await stored_samples(bus, "TRAJECTORIES"):
        validate_trajectory(traj)  # turns cover the response; only the model's tokens are trained on
        prompt = tokenizer.decode(traj.prompt_token_ids)
        # The row's question, with the environment's own tools (from its Python functions) offered.
        assert questions[traj.task_id] in prompt and '"name": "add"' in prompt
        model_turns = [t for t in traj.turns if t.role == MODEL]
        assert traj.turns[-1].role == MODEL and 1 <= len(model_turns) <= 3
        # The rubric's reward (0 or 1) comes with the last answer, and is the trajectory's.
        assert model_turns[-1].HasField("reward") and traj.reward in (0.0, 1.0)
        assert traj.reward == model_turns[-1].reward
        for turn in traj.turns:
            if turn.role == ENVIRONMENT:
                calls += 1
                assert not any(traj.loss_mask[turn.start:turn.end])
                text = tokenizer.decode(traj.response_token_ids[turn.start:turn.end])
                # The tool's result, computed by the environment's own `add`/`subtract`.
                assert text == turn.text and "<tool_response>" in text and text.endswith("<|im_start|>assistant\n")
            else:
                assert all(traj.loss_mask[turn.start:turn.end])
        before_env = [b for b, t in zip(traj.turns, traj.turns[1:], strict=False) if t.role == ENVIRONMENT]
        assert all(parse_assistant(t.text).tool_calls for t in before_env)
    assert calls >= 1, "the chat model called the environment's tools in none of the episodes"

    async def dead_lettered() -> bool:
        return len(await stored(bus, "DLQ", bus_pb2.DeadLetter)) == 1

    await eventually(dead_lettered, timeout_s=180, what="the broken environment's task dead-lettered")
    [letter] = await stored(bus, "DLQ", bus_pb2.DeadLetter)
    assert "FileNotFoundError" in letter.reason and "orders.parquet" in letter.reason
    assert all(t.task_id != "broken" for t in await stored_samples(bus, "ROLLOUTS"))


STEPS, GROUPS_PER_STEP = 2, 2


@pytest.mark.timeout(420)
async def test_a_verifiers_environment_trains_on_the_cluster(
        bus: Bus, services: ServiceLauncher, chat_model_dir: Path, redis_client) -> None:  # type: ignore[no-untyped-def]
    """Submitted with the CLI (its dataset the tasks, its eval dataset the held-out split), run
    through the gateway: the learner trains on its episodes, each sampled and trained once, with
    the rubric's rewards."""
    import grpc

    from policyloop.contracts.v1 import loop_pb2, loop_pb2_grpc
    from policyloop.ledger import audit_bus
    from policyloop.state import VersionRegistry

    loop = await services.start_loop(chat_model_dir, GROUPS_PER_STEP)
    gateway = loop["gateway"]
    submitted = await asyncio.to_thread(subprocess.run, [
        sys.executable, "-m", "policyloop", "env", "submit", "--name", "sums", "--verifiers", "vf-sums",
        "--env-source", str(ENVIRONMENTS / "vf_sums.py"), "--env-args", '{"count": 12, "eval_count": 4}',
        "--max-new-tokens", "24", "--group-size", "2", "--gateway", f"127.0.0.1:{gateway.ports['grpc']}"],
        capture_output=True, text=True, timeout=120)
    assert submitted.returncode == 0, submitted.stdout + submitted.stderr
    assert json.loads(submitted.stdout) == {"environment": "sums@v1", "tasks": 12, "group_size": 2, "created": True}
    async with grpc.aio.insecure_channel(f"127.0.0.1:{gateway.ports['grpc']}") as channel:
        await loop_pb2_grpc.LoopServiceStub(channel).StartRun(loop_pb2.StartRunRequest(
            run_id="sums-run", num_tasks=STEPS * GROUPS_PER_STEP,
            environments=[loop_pb2.EnvironmentMix(environment="sums@v1", weight=1)]))
    versions = VersionRegistry(redis_client, "default")

    async def trained() -> bool:
        return (await versions.get("policy") or 0) >= STEPS

    await eventually(trained, timeout_s=360, what=f"{STEPS} learner steps on the environment's episodes")
    audited = await audit_bus(bus, "sums-run")
    assert (audited.generated, audited.trained, audited.lost, audited.trained_twice) == (
        STEPS * GROUPS_PER_STEP * 2, STEPS * GROUPS_PER_STEP * 2, 0, 0)
    tokenizer = AutoTokenizer.from_pretrained(chat_model_dir)
    episodes = [t for t in await stored_samples(bus, "TRAJECTORIES") if t.run_id == "sums-run"]
    assert len(episodes) == STEPS * GROUPS_PER_STEP * 2
    for traj in episodes:
        a, b = re.search(r"What is (\d+) \+ (\d+)\?", tokenizer.decode(traj.prompt_token_ids)).groups()
        [turn] = traj.turns  # single turn: the model's answer, rewarded by the environment's rubric
        numbers = re.findall(r"-?\d+", parse_assistant(turn.text).content or "")
        assert traj.reward == (1.0 if numbers and numbers[-1] == str(int(a) + int(b)) else 0.0) == turn.reward
