"""The one episode loop (envs/episode.py) over a real embedded engine on the tiny model: an
environment with its own state answers each model turn with observation tokens and a step
reward; episodes run in lockstep (one engine call a round); the model's tokens are exactly the
engine's continuation of the exact transcript; observation tokens are masked out and carry
logprob 0; per-step rewards stay on their turns; a single completion is the one-step case."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from policyloop.contracts.v1 import bus_pb2
from policyloop.engines.partial import Completion, generate_resumable_batch
from policyloop.engines.protocol import GenerateRequest, SamplingParams
from policyloop.envs.episode import ModelTurn, Observation, SingleTurn, run_episodes


class Counter:
    """A stateful environment as a user would write one: it counts the model's turns, answers
    each with `observation` tokens and rewards step k with k (the last step with -1)."""

    def __init__(self, stop_id: int, observation: tuple[int, ...]) -> None:
        self.stop_token_ids = (stop_id,)
        self.observation = observation
        self.seen: list[ModelTurn] = []

    async def step(self, turn: ModelTurn) -> Observation:
        self.seen.append(turn)
        if turn.final:
            return Observation(reward=-1.0, done=True)
        return Observation(self.observation, bus_pb2.Turn(role=bus_pb2.Turn.ROLE_TOOL, tool="counter",
                                                          status="ok", text=f"count {len(self.seen)}"),
                           reward=float(turn.index))


@pytest.fixture
async def engine(tiny_model_dir: Path) -> AsyncIterator[Any]:
    from policyloop.engines.embedded import start_engine
    from policyloop.engines.sglang_client import SGLangClient

    running = await start_engine(tiny_model_dir, max_batch=8, threads=1, weight_version="3")
    client = SGLangClient(running.base_url, timeout_s=60, retries=0)
    try:
        yield client
    finally:
        await client.close()
        await running.stop()


def request(prompt: list[int], budget: int, rid: str) -> GenerateRequest:
    return GenerateRequest(input_ids=prompt, rid=rid, sampling_params=SamplingParams(
        max_new_tokens=budget, temperature=0.0))


@pytest.mark.timeout(120)
async def test_a_stateful_environment_runs_in_lockstep_with_exact_tokens_and_step_rewards(engine: Any) -> None:
    prompts = [[5, 6, 7], [8, 9]]
    # Each episode's turn ends on the second token the model greedily writes from its prompt.
    firsts = [c.result.output_ids for c in await generate_resumable_batch(
        engine, [request(p, 2, f"probe-{i}") for i, p in enumerate(prompts)])]
    assert all(len(first) == 2 for first in firsts)
    envs = [Counter(first[1], (11, 12, 13)) for first in firsts]
    rounds: list[int] = []

    async def generate_batch(requests: list[GenerateRequest]) -> list[Completion]:
        rounds.append(len(requests))
        return await generate_resumable_batch(engine, requests)

    results = await run_episodes([request(p, 8, f"ep-{i}") for i, p in enumerate(prompts)], envs,
                                 generate_batch=generate_batch, decode=lambda ids: " ".join(map(str, ids)),
                                 max_turns=4)
    assert rounds[0] == 2  # one engine call for both episodes' first turns
    for prompt, env, episode in zip(prompts, envs, results, strict=True):
        ids, mask = episode.result.output_ids, episode.loss_mask
        model_turns = [t for t in episode.turns if t.role == bus_pb2.Turn.ROLE_MODEL]
        observed = [t for t in episode.turns if t.role == bus_pb2.Turn.ROLE_TOOL]
        assert len(model_turns) == len(env.seen) >= 2 and len(observed) == len(model_turns) - 1
        assert model_turns[0].end - model_turns[0].start == 2  # stopped on the environment's stop id
        assert sum(t.end - t.start for t in model_turns) <= 8  # the budget counts model tokens only
        assert env.seen[-1].final and not any(t.final for t in env.seen[:-1])
        assert episode.step_rewards == [*map(float, range(len(model_turns) - 1)), -1.0]
        for turn in observed:
            assert ids[turn.start:turn.end] == [11, 12, 13] and not any(mask[turn.start:turn.end])
            assert episode.result.output_logprobs[turn.start:turn.end] == [0.0, 0.0, 0.0]
            assert turn.tool == "counter" and turn.text.startswith("count ")
        for turn in model_turns:  # the engine's own continuation of the exact transcript so far
            assert all(mask[turn.start:turn.end])
            [again] = await generate_resumable_batch(engine, [GenerateRequest(
                input_ids=prompt + ids[:turn.start], sampling_params=SamplingParams(
                    max_new_tokens=turn.end - turn.start, temperature=0.0,
                    stop_token_ids=list(env.stop_token_ids)))])
            assert again.result.output_ids == ids[turn.start:turn.end]
        assert {s.version for s in episode.result.weight_versions or []} == {"3"}


@pytest.mark.timeout(120)
async def test_a_single_completion_is_the_one_step_episode(engine: Any) -> None:
    calls: list[int] = []

    async def generate_batch(requests: list[GenerateRequest]) -> list[Completion]:
        calls.append(len(requests))
        return await generate_resumable_batch(engine, requests)

    group = [request([5, 6], 4, f"one-{i}") for i in range(3)]
    results = await run_episodes(group, [SingleTurn() for _ in group], generate_batch=generate_batch,
                                 decode=lambda ids: "", max_turns=5)
    assert calls == [3]  # the group in one engine call, one round
    [plain] = await generate_resumable_batch(engine, [request([5, 6], 4, "plain")])
    for episode in results:
        assert episode.result.output_ids == plain.result.output_ids and all(episode.loss_mask)
        assert [t.role for t in episode.turns] == [bus_pb2.Turn.ROLE_MODEL] and episode.step_rewards == []
    with pytest.raises(ValueError, match="one episode per request"):
        await run_episodes(group, [SingleTurn()], generate_batch=generate_batch, decode=str)
