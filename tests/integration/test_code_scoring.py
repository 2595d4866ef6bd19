"""Code scorers through the real reward and sandbox services: unit tests of completions and a
team's reward code run in the sandbox (request/reply over SANDBOX), never in the reward service."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from policyloop.bus import Bus, rollouts_subject
from policyloop.contracts.v1 import bus_pb2
from policyloop.envs.code import code_environment, reference_solutions
from policyloop.envs.spec import task_scorer
from policyloop.sandbox.runner import SandboxUnavailable, check_isolation
from tests.conftest import ServiceLauncher
from tests.helpers import eventually, publish_group, stored_samples

try:
    check_isolation()
except SandboxUnavailable as exc:  # pragma: no cover - depends on the machine
    pytest.skip(f"the sandbox cannot isolate jobs here: {exc}", allow_module_level=True)


def rollout(trajectory_id: str, prompt: str, completion: str, scorer: bus_pb2.Scorer,
            metadata: dict[str, str] | None = None) -> bus_pb2.Trajectory:
    return bus_pb2.Trajectory(
        trajectory_id=trajectory_id, task_id=trajectory_id, group_id=trajectory_id, group_size=1,
        environment="code", prompt_text=prompt, response_text=completion, response_token_ids=[5],
        behaviour_logprobs=[-1.0], loss_mask=[True], finish_reason=bus_pb2.FINISH_REASON_STOP,
        version_spans=[bus_pb2.VersionSpan(version=0, start=0, end=1)], metadata=metadata, scorer=scorer)


async def scored(bus: Bus, rollouts: list[bus_pb2.Trajectory]) -> dict[str, bus_pb2.Trajectory]:
    for traj in rollouts:
        await publish_group(bus, rollouts_subject("code"), traj, msg_id=traj.trajectory_id)

    async def all_scored() -> bool:
        return len(await stored_samples(bus, "TRAJECTORIES")) == len(rollouts)

    await eventually(all_scored, timeout_s=90, what="every rollout scored")
    return {t.trajectory_id: t for t in await stored_samples(bus, "TRAJECTORIES")}


def parts(traj: bus_pb2.Trajectory) -> dict[str, tuple[float, str]]:
    return {c.name: (c.value, c.detail) for c in traj.reward_breakdown}


async def test_unit_tests_run_in_the_sandbox(bus: Bus, services: ServiceLauncher) -> None:
    sandbox, reward = services.start("sandbox"), services.start("reward")
    await services.wait_healthy(sandbox, reward, timeout_s=60)
    env = code_environment()
    task = env.tasks[0]  # def add(a, b):
    scored_by, metadata = task_scorer(env, task), dict(task.metadata)
    prompt = task.prompt_text
    right = reference_solutions()[prompt]
    forged = 'print("0123 {\\"compiled\\": true, \\"tests\\": [[\\"test_0\\", true, \\"\\"]]}")\n    return 42'
    # Tests of its own next to a wrong body: only the tests tests.py defines are counted.
    own_tests = "return 99\ndef test_mine():\n    pass\ndef test_also_mine():\n    pass"
    # The report line forged with the nonce taken from the harness's module (the old harness kept it there).
    stolen_nonce = ("import sys, os, json\n    m = sys.modules['__main__']\n"
                    "    report = {'compiled': True, 'error': '',\n"
                    "              'tests': [['test_0', True, ''], ['test_1', True, '']]}\n"
                    "    os.write(1, ('\\n' + m.nonce + ' ' + json.dumps(report) + '\\n').encode())\n    os._exit(0)")
    results = await scored(bus, [
        rollout("right", prompt, right, scored_by, metadata),
        rollout("half", prompt, "return a + b if a > 0 else 99", scored_by, metadata),
        rollout("syntax", prompt, "return a +", scored_by, metadata),
        rollout("loop", prompt, "while True: pass", scored_by, metadata),
        rollout("exit", prompt, "import os; os._exit(0)", scored_by, metadata),
        rollout("forged", prompt, forged, scored_by, metadata),
        rollout("own_tests", prompt, own_tests, scored_by, metadata),
        rollout("stolen_nonce", prompt, stolen_nonce, scored_by, metadata),
    ])
    assert results["right"].reward == 1.0 and parts(results["right"])["tests_passed"] == (1.0, "2/2 passed")
    assert results["half"].reward == 0.5 and "1/2 passed" in parts(results["half"])["tests_passed"][1]
    assert results["syntax"].reward == 0.0 and "SyntaxError" in parts(results["syntax"])["compiled"][1]
    # A body that never returns times out in each test (the test's share of the budget); one that
    # exits the process crashes each: the breakdown names them, and neither earns anything.
    assert results["loop"].reward == 0.0 and parts(results["loop"])["tests_timed_out"][0] == 2.0
    assert results["exit"].reward == 0.0 and parts(results["exit"])["tests_crashed"][0] == 2.0
    assert results["forged"].reward == 0.0  # printing a report does not pass for the harness's
    assert results["stolen_nonce"].reward == 0.0
    assert results["own_tests"].reward == 0.0 and "0/2 passed" in parts(results["own_tests"])["tests_passed"][1]


async def test_reward_code_runs_in_the_sandbox_not_in_the_reward_service(
        bus: Bus, services: ServiceLauncher, monkeypatch: pytest.MonkeyPatch) -> None:
    secret = uuid.uuid4().hex
    marker = Path(f"/tmp/pl-reward-code-{uuid.uuid4().hex}")
    sandbox = services.start("sandbox")
    reward = services.start("reward", env={"POLICYLOOP_TEST_SECRET": secret})
    await services.wait_healthy(sandbox, reward, timeout_s=60)

    def team_code(body: str) -> bus_pb2.Scorer:
        return bus_pb2.Scorer(reward_code=bus_pb2.RewardCodeScorer(source=body, timeout_seconds=3))

    length = team_code("def reward(prompt, completion, metadata):\n"
                       "    return len(completion) / 10, 'length/10'\n")
    snoop = team_code("import os\n"
                      f"open('{marker}', 'w').write('escaped')\n"
                      "def reward(prompt, completion, metadata):\n"
                      "    return float(any('" + secret + "' in v for v in os.environ.values()))\n")
    results = await scored(bus, [
        rollout("length", "p", "abcde", length),
        rollout("crash", "p", "x", team_code("def reward(prompt, completion, metadata):\n    return 1 / 0\n")),
        rollout("slow", "p", "x", team_code("def reward(p, c, m):\n    while True: pass\n")),
        rollout("nan", "p", "x", team_code("def reward(p, c, m):\n    return float('nan')\n")),
        rollout("snoop", "p", "x", snoop),
    ])
    assert results["length"].reward == 0.5 and parts(results["length"])["reward_code"] == (0.5, "length/10")
    assert results["crash"].reward == 0.0 and "ZeroDivisionError" in parts(results["crash"])["crashed"][1]
    assert results["slow"].reward == 0.0
    assert {"limit_cpu_time", "limit_wall_time"} & set(parts(results["slow"]))
    assert results["nan"].reward == 0.0 and "finite" in parts(results["nan"])["reward_code"][1]
    # The team's code ran where the reward service's environment and the host's /tmp are not.
    assert results["snoop"].reward == 0.0 and not marker.exists()
    # The sandbox counted its jobs by outcome and timed each: the runaway one by the limit that ended it.
    jobs = sandbox_metrics(sandbox.ports["http"])
    assert jobs.get(("policyloop_sandbox_jobs_total", "ok"), 0) >= 1
    assert jobs.get(("policyloop_sandbox_jobs_total", "cpu_time"), 0) + jobs.get(
        ("policyloop_sandbox_jobs_total", "wall_time"), 0) >= 1
    timed = sum(v for (name, _), v in jobs.items() if name == "policyloop_sandbox_job_seconds_count")
    assert timed == sum(v for (name, _), v in jobs.items() if name == "policyloop_sandbox_jobs_total") >= 5


def sandbox_metrics(port: int) -> dict[tuple[str, str], float]:
    """(sample name, outcome) → value of the sandbox's job metrics, from its own /metrics."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {(s.name, s.labels.get("outcome", "")): s.value for family in text_string_to_metric_families(text)
            for s in family.samples if s.name.startswith("policyloop_sandbox_job")}


async def test_every_task_of_the_code_environment_is_solvable() -> None:
    """Each task's reference body passes all its tests and a body that raises passes none (run
    in the sandbox directly, as its replicas do)."""

    from policyloop.sandbox.runner import JobLimits, run_job
    from policyloop.scorers.registry import sandbox_job, score_result

    env = code_environment()
    solutions = reference_solutions()
    for task in env.tasks:
        for completion, expected in ((solutions[task.prompt_text], 1.0), ("raise ValueError('no')", 0.0)):
            traj = rollout("t", task.prompt_text, completion, task_scorer(env, task), dict(task.metadata))
            code_job = sandbox_job(traj)
            result = await run_job(code_job.job, JobLimits(wall_seconds=10, cpu_seconds=5))
            assert score_result(traj, code_job, result)[0] == expected, (task.prompt_text, completion, result)
