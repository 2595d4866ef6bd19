"""Tool calls in text, tool results for the model, and the checks around multi-turn trajectories."""

from __future__ import annotations

import pytest

from policyloop.contracts.v1 import bus_pb2, loop_pb2
from policyloop.contracts.validate import InvalidMessage, validate_trajectory
from policyloop.envs.arithmetic import Problem
from policyloop.envs.tool_episodes import Tokenizer, ToolSetupError, close_ids, tool_turn_ids, transcript
from policyloop.envs.tools import TOOL_FORMATS, UnknownTool, find_call, result_text, tool_formats, tool_job
from policyloop.gateway.feeding import nth_task
from policyloop.models.bootstrap import PLAIN, TOOLS_CALL, TOOLS_DIRECT, tool_modes, training_batch
from policyloop.models.tokenizer import EOS_ID, VOCAB, build_tokenizer
from policyloop.scorers.kinds import verify
from tests.helpers import addition_environment

PYTHON = TOOL_FORMATS["python"]
MODEL, TOOL = bus_pb2.Turn.ROLE_MODEL, bus_pb2.Turn.ROLE_TOOL


def char_tokenizer() -> Tokenizer:
    tok = build_tokenizer()
    return Tokenizer(encode=lambda s: tok.encode(s, add_special_tokens=False).ids,
                     decode=lambda ids: tok.decode(list(ids)), marker_id=tok.token_to_id)


def test_a_turn_is_a_call_when_it_ends_with_the_closing_marker() -> None:
    assert find_call("think<python>1+2</python>", [PYTHON]) == find_call("<python>1+2</python>  ", [PYTHON])
    call = find_call("<python>x = 2\nx * 3</python>", [PYTHON])
    assert call is not None and call.complete and call.code == "x = 2\nx * 3"
    assert find_call("<python>1+2</python> so 3", [PYTHON]) is None  # the answer came after
    assert find_call("46", [PYTHON]) is None
    orphan = find_call("1+2</python>", [PYTHON])
    assert orphan is not None and not orphan.complete


def test_tool_results_say_what_stopped_the_job() -> None:
    ok = bus_pb2.SandboxResult(exit_code=0, stdout=b"46\n")
    assert result_text(ok, 100) == ("46", "ok")
    crashed = bus_pb2.SandboxResult(exit_code=1, stderr=b"Traceback ...\n  x\nNameError: name 'y' is not defined\n")
    assert result_text(crashed, 100) == ("NameError: name 'y' is not defined", "error")
    looped = bus_pb2.SandboxResult(exit_code=-9, stdout=b"1\n", limit_hit=bus_pb2.SANDBOX_LIMIT_WALL_TIME)
    assert result_text(looped, 100) == ("1\nstopped: wall_time limit", "limit_wall_time")
    assert result_text(bus_pb2.SandboxResult(error="no scratch"), 100) == ("error: no scratch", "sandbox_error")
    assert result_text(bus_pb2.SandboxResult(stdout=b"x" * 50), 10) == ("x" * 10 + "…", "ok")


def test_a_python_call_becomes_a_notebook_style_sandbox_job() -> None:
    call = find_call("<python>12+34</python>", [PYTHON])
    assert call is not None
    job = tool_job(call, job_id="tool:t/0", run_id="r", timeout_s=4.0)
    assert job.files["cell.py"] == b"12+34" and job.command == ["python3", "-I", "runner.py"]
    assert job.limits.wall_seconds == 4.0 and job.limits.cpu_seconds == 4.0 and job.limits.max_output_bytes > 0
    with pytest.raises(UnknownTool, match="shell"):
        tool_formats(["python", "shell"])


def test_tool_turns_are_bracketed_and_capped() -> None:
    tok = char_tokenizer()
    ids = tool_turn_ids(PYTHON, "1234567", tok, max_tool_tokens=5)
    assert ids == [VOCAB["<output>"], VOCAB["1"], VOCAB["2"], VOCAB["3"], VOCAB["</output>"]]
    assert close_ids([PYTHON], tok) == {VOCAB["</python>"]: PYTHON}
    no_markers = Tokenizer(encode=tok.encode, decode=tok.decode, marker_id=lambda marker: None)
    with pytest.raises(ToolSetupError, match="<python>"):
        close_ids([PYTHON], no_markers)


def episode(**replaced: list) -> bus_pb2.Trajectory:
    """'<python>1+2</python>' (model, 5 tokens), '<output>3</output>' (tool, 3), '3' + eos (model, 2)."""
    turns = [bus_pb2.Turn(role=MODEL, start=0, end=5, text="<python>1+2</python>"),
             bus_pb2.Turn(role=TOOL, start=5, end=8, tool="python", status="ok", text="3"),
             bus_pb2.Turn(role=MODEL, start=8, end=10, text="3")]
    traj = bus_pb2.Trajectory(
        trajectory_id="t/0", task_id="t", group_size=1, response_token_ids=list(range(10)),
        behaviour_logprobs=[-0.5] * 5 + [0.0] * 3 + [-0.5] * 2, loss_mask=[True] * 5 + [False] * 3 + [True] * 2,
        version_spans=[bus_pb2.VersionSpan(version=0, start=0, end=10)], turns=turns,
        finish_reason=bus_pb2.FINISH_REASON_STOP, response_text=transcript(turns, [PYTHON]),
        scorer=bus_pb2.Scorer(builtin=bus_pb2.BuiltinVerifier(kind=bus_pb2.BuiltinVerifier.KIND_EXACT_ANSWER),
                              answer="3"))
    for field, values in replaced.items():
        traj.ClearField(field)
        getattr(traj, field).extend(values)
    return traj


def test_multi_turn_trajectories_are_checked_and_scored_on_the_last_model_turn() -> None:
    traj = episode()
    validate_trajectory(traj)
    assert traj.response_text == "<python>1+2</python><output>3</output>3"
    reward, parts = verify(traj)
    assert reward == 1.0 + parts[0].weight and {p.name for p in parts} == {"format", "exact_answer"}
    with pytest.raises(InvalidMessage, match=r"turns\[1\]: only the model's tokens may have loss_mask true"):
        validate_trajectory(episode(loss_mask=[True] * 10))
    with pytest.raises(InvalidMessage, match="turns: cover 8 of 10"):
        validate_trajectory(episode(turns=list(episode().turns)[:2]))
    gap = list(episode().turns)
    gap[1] = bus_pb2.Turn(role=TOOL, start=6, end=8, tool="python")
    with pytest.raises(InvalidMessage, match=r"turns\[1\]"):
        validate_trajectory(episode(turns=gap))


def test_tasks_carry_their_environments_turns_and_tools() -> None:
    env = addition_environment(3)
    env.max_turns = 3
    env.tools.append("python")
    request = loop_pb2.StartRunRequest(environments=[loop_pb2.EnvironmentMix(environment="a@1", weight=1.0)])
    task = nth_task("r", request, {"a@1": env}, 0)
    assert task.max_turns == 3 and list(task.tools) == ["python"]


def test_the_bootstrap_warm_up_trains_the_call_and_the_answer_but_not_the_tools_output() -> None:
    problem = Problem(12, "+", 34)
    input_ids, _, labels = training_batch([problem, problem, problem], [PLAIN, TOOLS_DIRECT, TOOLS_CALL])
    tok = build_tokenizer()
    call_row = tok.encode("<tools>12+34=<python>12+34</python><output>46</output>46").ids + [EOS_ID]
    assert input_ids[2].tolist() == call_row
    trained = [t for t, label in zip(call_row, labels[2].tolist(), strict=True) if label != -100]
    assert trained == tok.encode("<python>12+34</python>46").ids + [EOS_ID]
    assert input_ids[1].tolist()[:8] == tok.encode("<tools>12+34=4").ids
    assert tool_modes(1000, 0.0, seed=1) == [PLAIN] * 1000
    modes = tool_modes(4000, 0.25, seed=1)
    assert 800 < modes.count(TOOLS_CALL) + modes.count(TOOLS_DIRECT) < 1200
