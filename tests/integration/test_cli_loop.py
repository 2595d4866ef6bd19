"""`policyloop env` and `policyloop run` against a real gateway: submit from JSONL, start,
watch and stop a run; bad files and refused calls end with a clear message and exit code."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

from policyloop.cluster.client import TaskFileError, build_environment, parse_mix, read_tasks
from tests.conftest import ServiceLauncher

POLICYLOOP = [sys.executable, "-m", "policyloop"]


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*POLICYLOOP, *args], capture_output=True, text=True, timeout=60)


async def test_submit_start_watch_and_stop_through_the_cli(services: ServiceLauncher, tmp_path: Path) -> None:
    gateway = services.start("gateway")
    await services.wait_healthy(gateway)
    address = ["--gateway", f"127.0.0.1:{gateway.ports['grpc']}"]
    tasks = tmp_path / "sums.jsonl"
    tasks.write_text("\n".join(json.dumps({"prompt": f"{a}+{a}=", "answer": str(2 * a)}) for a in range(10, 20)))

    submitted = await asyncio.to_thread(cli, "env", "submit", str(tasks), "--name", "sums", "--group-size", "4",
                                        *address)
    assert submitted.returncode == 0, submitted.stdout + submitted.stderr
    assert json.loads(submitted.stdout) == {"environment": "sums@v1", "tasks": 10, "group_size": 4, "created": True}
    again = await asyncio.to_thread(cli, "env", "submit", str(tasks), "--name", "sums", "--group-size", "4", *address)
    assert json.loads(again.stdout)["created"] is False
    changed = await asyncio.to_thread(cli, "env", "submit", str(tasks), "--name", "sums", "--group-size", "2",
                                      *address)
    assert changed.returncode == 1 and "ALREADY_EXISTS" in changed.stdout

    unknown = await asyncio.to_thread(cli, "run", "start", "--env", "nothing@v1", *address)
    assert unknown.returncode == 1 and "NOT_FOUND" in unknown.stdout and "environments[0]" in unknown.stdout
    started = await asyncio.to_thread(cli, "run", "start", "--env", "sums@v1=1", "--num-tasks", "6",
                                      "--run-id", "cli-run", *address)
    assert started.returncode == 0, started.stdout + started.stderr
    run = json.loads(started.stdout)
    assert run["runId"] == "cli-run" and run["state"] == "RUN_STATE_RUNNING" and run["tasksTotal"] == 6

    # No learner is up to say what it trains: a LoRA run is checked for itself, its defaults filled in.
    bad_rank = await asyncio.to_thread(cli, "run", "start", "--env", "sums@v1", "--lora-rank", "5000", *address)
    assert bad_rank.returncode == 1 and "INVALID_ARGUMENT" in bad_rank.stdout and "lora.rank" in bad_rank.stdout
    lora = await asyncio.to_thread(cli, "run", "start", "--env", "sums@v1", "--num-tasks", "2", "--run-id",
                                   "lora-run", "--lora-rank", "8", "--lora-target-modules", "q_proj, v_proj", *address)
    assert lora.returncode == 0, lora.stdout + lora.stderr
    assert json.loads(lora.stdout)["lora"] == {"rank": 8, "alpha": 16.0, "targetModules": ["q_proj", "v_proj"]}
    assert (await asyncio.to_thread(cli, "run", "stop", "lora-run", *address)).returncode == 0

    stopped = await asyncio.to_thread(cli, "run", "stop", "cli-run", *address)
    assert stopped.returncode == 0 and stopped.stdout.startswith("stopped")
    watched = await asyncio.to_thread(cli, "run", "watch", "cli-run", *address)  # ends with the run
    assert watched.returncode == 0 and watched.stdout.startswith("stopped") and "tasks" in watched.stdout
    missing = await asyncio.to_thread(cli, "run", "watch", "no-such-run", *address)
    assert missing.returncode == 1 and "NOT_FOUND" in missing.stdout

    # Environments that drive their episodes: the flags reach the gateway, which names what is wrong.
    from policyloop.envs.programs import TALLY_DESK, TALLY_DESK_ENTRY

    seeds = tmp_path / "seeds.jsonl"
    seeds.write_text('{"metadata": {"seed": "1"}}\n')
    program = ["--program", str(TALLY_DESK), "--entry", TALLY_DESK_ENTRY, "--max-turns", "3"]
    desk = await asyncio.to_thread(cli, "env", "submit", str(seeds), "--name", "desk", *program, *address)
    assert desk.returncode == 0 and json.loads(desk.stdout)["created"], desk.stdout + desk.stderr
    flagged = await asyncio.to_thread(cli, "env", "submit", str(seeds), "--name", "desk2", *program,
                                      "--requirement", "--index-url=http://elsewhere", *address)
    assert flagged.returncode == 1 and "environment.program.requirements[0]" in flagged.stdout
    echo = await asyncio.to_thread(cli, "env", "submit", str(seeds), "--name", "echo", "--openenv",
                                   "ftp://echo-env", "--max-turns", "2", *address)
    assert echo.returncode == 1 and "environment.openenv.base_url" in echo.stdout


def test_a_bad_task_file_names_the_line_and_field(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2=", "anwser": "4"}\n')
    with pytest.raises(TaskFileError, match=r"bad.jsonl:2: anwser: unknown field"):
        read_tasks(bad)
    bad.write_text('{"prompt": "1+1=", "metadata": {"tests": 3}}\n')
    with pytest.raises(TaskFileError, match=r":1: metadata"):
        read_tasks(bad)
    bad.write_text("not json\n")
    with pytest.raises(TaskFileError, match=r":1: not JSON"):
        read_tasks(bad)
    result = cli("env", "submit", str(bad), "--name", "x", "--gateway", "127.0.0.1:1")
    assert result.returncode == 2 and "not JSON" in result.stdout  # refused before any call


def test_environments_and_mixes_from_flags() -> None:
    env = build_environment("code", "v2", [], "unit_tests", code="import math\n", timeout_s=3)
    assert env.unit_tests.test_code == "import math\n" and env.unit_tests.timeout_seconds == 3
    assert build_environment("r", "v1", [], "regex", pattern="a+").builtin.pattern == "a+"
    multi = build_environment("m", "v1", [], "exact_answer", max_turns=3, tools=["python"])
    assert multi.max_turns == 3 and list(multi.tools) == ["python"]
    with pytest.raises(ValueError, match="scorer must be one of"):
        build_environment("x", "v1", [], "vibes")
    assert [(m.environment, m.weight) for m in parse_mix(["a@v1=0.7", "b@v2"])] == [("a@v1", 0.7), ("b@v2", 1.0)]
    with pytest.raises(ValueError, match="must be a number"):
        parse_mix(["a@v1=lots"])


def test_model_scorers_from_flags(tmp_path: Path) -> None:
    from policyloop.cli.loop import _judge
    from policyloop.contracts.v1 import loop_pb2

    scored = build_environment("s", "v1", [], "reward_model", reward_model="arith-rm", normalization="sigmoid")
    assert (scored.reward_model.model, scored.reward_model.normalization) == (
        "arith-rm", loop_pb2.RewardModelScorer.NORMALIZATION_SIGMOID)
    with pytest.raises(ValueError, match="normalization must be one of none, sigmoid"):
        build_environment("s", "v1", [], "reward_model", reward_model="arith-rm", normalization="softmax")
    template = tmp_path / "judge.txt"
    template.write_text("Rate {response}")
    spec = _judge("cluster", "", template, "label", ["yes=1", "no=0", "a=b=0.5"], "", "", 0, 10.0)
    assert (spec.template, dict(spec.labels), spec.verdict) == (
        "Rate {response}", {"yes": 1.0, "no": 0.0, "a=b": 0.5}, loop_pb2.JudgeScorer.VERDICT_LABEL)
    assert (spec.min_score, spec.max_score) == (0, 0)
    ranged = _judge("cluster", "m", template, "number", [], "", "1,11", 6, 10.0)
    assert (ranged.min_score, ranged.max_score, ranged.max_tokens, ranged.model) == (1, 11, 6, "m")
    for labels, score_range, verdict, problem in ((["yes"], "", "label", "--label 'yes'"),
                                                  (["yes=lots"], "", "label", "--label 'yes=lots'"),
                                                  (["yes=inf"], "", "label", "--label 'yes=inf'"),
                                                  ([], "0-10", "number", "--score-range '0-10': MIN,MAX"),
                                                  ([], "", "stars", "verdict must be one of number, label, json")):
        with pytest.raises(ValueError, match=problem):
            _judge("cluster", "", template, verdict, labels, "", score_range, 0, 10.0)
    # On the command line, refused before any call to the gateway.
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    result = cli("env", "submit", str(tasks), "--name", "x", "--scorer", "judge", "--judge", "cluster",
                 "--judge-template", str(template), "--verdict", "label", "--label", "yes", "--gateway", "127.0.0.1:1")
    assert result.returncode == 2 and "LABEL=REWARD" in result.stdout
