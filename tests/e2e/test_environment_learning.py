"""Environments raise their reward, run as a user runs the examples against a cluster of the real
services with the chat model: examples/environments/train_tally_desk.py trains on the tally desk
(a team's stateful environment, its code in a sandbox session per episode), train_openenv.py on
the sums quiz (an OpenEnv server, examples/environments/openenv/) and train_verifiers.py on a
multi-turn verifiers environment (its sessions forked from one that loaded it), and each
environment's mean reward over the last quarter of the run beats the first quarter's. Minutes
(the verifiers job ~18 here): in the slow set (make test-all); the default run trains a few steps
of the same paths (tests/integration/test_program_env.py, test_openenv.py, test_verifiers_env.py)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import ServiceLauncher, prebuilt_model
from tests.helpers import openenv_server

EXAMPLES = Path(__file__).parents[2] / "examples" / "environments"
LR = 3e-4
MIN_GAIN = 0.05


@dataclass(frozen=True)
class Job:
    example: str
    groups_per_step: int
    steps: int
    arguments: tuple[str, ...] = ()
    openenv_app: str = ""  # an OpenEnv server the job trains on, "module:app" in examples/environments/openenv


JOBS = {
    # As `policyloop demo --agent-env` (30 steps of 16 groups at 3e-4: 0.088 -> 0.236, docs/measurements.md).
    "tally-desk": Job("train_tally_desk.py", groups_per_step=16, steps=30),
    # Arithmetic moves slower than the desk's tool use: 30 steps are within the noise (measurements.md).
    "sums-quiz": Job("train_openenv.py", groups_per_step=16, steps=100, openenv_app="sums_quiz:app"),
    "vf-second-try": Job("train_verifiers.py", groups_per_step=16, steps=100,
                         arguments=("--environment", "vf-second-try", "--max-turns", "2")),
}


@pytest.fixture(scope="module")
def chat_model_dir(request: pytest.FixtureRequest) -> Path:
    return prebuilt_model(request.config, "chat")


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("name", sorted(JOBS))
async def test_an_example_raises_its_environments_reward(name: str, services: ServiceLauncher,
                                                         chat_model_dir: Path, tmp_path: Path) -> None:
    job = JOBS[name]
    loop = await services.start_loop(chat_model_dir, job.groups_per_step, timeout_s=180,
                                     env={"POLICYLOOP_OPTIMIZER__LR": str(LR)})
    with contextlib.ExitStack() as stack:
        server = (["--server", stack.enter_context(openenv_server(EXAMPLES / "openenv", job.openenv_app, tmp_path))]
                  if job.openenv_app else [])
        done = await asyncio.to_thread(subprocess.run, [
            sys.executable, str(EXAMPLES / job.example), "--gateway", f"127.0.0.1:{loop['gateway'].ports['grpc']}",
            "--tasks", str(job.steps * job.groups_per_step), *server, *job.arguments],
            capture_output=True, text=True, timeout=1700)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    print(done.stdout)  # the reward per step and the summary docs/measurements.md quotes (pytest -s)
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["state"] == "RUN_STATE_FINISHED" and summary["steps"] >= 10, summary
    assert summary["reward_last_quarter"] > summary["reward_first_quarter"] + MIN_GAIN, summary
