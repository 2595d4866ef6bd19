"""Environments raise their reward, run as a user runs the examples against a cluster of the real
services with the chat model: examples/environments/train_tally_desk.py trains on the tally desk
(a team's stateful environment, its code in a sandbox session per episode) and
train_verifiers_sums.py on a verifiers environment (its own rollout and rubric in the sessions);
each environment's mean reward over the last quarter of the run beats the first quarter's.
Minutes: in the slow set (make test-all); the default run trains a few steps of the same paths
(tests/integration/test_program_env.py, test_verifiers_env.py)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ServiceLauncher, prebuilt_model

EXAMPLES = Path(__file__).parents[2] / "examples" / "environments"
EXAMPLE = EXAMPLES / "train_tally_desk.py"
# As `policyloop demo --agent-env` (30 steps of 16 groups at 3e-4: 0.088 -> 0.236, docs/measurements.md).
GROUPS_PER_STEP = 16
TASKS = 30 * GROUPS_PER_STEP
LR = 3e-4
MIN_GAIN = 0.05


@pytest.fixture(scope="module")
def chat_model_dir(request: pytest.FixtureRequest) -> Path:
    return prebuilt_model(request.config, "chat")


@pytest.mark.slow
@pytest.mark.timeout(1800)
async def test_the_tally_desk_raises_its_reward(services: ServiceLauncher, chat_model_dir: Path) -> None:
    loop = await services.start_loop(chat_model_dir, GROUPS_PER_STEP, timeout_s=180,
                                     env={"POLICYLOOP_OPTIMIZER__LR": str(LR)})
    done = await asyncio.to_thread(subprocess.run, [
        sys.executable, str(EXAMPLE), "--gateway", f"127.0.0.1:{loop['gateway'].ports['grpc']}", "--tasks", str(TASKS)],
        capture_output=True, text=True, timeout=1700)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["state"] == "RUN_STATE_FINISHED" and summary["steps"] >= 10, summary
    assert summary["reward_last_quarter"] > summary["reward_first_quarter"] + MIN_GAIN, summary


VERIFIERS_GROUPS_PER_STEP, VERIFIERS_STEPS = 8, 20


@pytest.mark.slow
@pytest.mark.timeout(1800)
async def test_a_verifiers_environment_raises_its_reward(services: ServiceLauncher, chat_model_dir: Path) -> None:
    loop = await services.start_loop(chat_model_dir, VERIFIERS_GROUPS_PER_STEP, timeout_s=180,
                                     env={"POLICYLOOP_OPTIMIZER__LR": str(LR)})
    done = await asyncio.to_thread(subprocess.run, [
        sys.executable, str(EXAMPLES / "train_verifiers_sums.py"), "--gateway",
        f"127.0.0.1:{loop['gateway'].ports['grpc']}", "--tasks", str(VERIFIERS_STEPS * VERIFIERS_GROUPS_PER_STEP)],
        capture_output=True, text=True, timeout=1700)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["state"] == "RUN_STATE_FINISHED" and summary["steps"] >= 10, summary
    assert summary["reward_last_quarter"] > summary["reward_first_quarter"] + MIN_GAIN, summary
