"""Multi-turn episodes through the real rollout and sandbox services: the bootstrap policy (which
knows the python tool's format) calls the tool, the call runs as a sandbox job, its result is
inserted as a tool turn whose tokens are masked out of the loss, and the model answers after it."""

from __future__ import annotations

import re
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from policyloop.bus import Bus, tasks_subject
from policyloop.contracts.v1 import bus_pb2
from policyloop.contracts.validate import validate_trajectory
from policyloop.envs.tools import TOOL_FORMATS, find_call
from policyloop.models.tokenizer import VOCAB
from policyloop.sandbox.runner import SandboxUnavailable, check_isolation
from policyloop.scorers.answer import answer_text
from tests.conftest import ServiceLauncher, prebuilt_model
from tests.helpers import eventually, stored, stored_messages, stored_samples
from tests.otlp_receiver import OtlpReceiver, ReceivedSpan, lineage, lineage_or_none

try:
    check_isolation()
except SandboxUnavailable as exc:  # pragma: no cover - depends on the machine
    pytest.skip(f"the sandbox cannot isolate jobs here: {exc}", allow_module_level=True)

PYTHON = TOOL_FORMATS["python"]
MODEL, TOOL = bus_pb2.Turn.ROLE_MODEL, bus_pb2.Turn.ROLE_TOOL


@pytest.fixture(scope="module")
def bootstrap_model_dir(request: pytest.FixtureRequest) -> Path:
    # Built before the first test (tests/conftest.py): the build (45 s, minutes on a busy
    # machine) never counts against these tests' timeouts.
    return prebuilt_model(request.config, "tools")


def tool_task(task_id: str, prompt: str, max_turns: int = 3, seed: int = 11) -> bus_pb2.Task:
    return bus_pb2.Task(
        task_id=task_id, run_id="r", environment="tools@v1", prompt_text=f"<tools>{prompt}", group_size=8,
        sampling=bus_pb2.SamplingParams(max_new_tokens=24, temperature=1.0, seed=seed),
        scorer=bus_pb2.Scorer(builtin=bus_pb2.BuiltinVerifier(kind=bus_pb2.BuiltinVerifier.KIND_EXACT_ANSWER),
                              answer=str(eval(prompt.removesuffix("=")))),  # noqa: S307 - digits
        max_turns=max_turns, tools=["python"])


@pytest.fixture
def receiver() -> Iterator[OtlpReceiver]:
    with OtlpReceiver() as received:
        yield received


@pytest.mark.timeout(300)
async def test_tool_turns_run_in_the_sandbox_and_are_masked_out_of_the_loss(
        bus: Bus, services: ServiceLauncher, bootstrap_model_dir: Path, receiver: OtlpReceiver) -> None:
    traced = {"POLICYLOOP_TRACING__OTLP_ENDPOINT": receiver.endpoint, "POLICYLOOP_TRACING__BATCH_DELAY_S": "0.2"}
    sandbox = services.start("sandbox", env=traced)
    rollout = services.start("rollout", env={"POLICYLOOP_MODEL_PATH": str(bootstrap_model_dir), **traced,
                                             "POLICYLOOP_MAX_LAG": "-1", "POLICYLOOP_MAX_TOOL_TOKENS": "12"})
    await services.wait_healthy(sandbox, rollout, timeout_s=90)
    prompts = ["12+34=", "57+68=", "23+45=", "91+19="]
    for i, prompt in enumerate(prompts):
        await bus.publish(tasks_subject("tools@v1"), tool_task(f"t{i}", prompt), f"t{i}")
    unknown = tool_task("shell", "1+2=")
    unknown.tools[:] = ["shell"]  # no such tool: the task can never be sampled
    await bus.publish(tasks_subject("tools@v1"), unknown, "shell")

    async def all_generated() -> bool:
        return len(await stored_samples(bus, "ROLLOUTS")) == 8 * len(prompts)

    await eventually(all_generated, timeout_s=180, what="every episode generated")
    episodes = await stored_samples(bus, "ROLLOUTS")
    calls = ran = 0
    for traj in episodes:
        validate_trajectory(traj)  # turns cover the response; tool tokens are never trained on
        model_turns = [t for t in traj.turns if t.role == MODEL]
        assert traj.turns[0].role == MODEL and traj.turns[-1].role == MODEL and 1 <= len(model_turns) <= 3
        assert traj.response_text == "".join(
            f"{PYTHON.result_open}{t.text}{PYTHON.result_close}" if t.role == TOOL else t.text for t in traj.turns)
        assert answer_text(traj) == model_turns[-1].text
        for before, turn in zip(traj.turns, traj.turns[1:], strict=False):
            if turn.role != TOOL:
                continue
            calls += 1
            tokens = traj.response_token_ids[turn.start:turn.end]
            assert tokens[0] == VOCAB[PYTHON.result_open] and tokens[-1] == VOCAB[PYTHON.result_close]
            assert not any(traj.loss_mask[turn.start:turn.end])
            assert all(lp == 0.0 for lp in traj.behaviour_logprobs[turn.start:turn.end])
            assert all(traj.loss_mask[before.start:before.end])
            # The model turn before ended on the call's closing marker.
            assert traj.response_token_ids[before.end - 1] == VOCAB[PYTHON.call_close]
            call = find_call(before.text, [PYTHON])
            assert call is not None and turn.tool == "python"
            if not call.complete:
                assert turn.status == "no_call_open"
            elif re.fullmatch(r"(0|[1-9][0-9]*)[+-](0|[1-9][0-9]*)", call.code):
                # The sandbox evaluated the expression the model wrote, notebook-style.
                assert (turn.status, turn.text) == ("ok", str(eval(call.code))), call  # noqa: S307 - digits
                ran += 1
    # The tools bootstrap policy opens with a call about half the time (bootstrap.json's report).
    assert calls >= 4 and ran >= 1, (calls, ran)
    with urllib.request.urlopen(f"http://127.0.0.1:{rollout.ports['http']}/metrics", timeout=5) as r:
        metrics = r.read().decode()
    model_turns = sum(t.role == MODEL for traj in episodes for t in traj.turns)
    assert f'policyloop_episode_model_turns_count{{environment="tools@v1"}} {len(episodes)}.0' in metrics
    assert f'policyloop_episode_model_turns_sum{{environment="tools@v1"}} {model_turns}.0' in metrics
    [letter] = await stored(bus, "DLQ", bus_pb2.DeadLetter)
    assert letter.service == "rollout" and "shell" in letter.reason and letter.delivery_count == 1
    # Each tool call's sandbox job is a span in the episode's trace, under the call.
    ran_ok = [t.trajectory_id for t in episodes if any(turn.status == "ok" for turn in t.turns)]

    def job_of(spans: list[ReceivedSpan]) -> ReceivedSpan | None:
        return next((s for s in spans if s.service == "sandbox" and s.name == "process SANDBOX"
                     and str(s.attributes.get("policyloop.job_id")).startswith(f"tool:{ran_ok[0]}#")), None)

    def arrived(spans: list[ReceivedSpan]) -> bool:
        """The job's span and every span up to its trace's root (a parent may be in a later batch)."""
        job = job_of(spans)
        return job is not None and not lineage_or_none(spans, job)[0].parent_span_id

    receiver.wait_for(arrived, "the sandbox job's span and every span above it")
    spans = receiver.snapshot()
    chain = lineage(spans, job_of(spans))  # type: ignore[arg-type]
    assert [(s.service, s.name) for s in chain] == [
        ("rollout", "process TASKS"), ("rollout", "sample"), ("rollout", "tool call"), ("sandbox", "process SANDBOX")]
    assert chain[1].attributes["policyloop.trajectory_id"] == ran_ok[0]
    assert chain[2].attributes["policyloop.tool_status"] == chain[3].attributes["policyloop.job_outcome"] == "ok"
    turns = [s for s in spans if s.name == "model turn" and s.parent_span_id == chain[1].span_id]
    assert len(turns) >= 2 and all(s.service == "rollout" for s in turns)


@pytest.mark.timeout(300)
async def test_without_a_sandbox_a_tool_call_waits_and_nothing_is_published_half_done(
        bus: Bus, services: ServiceLauncher, bootstrap_model_dir: Path) -> None:
    rollout = services.start("rollout", env={"POLICYLOOP_MODEL_PATH": str(bootstrap_model_dir),
                                             "POLICYLOOP_MAX_LAG": "-1", "POLICYLOOP_MAX_TOOL_TOKENS": "12",
                                             "POLICYLOOP_TOOL_REPLY_TIMEOUT_S": "3"})
    await services.wait_healthy(rollout, timeout_s=90)
    await bus.publish(tasks_subject("tools@v1"), tool_task("waits", "12+34="), "waits")
    # No sandbox runs: the group's calls time out, the task goes back to TASKS, nothing is published.
    jobs = []

    async def tried() -> bool:
        jobs[:] = await stored(bus, "SANDBOX", bus_pb2.SandboxJob)
        return len(jobs) >= 1

    await eventually(tried, timeout_s=60, what="a tool call queued as a sandbox job")
    assert await stored_messages(bus, "ROLLOUTS") == []
    assert all(job.job_id.startswith("tool:waits/") for job in jobs)
    # A sandbox arrives: the redelivered task completes, every sample once.
    sandbox = services.start("sandbox")
    await services.wait_healthy(sandbox, timeout_s=60)

    async def generated() -> bool:
        return len(await stored_samples(bus, "ROLLOUTS")) == 8

    await eventually(generated, timeout_s=150, what="the group generated once a sandbox runs")
    assert sorted(t.trajectory_id for t in await stored_samples(bus, "ROLLOUTS")) == [
        f"waits/{i}" for i in range(8)]


@pytest.mark.timeout(300)
async def test_the_evaluator_scores_a_multi_turn_split_through_the_same_episodes(
        bus: Bus, services: ServiceLauncher, bootstrap_model_dir: Path) -> None:
    """score_version (the evaluator's) drives an eval split with tools through the episode loop:
    the model's calls run in the sandbox and it is judged on its answer after the tool's result.
    The same items as single completions (no tools) pass less: the model was taught to call."""
    import contextlib
    import dataclasses

    from transformers import AutoTokenizer

    from policyloop.contracts.v1 import loop_pb2
    from policyloop.engines.embedded import start_engine
    from policyloop.engines.sglang_client import SGLangClient
    from policyloop.envs.tool_episodes import ToolSettings, from_hf
    from policyloop.envs.tools import tool_formats
    from policyloop.evaluation.scoring import EvalItem, eval_items, score_version
    from policyloop.scorers.registry import default_registry

    sandbox = services.start("sandbox")
    await services.wait_healthy(sandbox, timeout_s=90)
    tokenizer = AutoTokenizer.from_pretrained(bootstrap_model_dir)
    env = loop_pb2.Environment(
        name="tools", version="v1", max_turns=3, tools=["python"],
        builtin=loop_pb2.BuiltinVerifier(kind=loop_pb2.BuiltinVerifier.KIND_EXACT_ANSWER),
        sampling=bus_pb2.SamplingParams(max_new_tokens=24),
        eval_tasks=[loop_pb2.TaskSpec(prompt_text=f"<tools>{p}", answer=str(eval(p.removesuffix("="))))  # noqa: S307
                    for p in ("12+34=", "57+68=", "23+45=", "91+19=", "30+44=", "66+17=")])
    items = eval_items({"tools@v1": env}, lambda text: tokenizer(text, add_special_tokens=False).input_ids,
                       [tokenizer.eos_token_id], max_tasks=0)
    statuses: list[str] = []

    def open_episode(item: EvalItem, rid: str):  # type: ignore[no-untyped-def]
        return contextlib.nullcontext((ToolSettings().episode(
            bus, job_id=f"tool:{rid}", run_id="eval", tokenizer=from_hf(tokenizer),
            formats=tool_formats(list(item.tools)), on_result=lambda call, status: statuses.append(status)),
            list(item.template.prompt_token_ids)))

    async def no_jobs(job: bus_pb2.SandboxJob) -> bus_pb2.SandboxResult:
        raise AssertionError("the exact-answer verifier runs in process")

    engine = await start_engine(bootstrap_model_dir, threads=1, weight_version="5")
    client = SGLangClient(engine.base_url, timeout_s=120)
    try:
        [episodes] = await score_version(client, items, default_registry(no_jobs), version=5, decode=tokenizer.decode,
                                         concurrency=3, rid_prefix="multi", open_episode=open_episode)
        single = [dataclasses.replace(item, tools=(), max_turns=1) for item in items]
        [alone] = await score_version(client, single, default_registry(no_jobs), version=5, decode=tokenizer.decode,
                                      concurrency=3, rid_prefix="single")
    finally:
        await client.close()
        await engine.stop()
    assert episodes.tasks == alone.tasks == 6 and "ok" in statuses  # some answers come after the tool's
    assert episodes.passed > alone.passed, (episodes, alone)
