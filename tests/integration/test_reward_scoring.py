"""The reward_model scorer against real engines serving a reward model on /classify: samples of
many groups share batched calls and are each scored as alone; an engine that is away fails the
scoring with its reason and the group is scored once it is back (nothing lost, never a silent
zero); a sample the model refuses is dead-lettered with the engine's reason while the others
are scored; and an environment scored by the bootstrap reward model trains on the cluster."""

from __future__ import annotations

import asyncio
import math
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from policyloop.bus import Bus, rollouts_subject
from policyloop.common.ports import free_port
from policyloop.contracts.v1 import bus_pb2
from policyloop.engines.embedded import EmbeddedEngine, start_engine
from policyloop.scorers.classify_batcher import RewardModelUnavailable
from policyloop.scorers.reward_model import reward_model_scorer, reward_model_text
from policyloop.scorers.settings import ModelScorerSettings, RewardModelSettings, ScorerContext
from policyloop.telemetry.metrics import REWARD_MODEL_BATCH
from tests.conftest import ServiceLauncher, fast_limits
from tests.helpers import eventually, publish_group, stored, stored_samples
from tests.tiny_model import build_tiny_reward_model, reward_model_scores

SIGMOID = bus_pb2.RewardModelScorer.NORMALIZATION_SIGMOID


@pytest.fixture(scope="module")
def tiny_reward_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_reward_model(tmp_path_factory.mktemp("tiny-reward-model"), max_position_embeddings=24)


@pytest.fixture
async def reward_engine(tiny_reward_model: Path) -> AsyncIterator[EmbeddedEngine]:
    running = await start_engine(tiny_reward_model, max_batch=8, threads=1)
    yield running
    await running.stop()


def sample(trajectory_id: str, prompt: str, response: str, scorer: bus_pb2.RewardModelScorer) -> bus_pb2.Trajectory:
    return bus_pb2.Trajectory(
        trajectory_id=trajectory_id, task_id=trajectory_id, group_id=trajectory_id, group_size=1,
        environment="sums", prompt_text=prompt, response_text=response, response_token_ids=[5],
        behaviour_logprobs=[-1.0], loss_mask=[True], finish_reason=bus_pb2.FINISH_REASON_STOP,
        version_spans=[bus_pb2.VersionSpan(version=0, start=0, end=1)],
        scorer=bus_pb2.Scorer(reward_model=scorer))


def batches_made(model: str) -> float:
    return sum(s.value for m in REWARD_MODEL_BATCH.collect() for s in m.samples
               if s.name.endswith("_count") and s.labels["model"] == model)


async def test_samples_of_many_groups_share_batched_calls_and_score_as_alone(
        reward_engine: EmbeddedEngine, tiny_reward_model: Path) -> None:
    settings = ModelScorerSettings(reward_models=RewardModelSettings(
        engines={"tiny-rm": [reward_engine.base_url]}, max_batch=8, max_wait_s=0.05, concurrency=2))
    scorer = reward_model_scorer(ScorerContext(settings))
    spec = bus_pb2.RewardModelScorer(model="tiny-rm", normalization=SIGMOID, scale=2.0, shift=-1.0)
    samples = [sample(f"s{i}", f"{i}+{i}=", str(2 * i + i % 3), spec) for i in range(24)]
    before = batches_made("tiny-rm")
    try:
        scores = await asyncio.gather(*(scorer.score(t) for t in samples))
    finally:
        await scorer.close()
    raw = reward_model_scores(tiny_reward_model, [reward_model_text(t.prompt_text, t.response_text) for t in samples])
    assert [reward for reward, _ in scores] == pytest.approx([2.0 / (1 + math.exp(-r)) - 1.0 for r in raw],
                                                             abs=1e-5)
    [part] = scores[0][1]
    assert part.name == "reward_model" and part.weight == 1.0 and part.detail.startswith("tiny-rm: score ")
    # 24 samples that arrived together went in 3 calls of 8, not 24 calls.
    assert reward_engine.scheduler.classified_prompts == 24
    assert batches_made("tiny-rm") - before == 3


async def test_an_unknown_model_or_an_unreachable_engine_fails_with_the_reason() -> None:
    gone = f"http://127.0.0.1:{free_port()}"
    scorer = reward_model_scorer(ScorerContext(ModelScorerSettings(reward_models=RewardModelSettings(
        engines={"away": [gone]}, timeout_s=20))))
    try:
        with pytest.raises(RewardModelUnavailable, match="'elsewhere' is not a reward model this replica reaches"):
            await scorer.score(sample("a", "1+1=", "2", bus_pb2.RewardModelScorer(model="elsewhere")))
        with pytest.raises(RewardModelUnavailable, match="cannot connect"):
            await scorer.score(sample("b", "1+1=", "2", bus_pb2.RewardModelScorer(model="away")))
    finally:
        await scorer.close()


def service_metric(port: int, name: str, **labels: str) -> float:
    """A sample of a service's /metrics (0 when absent)."""
    from prometheus_client.parser import text_string_to_metric_families

    page = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return sum(s.value for family in text_string_to_metric_families(page) for s in family.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


async def test_an_engine_outage_loses_nothing_and_a_refused_sample_is_dead_lettered_with_the_reason(
        bus: Bus, services: ServiceLauncher, tiny_reward_model: Path) -> None:
    port = free_port()
    reward = services.start("reward", env={"POLICYLOOP_REWARD_MODELS__ENGINES": f'{{"tiny-rm": ["http://127.0.0.1:{port}"]}}',
                                           "POLICYLOOP_REWARD_MODELS__TIMEOUT_S": "30"},
                            limits=fast_limits(max_deliver=20))
    await services.wait_healthy(reward, timeout_s=60)
    spec = bus_pb2.RewardModelScorer(model="tiny-rm")
    # The reward model's engine is not up: the scoring fails, is retried, and nothing is stored.
    await publish_group(bus, rollouts_subject("sums"), sample("early", "12+34=", "46", spec))

    async def failed_once() -> bool:
        return service_metric(reward.ports["http"], "policyloop_reward_model_failures_total",
                              model="tiny-rm", reason="unavailable") >= 1

    await eventually(failed_once, timeout_s=60, what="the scoring failed while the engine was away")
    assert await stored_samples(bus, "TRAJECTORIES") == []
    engine = await start_engine(tiny_reward_model, port=port, max_batch=8, threads=1)
    try:
        # Back: the group is scored, once. Beside it, a sample longer than the model's context
        # (24 tokens) and one that fits: only the long one is refused, with the engine's reason.
        await publish_group(bus, rollouts_subject("sums"), sample("long", "1+1=", "2" * 40, spec))
        await publish_group(bus, rollouts_subject("sums"), sample("fits", "9+9=", "18", spec))

        async def scored() -> bool:
            return {t.trajectory_id for t in await stored_samples(bus, "TRAJECTORIES")} == {"early", "fits"}

        await eventually(scored, timeout_s=60, what="the samples scored once the engine is back")

        async def dead_lettered() -> bool:
            return len(await stored(bus, "DLQ", bus_pb2.DeadLetter)) == 1

        await eventually(dead_lettered, timeout_s=30, what="the refused sample dead-lettered")
    finally:
        await engine.stop()
    [letter] = await stored(bus, "DLQ", bus_pb2.DeadLetter)
    assert "long" in letter.reason and "context length" in letter.reason, letter.reason
    scored_by_id = {t.trajectory_id: t for t in await stored_samples(bus, "TRAJECTORIES")}
    raw = reward_model_scores(tiny_reward_model, ["12+34=46", "9+9=18"])
    assert [scored_by_id["early"].reward, scored_by_id["fits"].reward] == pytest.approx(raw, abs=1e-5)
    assert len(await stored_samples(bus, "TRAJECTORIES")) == 2


GROUPS_PER_STEP, GROUP_SIZE, STEPS = 2, 4, 2


def arithmetic_tasks(path: Path, count: int) -> Path:
    import json

    from policyloop.envs.arithmetic import ArithmeticConfig, train_problems

    path.write_text("\n".join(json.dumps({"prompt": p.prompt, "answer": p.answer})
                              for p in train_problems(ArithmeticConfig(), count, seed=5)))
    return path


@pytest.mark.timeout(480)
async def test_environments_scored_by_the_bootstrap_reward_model_and_by_a_judge_train_on_the_cluster(
        bus: Bus, services: ServiceLauncher, redis_client, request: pytest.FixtureRequest,  # type: ignore[no-untyped-def]
        tmp_path: Path) -> None:
    """The loop's real services on the bootstrap policy: an environment scored by the bootstrap
    reward model (its engine beside them, as `up --reward-model` runs it) trains two steps, each
    sample's reward the model's sigmoid score of its prompt and response; then one judged by an
    LLM judge on the cluster's own OpenAI-compatible endpoint (the serving API over the policy)
    trains two more, each reward the judge's verdict."""
    from tests.conftest import prebuilt_model
    from tests.helpers import openai_endpoint, submit_and_start, trained_once
    from tests.integration.test_openai_endpoint import with_chat_template

    policy = prebuilt_model(request.config, "arithmetic")
    reward_model = prebuilt_model(request.config, "reward_model")
    engine = await start_engine(reward_model, max_batch=32, threads=1)
    try:
        async with openai_endpoint(with_chat_template(policy, tmp_path / "judge"), bus, "judge-model") as (
                judge_url, _engine, _tokenizer):
            env = {"POLICYLOOP_REWARD_MODELS__ENGINES": f'{{"arith-rm": ["{engine.base_url}"]}}',
                   "POLICYLOOP_JUDGES__ENDPOINTS": f'{{"cluster": {{"base_url": "{judge_url}/v1", '
                                                   f'"model": "judge-model"}}}}'}
            loop = await services.start_loop(policy, GROUPS_PER_STEP, names=("gateway", "rollout", "reward"),
                                             env=env)
            port, samples = loop["gateway"].ports["grpc"], STEPS * GROUPS_PER_STEP * GROUP_SIZE
            tasks = arithmetic_tasks(tmp_path / "sums.jsonl", 8)
            await submit_and_start(port, "rm-sums", [str(tasks), "--scorer", "reward_model", "--reward-model",
                                                     "arith-rm", "--normalization", "sigmoid", "--max-new-tokens",
                                                     "6"], tasks=8, group_size=GROUP_SIZE, run_id="rm-run",
                                   num_tasks=STEPS * GROUPS_PER_STEP)
            await trained_once(bus, redis_client, "rm-run", steps=STEPS, samples=samples, timeout_s=300)
            template = tmp_path / "judge.txt"
            template.write_text("{response}+10=")
            await submit_and_start(port, "judged-sums", [
                str(tasks), "--scorer", "judge", "--judge", "cluster", "--judge-template", str(template),
                "--score-range", "0,210", "--judge-max-tokens", "6", "--timeout-s", "60", "--max-new-tokens", "6"],
                tasks=8, group_size=GROUP_SIZE, run_id="judged-run", num_tasks=STEPS * GROUPS_PER_STEP)
            await trained_once(bus, redis_client, "judged-run", steps=2 * STEPS, samples=samples, timeout_s=300)
    finally:
        await engine.stop()
    scored = await stored_samples(bus, "TRAJECTORIES")
    by_rm = [t for t in scored if t.run_id == "rm-run"]
    judged = [t for t in scored if t.run_id == "judged-run"]
    assert len(by_rm) == len(judged) == samples
    raw = reward_model_scores(reward_model, [reward_model_text(t.prompt_text, t.response_text) for t in by_rm])
    assert [t.reward for t in by_rm] == pytest.approx([1 / (1 + math.exp(-r)) for r in raw], abs=1e-5)
    assert all(t.reward_breakdown[0].name == "reward_model" for t in by_rm)
    assert all(t.reward_breakdown[0].name == "judge" and 0.0 <= t.reward <= 1.0 for t in judged)


# Slow (a run of 80 steps, minutes): the default run trains the same path for two steps above.
@pytest.mark.slow
@pytest.mark.timeout(1500)
async def test_the_reward_models_reward_rises_over_a_run(
        bus: Bus, services: ServiceLauncher, redis_client, request: pytest.FixtureRequest,  # type: ignore[no-untyped-def]
        tmp_path: Path) -> None:
    """80 steps of 16 groups of 8 on the bootstrap policy, scored by the bootstrap reward model
    alone: the mean reward of the samples the last versions generated beats the first versions'."""
    from policyloop.state import VersionRegistry
    from tests.conftest import prebuilt_model
    from tests.helpers import submit_and_start

    steps, groups, size = 80, 16, 8
    policy = prebuilt_model(request.config, "arithmetic")
    engine = await start_engine(prebuilt_model(request.config, "reward_model"), max_batch=64, threads=1)
    try:
        loop = await services.start_loop(policy, groups, names=("gateway", "rollout", "reward"), env={
            "POLICYLOOP_REWARD_MODELS__ENGINES": f'{{"arith-rm": ["{engine.base_url}"]}}',
            "POLICYLOOP_OPTIMIZER__LR": "3e-4"})
        await submit_and_start(loop["gateway"].ports["grpc"], "rm-sums", [
            str(arithmetic_tasks(tmp_path / "sums.jsonl", 256)), "--scorer", "reward_model", "--reward-model",
            "arith-rm", "--normalization", "sigmoid", "--max-new-tokens", "6"], tasks=256, group_size=size,
            run_id="rm-run", num_tasks=steps * groups)
        versions = VersionRegistry(redis_client, "default")

        async def trained() -> bool:
            return (await versions.get("policy") or 0) >= steps

        await eventually(trained, timeout_s=1200, interval_s=2, what=f"{steps} steps")
    finally:
        await engine.stop()
    by_version: dict[int, list[float]] = {}
    for traj in await stored_samples(bus, "TRAJECTORIES"):
        by_version.setdefault(max(s.version for s in traj.version_spans), []).append(traj.reward)
    early = [r for v in sorted(by_version)[:10] for r in by_version[v]]
    late = [r for v in sorted(by_version)[-10:] for r in by_version[v]]
    assert sum(late) / len(late) - sum(early) / len(early) >= 0.05, (sum(early) / len(early), sum(late) / len(late))
