"""Environment programs through the real rollout, sandbox and reward services, with the chat model:
each sample's episode runs the team's class (examples/environments/tally_desk.py) in a sandbox
session of its own; its reset is the prompt (rendered by the chat template, tools included), its
step rewards land on the model turns they reward, its answers are observation tokens the loss
never sees, and the trajectory's reward is what it gave. A program that fails fails its task
with the reason: retried, then dead-lettered, never trained."""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from policyloop.bus import Bus, tasks_subject
from policyloop.contracts.v1 import bus_pb2
from policyloop.contracts.validate import validate_trajectory
from policyloop.envs.programs import TALLY_DESK as DESK
from policyloop.sandbox.runner import SandboxUnavailable, check_isolation
from tests.conftest import ServiceLauncher, prebuilt_model
from tests.helpers import checked_tool_turns, stored_samples, submit_and_start, the_one_dead_letter, trained_once
from tests.otlp_receiver import OtlpReceiver, ReceivedSpan

try:
    check_isolation()
except SandboxUnavailable as exc:  # pragma: no cover - depends on the machine
    pytest.skip(f"the sandbox cannot isolate jobs here: {exc}", allow_module_level=True)

MODEL = bus_pb2.Turn.ROLE_MODEL
BROKEN = b"class Broken:\n    def reset(self, task):\n        raise KeyError('orders.db')\n"


@pytest.fixture(scope="module")
def chat_model_dir(request: pytest.FixtureRequest) -> Path:
    return prebuilt_model(request.config, "chat")


@pytest.fixture
def receiver() -> Iterator[OtlpReceiver]:
    with OtlpReceiver() as received:
        yield received


def desk_task(task_id: str, seed: int, program: bus_pb2.EnvironmentProgram | None = None) -> bus_pb2.Task:
    program = program or bus_pb2.EnvironmentProgram(files={"tally_desk.py": DESK.read_bytes()},
                                                    entry="tally_desk:TallyDesk", step_seconds=10)
    return bus_pb2.Task(
        task_id=task_id, run_id="r", environment="desk@v1", group_size=4, metadata={"seed": str(seed)},
        sampling=bus_pb2.SamplingParams(max_new_tokens=96, temperature=1.0, seed=seed), max_turns=3,
        scorer=bus_pb2.Scorer(environment_reward=bus_pb2.EnvironmentRewardScorer()), program=program)


@pytest.mark.timeout(300)
async def test_the_evaluator_scores_a_program_split_episode_by_episode(
        bus: Bus, services: ServiceLauncher, chat_model_dir: Path) -> None:
    """Eval items of a program environment are episodes in sessions, greedy, judged by the rewards
    the program gave: the same seam and the same scorer as training."""
    import contextlib

    from policyloop.cluster.client import build_environment, read_program
    from policyloop.contracts.v1 import loop_pb2
    from policyloop.engines.embedded import start_engine
    from policyloop.engines.sglang_client import SGLangClient
    from policyloop.envs.chat_env import chat_template, task_reset
    from policyloop.envs.program import program_job, session_episode
    from policyloop.evaluation.scoring import eval_items, score_version
    from policyloop.scorers.registry import default_registry

    sandbox = services.start("sandbox")
    await services.wait_healthy(sandbox, timeout_s=90)
    tokenizer = AutoTokenizer.from_pretrained(chat_model_dir)
    env = build_environment("desk", "v1", [loop_pb2.TaskSpec(metadata={"seed": "0"})], "environment_reward",
                            max_turns=3, max_new_tokens=96, driver=read_program(DESK, "tally_desk:TallyDesk"))
    env.eval_tasks.extend(loop_pb2.TaskSpec(metadata={"seed": str(100 + i)}) for i in range(6))
    items = eval_items({"desk@v1": env}, tokenizer.encode, [tokenizer.eos_token_id], max_tasks=0)
    assert all(item.episodic and not item.template.prompt_token_ids for item in items)
    prompts: list[str] = []

    @contextlib.asynccontextmanager
    async def open_episode(item, rid):  # type: ignore[no-untyped-def]
        async with session_episode(bus, program_job(item.driver, job_id=f"env:{rid}", run_id="eval"),
                                   task_reset(item.template), template=chat_template(tokenizer),
                                   open_timeout_s=60) as (episode, ids):
            prompts.append(tokenizer.decode(ids))
            yield episode, ids

    async def no_jobs(job: bus_pb2.SandboxJob) -> bus_pb2.SandboxResult:
        raise AssertionError("the environment's rewards are read in process")

    engine = await start_engine(chat_model_dir, threads=1, weight_version="3")
    client = SGLangClient(engine.base_url, timeout_s=120)
    try:
        [score] = await score_version(client, items, default_registry(no_jobs), version=3, decode=tokenizer.decode,
                                      concurrency=3, rid_prefix="desk", open_episode=open_episode)
    finally:
        await client.close()
        await engine.stop()
    # Each item's prompt is its own reset (seeded by its metadata), and the split is scored whole.
    assert len(set(prompts)) == len(items) == score.tasks == 6 and all("What is" in p for p in prompts)
    assert 0.0 <= score.pass_rate <= 1.0 and score.pass_rate_low <= score.pass_rate <= score.pass_rate_high


STEPS, GROUPS_PER_STEP = 3, 2


@pytest.mark.timeout(420)
async def test_a_program_environment_trains_on_the_cluster(
        bus: Bus, services: ServiceLauncher, chat_model_dir: Path, redis_client, tmp_path: Path,  # type: ignore[no-untyped-def]
        receiver: OtlpReceiver) -> None:
    """Submitted with the CLI, run through the gateway: the learner trains on the desk's episodes,
    each sampled once in a sandbox session of its own, each trained once, with the rewards the
    desk gave; each reset and step is a span of its sample's trace. A program that fails fails its
    task with the reason: retried, then dead-lettered, never trained."""
    import json

    traced = {"POLICYLOOP_TRACING__OTLP_ENDPOINT": receiver.endpoint, "POLICYLOOP_TRACING__BATCH_DELAY_S": "0.2"}
    loop = await services.start_loop(chat_model_dir, GROUPS_PER_STEP, env=traced)
    gateway, learner, rollout = loop["gateway"], loop["learner"], loop["rollout"]
    broken = desk_task("broken", 0, bus_pb2.EnvironmentProgram(files={"broken.py": BROKEN}, entry="broken:Broken"))
    broken.group_size, broken.environment, broken.run_id = 1, "broken@v1", "other"
    await bus.publish(tasks_subject("broken@v1"), broken, "broken")
    tasks = tmp_path / "desk.jsonl"
    tasks.write_text("\n".join(json.dumps({"metadata": {"seed": str(seed)}}) for seed in range(20)))
    await submit_and_start(gateway.ports["grpc"], "desk", [
        str(tasks), "--program", str(DESK), "--entry", "tally_desk:TallyDesk", "--max-turns", "3",
        "--max-new-tokens", "96"], tasks=20, group_size=4, run_id="desk-run", num_tasks=STEPS * GROUPS_PER_STEP)
    await trained_once(bus, redis_client, "desk-run", steps=STEPS, samples=STEPS * GROUPS_PER_STEP * 4,
                       timeout_s=300)
    episodes = [t for t in await stored_samples(bus, "TRAJECTORIES") if t.run_id == "desk-run"]
    assert len(episodes) == STEPS * GROUPS_PER_STEP * 4
    steps = [e for e in learner.log_events() if e["event"] == "step"]
    assert len(steps) >= STEPS
    tokenizer = AutoTokenizer.from_pretrained(chat_model_dir)
    calls = 0
    for traj in episodes:
        validate_trajectory(traj)  # turns cover the response; only the model's tokens are trained on
        prompt = tokenizer.decode(traj.prompt_token_ids)
        # The reset's question, with the desk's calculator offered in the system turn.
        assert "What is" in prompt and '"name": "calculator"' in prompt and prompt.endswith("<|im_start|>assistant\n")
        model_turns = [t for t in traj.turns if t.role == MODEL]
        assert traj.turns[0].role == MODEL and traj.turns[-1].role == MODEL and 1 <= len(model_turns) <= 3
        # Every step was rewarded by the desk, and the trajectory's reward is their sum.
        assert all(t.HasField("reward") for t in model_turns)
        assert traj.scored and traj.reward == pytest.approx(sum(t.reward for t in model_turns))
        calls += checked_tool_turns(traj, tokenizer.decode)  # the tool results: observations, never trained on
    assert calls >= 1, "the chat model called the desk's calculator in none of the episodes"
    # The broken program: retried, then dead-lettered with its reason; none of its samples stored.
    letter = await the_one_dead_letter(bus, "broken", timeout_s=120)
    assert "KeyError" in letter.reason and "orders.db" in letter.reason
    with urllib.request.urlopen(f"http://127.0.0.1:{rollout.ports['http']}/metrics", timeout=5) as r:
        metrics = r.read().decode()
    assert 'policyloop_environment_failures_total{environment="broken@v1"}' in metrics
    check_step_spans(receiver, episodes[0])


def check_step_spans(receiver: OtlpReceiver, sampled: bus_pb2.Trajectory) -> None:
    """Each reset and step of the episode is a span under its sample's: one reset, then one per
    model turn."""
    def steps_of(spans: list[ReceivedSpan]) -> list[ReceivedSpan]:
        sample = next((x for x in spans if x.name == "sample"
                       and x.attributes.get("policyloop.trajectory_id") == sampled.trajectory_id), None)
        return [] if sample is None else [x for x in spans if x.name == "environment step"
                                          and x.parent_span_id == sample.span_id]

    model_turns = sum(t.role == MODEL for t in sampled.turns)
    receiver.wait_for(lambda spans: len(steps_of(spans)) == 1 + model_turns, "the episode's environment steps")
    kinds = sorted(str(x.attributes["policyloop.env_request"]) for x in steps_of(receiver.snapshot()))
    assert kinds == ["action"] * model_turns + ["reset"]
