"""The judge scorer against the cluster's own OpenAI-compatible endpoint (the serving replica's
API over an embedded engine, here on the bootstrap arithmetic policy with a plain chat template)
asked through the official `openai` client: the reward is the judge's greedy reply read as the
verdict says; a reply is cached in Redis by everything sent, so a redelivered sample is not judged
again, by this replica or another; a request the judge refuses is an error with its reason; and a
judge that is away loses nothing: the reward service retries the group and scores it once the
judge is back."""

from __future__ import annotations

import urllib.request
from pathlib import Path

import pytest

from policyloop.bus import Bus, rollouts_subject
from policyloop.common.ports import free_port
from policyloop.contracts.v1 import bus_pb2
from policyloop.scorers.judge import judge_prompt, judge_scorer, judge_spec, verdict
from policyloop.scorers.score import UnscorableTrajectory
from policyloop.scorers.settings import JudgeEndpoint, JudgeSettings, ModelScorerSettings, ScorerContext
from policyloop.telemetry.metrics import JUDGE_REQUESTS
from tests.conftest import ServiceLauncher, fast_limits, prebuilt_model
from tests.helpers import eventually, openai_endpoint, publish_group, stored_samples
from tests.integration.test_openai_endpoint import with_chat_template

openai = pytest.importorskip("openai")
SERVED = "judge-model"
# The policy finishes the response + 10 as an addition (it gives a number for any 0-3 digit response): a
# number the verdict maps onto [0, 1].
SPEC = judge_spec("cluster", "{response}+10=", verdict_kind="number", min_score=0, max_score=210, max_tokens=6)


@pytest.fixture(scope="module")
def judge_model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("judge") / "model"
    return with_chat_template(prebuilt_model(request.config, "arithmetic"), directory)


def sample(trajectory_id: str, prompt: str, response: str, spec: bus_pb2.JudgeScorer = SPEC) -> bus_pb2.Trajectory:
    return bus_pb2.Trajectory(
        trajectory_id=trajectory_id, task_id=trajectory_id, group_id=trajectory_id, group_size=1,
        environment="sums", prompt_text=prompt, response_text=response, response_token_ids=[5],
        behaviour_logprobs=[-1.0], loss_mask=[True], finish_reason=bus_pb2.FINISH_REASON_STOP,
        version_spans=[bus_pb2.VersionSpan(version=0, start=0, end=1)],
        scorer=bus_pb2.Scorer(judge=spec))


async def asked_directly(url: str, content: str, max_tokens: int) -> str:
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none")
    try:
        answer = await client.chat.completions.create(model=SERVED, messages=[{"role": "user", "content": content}],
                                                      max_tokens=max_tokens, temperature=0.0)
    finally:
        await client.close()
    return answer.choices[0].message.content or ""


def judgements(outcome: str) -> float:
    return sum(s.value for m in JUDGE_REQUESTS.collect() for s in m.samples
               if s.name.endswith("_total") and s.labels == {"judge": "cluster", "outcome": outcome})


def settings(url: str) -> ModelScorerSettings:
    return ModelScorerSettings(judges=JudgeSettings(
        endpoints={"cluster": JudgeEndpoint(base_url=url + "/v1", model=SERVED)}, timeout_s=60, retries=0))


async def test_a_judgement_is_the_reply_read_and_a_redelivered_sample_is_not_judged_again(
        bus: Bus, redis_client, judge_model_dir: Path) -> None:  # type: ignore[no-untyped-def]
    async with openai_endpoint(judge_model_dir, bus, SERVED) as (url, _engine, _tokenizer):
        traj = sample("a", "12+34=", "46")
        reply = await asked_directly(url, judge_prompt(SPEC.template, traj), SPEC.max_tokens)
        replicas = [judge_scorer(ScorerContext(settings(url), redis_client, "judge-test")) for _ in range(2)]
        asked, cached = judgements("asked"), judgements("cached")
        try:
            reward, [part] = await replicas[0].score(traj)
            assert reward == pytest.approx(verdict(SPEC, reply)) and part.name == "judge"
            assert part.detail == f"cluster: {reply!r}"
            # The group redelivered, to this replica and to another: the reply kept in Redis.
            assert (await replicas[0].score(traj))[0] == reward
            again = bus_pb2.Trajectory()
            again.CopyFrom(traj)
            assert (await replicas[1].score(again))[0] == reward
            assert (judgements("asked") - asked, judgements("cached") - cached) == (1, 2)
            # Another response is another judgement.
            await replicas[1].score(sample("b", "12+34=", "47"))
            assert judgements("asked") - asked == 2
            # A request the judge refuses (a reply budget past the model's context): its reason.
            too_long = judge_spec("cluster", "{response}+10=", max_tokens=4000)
            with pytest.raises(UnscorableTrajectory, match="judge 'cluster' refused the request: .*max_tokens"):
                await replicas[0].score(sample("c", "1+1=", "2", too_long))
        finally:
            for replica in replicas:
                await replica.close()


def service_metric(port: int, name: str, **labels: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    page = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return sum(s.value for family in text_string_to_metric_families(page) for s in family.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


async def test_a_judge_outage_loses_nothing(bus: Bus, services: ServiceLauncher, judge_model_dir: Path) -> None:
    port = free_port()
    endpoints = f'{{"cluster": {{"base_url": "http://127.0.0.1:{port}/v1", "model": "{SERVED}"}}}}'
    reward = services.start("reward", env={"POLICYLOOP_JUDGES__ENDPOINTS": endpoints,
                                           "POLICYLOOP_JUDGES__RETRIES": "0"}, limits=fast_limits(max_deliver=20))
    await services.wait_healthy(reward, timeout_s=60)
    traj = sample("while-away", "12+34=", "46")
    await publish_group(bus, rollouts_subject("sums"), traj)

    async def failed_once() -> bool:
        return service_metric(reward.ports["http"], "policyloop_judge_requests_total", judge="cluster",
                              outcome="unavailable") >= 1

    await eventually(failed_once, timeout_s=60, what="the judgement failed while the judge was away")
    assert await stored_samples(bus, "TRAJECTORIES") == []
    async with openai_endpoint(judge_model_dir, bus, SERVED, port=port) as (url, _engine, _tokenizer):
        async def scored() -> bool:
            return len(await stored_samples(bus, "TRAJECTORIES")) == 1

        await eventually(scored, timeout_s=60, what="the group scored once the judge is back")
        reply = await asked_directly(url, judge_prompt(SPEC.template, traj), SPEC.max_tokens)
    [stored] = await stored_samples(bus, "TRAJECTORIES")
    assert stored.reward == pytest.approx(verdict(SPEC, reply))
    assert service_metric(reward.ports["http"], "policyloop_judge_requests_total", judge="cluster",
                          outcome="asked") == 1
