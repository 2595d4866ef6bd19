"""Environment programs before they run: the gateway refuses a malformed one naming the field; the
CLI packs a module, a package directory or a pure-Python wheel; the worker that runs one in its
session answers typed requests and names what a program got wrong."""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from google.protobuf import json_format

from policyloop.cluster.client import build_environment, read_program
from policyloop.contracts.v1 import bus_pb2, loop_pb2
from policyloop.contracts.validate import validate_task
from policyloop.envs import program_worker
from policyloop.envs.program import program_job
from policyloop.envs.programs import TALLY_DESK as DESK
from policyloop.gateway.errors import InvalidField
from policyloop.gateway.feeding import nth_task
from policyloop.gateway.validation import validate_environment


def desk_environment(**changes: object) -> loop_pb2.Environment:
    env = build_environment("desk", "v1", [loop_pb2.TaskSpec(metadata={"seed": "1"})], "exact_answer",
                            max_turns=3, driver=read_program(DESK, "tally_desk:TallyDesk"))
    for name, value in changes.items():
        target, _, attr = name.rpartition("__")
        holder = getattr(env, target) if target else env
        if isinstance(value, list):
            del getattr(holder, attr)[:]
            getattr(holder, attr).extend(value)
        else:
            setattr(holder, attr, value)
    return env


def test_a_program_is_scored_by_its_own_rewards_and_needs_no_prompt() -> None:
    env = desk_environment()
    assert env.WhichOneof("scorer") == "environment_reward" and set(env.program.files) == {"tally_desk.py"}
    validate_environment(env)
    # Each Task of a run carries the program, its task's data and the scorer of its rewards.
    run = loop_pb2.StartRunRequest(run_id="r", environments=[loop_pb2.EnvironmentMix(environment="desk@v1", weight=1)])
    task = nth_task("r", run, {"desk@v1": env}, 0)
    assert task.program == env.program and task.metadata["seed"] == "1" and task.max_turns == 3
    assert task.scorer.WhichOneof("kind") == "environment_reward"
    validate_task(task)


@pytest.mark.parametrize(("changes", "field"), [
    ({"program__entry": "tally_desk"}, "environment.program.entry"),
    ({"program__entry": "orders:Desk"}, "environment.program.files"),
    ({"program__step_seconds": -1.0}, "environment.program.step_seconds"),
    ({"tools": ["python"]}, "environment.tools"),
])
def test_a_malformed_program_is_refused_naming_its_field(changes: dict, field: str) -> None:
    with pytest.raises(InvalidField) as refused:
        validate_environment(desk_environment(**changes))
    assert refused.value.field == field


def test_program_files_must_stay_inside_the_package() -> None:
    env = desk_environment()
    env.program.files["../etc/passwd"] = b"x"
    with pytest.raises(InvalidField, match="not a relative path"):
        validate_environment(env)
    # A program's rewards score only a program, and a program only by its rewards.
    plain = build_environment("plain", "v1", [loop_pb2.TaskSpec(prompt_text="1+1=", answer="2")], "environment_reward")
    with pytest.raises(InvalidField, match="give both or neither"):
        validate_environment(plain)


def test_a_package_directory_and_a_wheel_are_packed_with_their_paths(tmp_path: Path) -> None:
    package = tmp_path / "desk"
    (package / "__pycache__").mkdir(parents=True)
    (package / "__init__.py").write_text("from desk.core import Desk\n")
    (package / "core.py").write_text("class Desk: ...\n")
    (package / "__pycache__" / "core.cpython-311.pyc").write_bytes(b"\0")
    assert set(read_program(package, "desk:Desk").files) == {"desk/__init__.py", "desk/core.py"}
    wheel = tmp_path / "desk-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("desk/__init__.py", "class Desk: ...\n")
        zf.writestr("desk-1.0.dist-info/METADATA", "Name: desk\n")
    assert set(read_program(wheel, "desk:Desk").files) == {"desk/__init__.py"}
    (tmp_path / "bad.whl").write_bytes(b"not a zip")
    with pytest.raises(ValueError, match="not a wheel"):
        read_program(tmp_path / "bad.whl", "desk:Desk")


def worker(tmp_path: Path, source: str, requests: list[bus_pb2.EnvRequest]) -> list[bus_pb2.EnvReply]:
    """Runs the session's worker (standard library only, as in the sandbox) on `requests`."""
    (tmp_path / "env").mkdir(exist_ok=True)
    (tmp_path / "env" / "prog.py").write_text(source)
    lines = "".join(json_format.MessageToJson(r, preserving_proto_field_name=True, indent=None) + "\n"
                    for r in requests)
    done = subprocess.run([sys.executable, "-I", program_worker.__file__, "prog:Env"], input=lines, text=True,
                          capture_output=True, cwd=tmp_path, timeout=60)
    return [json_format.Parse(line, bus_pb2.EnvReply()) for line in done.stdout.splitlines()]


RESET = bus_pb2.EnvRequest(reset=bus_pb2.EnvReset(metadata={"seed": "3"}))


def step(content: str = "", *calls: tuple[str, dict]) -> bus_pb2.EnvRequest:
    return bus_pb2.EnvRequest(action=bus_pb2.EnvAction(text=content, content=content, tool_calls=[
        bus_pb2.EnvToolCall(name=n, arguments_json=json.dumps(a)) for n, a in calls]))


def test_the_worker_runs_the_desk_and_keeps_its_ledger(tmp_path: Path) -> None:
    source = DESK.read_text().replace("class TallyDesk", "class Env")
    opened, *steps = worker(tmp_path, source, [
        RESET, step("", ("calculator", {"expression": "1 + 1"})), step("", ("calculator", {"expression": "1 + 1"})),
        step("The answer is 7.")])
    question = opened.messages[0].content
    assert opened.messages[0].role == "user" and question.startswith("What is")
    assert json.loads(opened.tools_json)[0]["function"]["name"] == "calculator"
    first, again, reply = steps
    assert [m.role for m in first.messages] == ["tool"] and first.messages[0].content == "2" and not first.done
    assert again.reward == pytest.approx(-0.5)  # the same calculation booked twice
    a, op, b = question.removeprefix("What is ").removesuffix("?").split()
    right = int(a) + int(b) if op == "+" else int(a) - int(b)
    assert reply.done and reply.reward == (1.0 if right == 7 else 0.0)


@pytest.mark.parametrize(("body", "error"), [
    ("def step(self, action):\n        return 'hi', 'high', False", "a reward is a number or None"),
    ("def step(self, action):\n        return 'hi', 1.0", "step returns (observation, reward, done)"),
    ("def step(self, action):\n        return [{'role': 'wizard', 'content': 'x'}], 1.0, False", "a message is"),
    ("def step(self, action):\n        print('forged'); raise RuntimeError('ledger locked')", "ledger locked"),
])
def test_the_worker_names_what_a_program_got_wrong(tmp_path: Path, body: str, error: str) -> None:
    source = f"class Env:\n    def reset(self, task):\n        return 'hello'\n    {body}\n"
    opened, failed = worker(tmp_path, source, [RESET, step("hi")])
    assert opened.messages[0].content == "hello" and error in failed.error  # prints never reach the channel


def test_an_openenv_environment_names_a_server_and_is_scored_by_its_rewards() -> None:
    server = bus_pb2.OpenEnvServer(base_url="http://echo-env:8000", action_field="message")
    env = build_environment("echo", "v1", [loop_pb2.TaskSpec()], "exact_answer", max_turns=2, driver=server)
    assert env.WhichOneof("scorer") == "environment_reward"
    validate_environment(env)
    task = nth_task("r", loop_pb2.StartRunRequest(
        run_id="r", environments=[loop_pb2.EnvironmentMix(environment="echo@v1", weight=1)]), {"echo@v1": env}, 0)
    assert task.openenv == server and not task.HasField("program")
    validate_task(task)
    for url in ("echo-env:8000", "ftp://echo-env", "http://"):
        env.openenv.base_url = url
        with pytest.raises(InvalidField, match="environment.openenv.base_url"):
            validate_environment(env)
    # One environment drives a task's episodes: naming a server replaces the program.
    both = desk_environment()
    both.openenv.CopyFrom(server)
    assert both.WhichOneof("driver") == "openenv" and not both.HasField("program")


def test_a_programs_dependencies_are_specifiers_and_wheels(tmp_path: Path) -> None:
    wheel = tmp_path / "ledgerlib-1.0-py3-none-any.whl"
    wheel.write_bytes(b"PK")
    program = read_program(DESK, "tally_desk:TallyDesk", requirements=["sortedcontainers==2.4.0"], wheels=[wheel])
    assert list(program.requirements) == ["sortedcontainers==2.4.0"] and set(program.wheels) == {wheel.name}
    env = desk_environment()
    env.program.CopyFrom(program)
    validate_environment(env)
    assert program_job(program, job_id="j", run_id="r").dependencies == bus_pb2.SandboxDependencies(
        requirements=["sortedcontainers==2.4.0"], wheels={wheel.name: b"PK"})
    for bad in ("--index-url=http://evil", "-r reqs.txt", " "):
        env.program.requirements[:] = [bad]
        with pytest.raises(InvalidField, match=r"environment.program.requirements\[0\]"):
            validate_environment(env)
    env.program.requirements[:] = []
    env.program.wheels["../x.whl"] = b"PK"
    with pytest.raises(InvalidField, match="not a wheel's file name"):
        validate_environment(env)


def test_the_agent_env_demo_trains_on_seeds_it_never_evaluates() -> None:
    from policyloop.demo.desk import EnvDemoConfig, EnvDemoResult, desk_environment

    env = desk_environment(EnvDemoConfig())
    validate_environment(env)
    train = {t.metadata["seed"] for t in env.tasks}
    held_out = {t.metadata["seed"] for t in env.eval_tasks}
    assert len(held_out) == EnvDemoConfig().loop.eval_problems and not train & held_out
    result = EnvDemoResult(rewards=[(1, 0.1), (2, 0.2), (3, 0.3), (4, 0.4), (5, 0.5), (6, 0.6), (7, 0.7), (8, 0.8)])
    assert result.reward_quarters() == pytest.approx((0.15, 0.75))
    assert EnvDemoResult().reward_quarters() == (0.0, 0.0)


def test_a_task_or_session_that_names_nothing_to_run_is_refused() -> None:
    from policyloop.contracts.validate import InvalidMessage, validate_sandbox_session

    task = bus_pb2.Task(task_id="t", run_id="r", environment="desk@v1", group_size=1,
                        program=bus_pb2.EnvironmentProgram(files={"desk.py": b""}))
    with pytest.raises(InvalidMessage, match="program: names no entry"):
        validate_task(task)
    task.openenv.CopyFrom(bus_pb2.OpenEnvServer())
    with pytest.raises(InvalidMessage, match="openenv.base_url: is empty"):
        validate_task(task)
    session = bus_pb2.SandboxJob(job_id="s", command=["python3"], session=bus_pb2.SandboxSession(step_seconds=1))
    with pytest.raises(InvalidMessage, match="session.channel_subject: is empty"):
        validate_sandbox_session(session)
    session.session.channel_subject, session.session.step_seconds = "_INBOX.x", -1
    with pytest.raises(InvalidMessage, match="session.step_seconds"):
        validate_sandbox_session(session)
    session.session.step_seconds, session.session.prepared = 1, True  # a forkserver needs the script it imports
    with pytest.raises(InvalidMessage, match="session.prepared: needs the command"):
        validate_sandbox_session(session)
    session.command[:] = ["python3", "-I", "worker.py"]
    with pytest.raises(InvalidMessage, match="session.prepared"):
        validate_sandbox_session(session)
    session.files["worker.py"] = b"def prepare():\n    return lambda: 0\n"
    validate_sandbox_session(session)


async def test_what_an_environment_answers_wrong_fails_the_episode_with_the_reason() -> None:
    from policyloop.envs.chat_env import EnvironmentFailed, NoChatTemplate, chat_template, read_tools
    from policyloop.envs.openenv_env import observation_text
    from policyloop.envs.program import ProgramClient
    from policyloop.sandbox.session import SessionEnded

    class Answers:  # a session that answers with fixed lines (the session itself is tested on the sandbox)
        def __init__(self, line: bytes) -> None:
            self.line = line

        async def step(self, line: bytes) -> bytes:
            return self.line

    reset = bus_pb2.EnvRequest(reset=bus_pb2.EnvReset())
    with pytest.raises(EnvironmentFailed, match="a malformed answer to reset"):
        await ProgramClient(Answers(b'{"reward": "high"}')).ask(reset)  # type: ignore[arg-type]
    with pytest.raises(EnvironmentFailed, match="failed on reset: KeyError"):
        await ProgramClient(Answers(b'{"error": "KeyError: orders"}')).ask(reset)  # type: ignore[arg-type]

    class Hangs:  # the sandbox ended the session: a step past its limit
        async def step(self, line: bytes) -> bytes:
            raise SessionEnded(bus_pb2.SandboxResult(limit_hit=bus_pb2.SANDBOX_LIMIT_STEP_TIME, stderr=b"in step\n"))

    with pytest.raises(EnvironmentFailed, match="the session ended \\(limit SANDBOX_LIMIT_STEP_TIME\\): in step"):
        await ProgramClient(Hangs()).ask(reset)  # type: ignore[arg-type]
    for bad in ('{"name": "calculator"}', '["calculator"]', "not json"):
        with pytest.raises(EnvironmentFailed, match="tools"):
            read_tools(bad)
    assert observation_text({"echoed_message": "hi"}, "echoed_message") == "hi"
    assert observation_text({"a": 1}, "") == '{"a": 1}'
    with pytest.raises(EnvironmentFailed, match="the observation has no field 'message'"):
        observation_text({"echoed_message": "hi"}, "message")

    class NoTemplate:
        chat_template = None

    with pytest.raises(NoChatTemplate, match="needs|need a chat model"):
        chat_template(NoTemplate())
