"""Scoring one version on a run's eval splits: greedy, one sample per task, judged by the
environment's own scorer (the reward service's registry), on an engine that serves exactly
that version. Each sample is an episode of the one loop (envs/episode.py), as the rollout
replicas sample them: a single completion, a multi-turn episode with tools, or an environment
program's episode in a sandbox session, scored on its whole transcript."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, nullcontext
from dataclasses import dataclass

from policyloop.common.clock import now_ms
from policyloop.contracts.v1 import bus_pb2, loop_pb2
from policyloop.engines.partial import Completion, generate_resumable
from policyloop.engines.protocol import GenerateRequest, SamplingParams
from policyloop.engines.sglang_client import SGLangClient
from policyloop.envs.chat_env import transcript as environment_transcript
from policyloop.envs.driven import Driver, driver_of
from policyloop.envs.episode import Episode, SingleTurn, run_episodes
from policyloop.envs.spec import DEFAULT_MAX_NEW_TOKENS, task_scorer
from policyloop.envs.tool_episodes import transcript
from policyloop.envs.tools import tool_formats
from policyloop.scorers.registry import ScorerRegistry

WILSON_Z = 1.96  # a 95% interval

_FINISH = {"stop": bus_pb2.FINISH_REASON_STOP, "length": bus_pb2.FINISH_REASON_LENGTH}


class EvaluationError(RuntimeError):
    """The version could not be scored (the engine answered with another version, a scorer failed)."""


def wilson_interval(passed: int, total: int, z: float = WILSON_Z) -> tuple[float, float]:
    """The Wilson score interval of a pass rate: unlike the normal approximation it stays within
    [0, 1] and is not empty at 0 or `total` passes."""
    if total <= 0:
        return 0.0, 1.0
    p = passed / total
    denominator = 1 + z * z / total
    centre = (p + z * z / (2 * total)) / denominator
    half = z * math.sqrt(p * (1 - p) / total + z * z / (4 * total * total)) / denominator
    return max(0.0, centre - half), min(1.0, centre + half)


@dataclass(frozen=True)
class EvalItem:
    """One eval task, ready to be sampled: its prompt ids, scorer and generation budget."""

    environment: str
    index: int
    template: bus_pb2.Trajectory  # prompt, scorer and metadata; no response yet
    max_new_tokens: int
    stop_token_ids: tuple[int, ...]
    tools: tuple[str, ...] = ()      # the environment's tools: a multi-turn episode
    max_turns: int = 1
    driver: Driver | None = None     # an environment that drives its episodes: its reset gives the prompt

    @property
    def episodic(self) -> bool:
        """Sampled as an episode of its environment (tools, or an environment driving it), not one completion."""
        return bool(self.tools) or self.driver is not None


# Opens an episodic item's episode (given its request id): the episode, and the prompt's token ids
# (the item's own, or what a program's reset gave). Closed (a program's session ended) once scored.
EpisodeOpener = Callable[[EvalItem, str], AbstractAsyncContextManager[tuple[Episode, list[int]]]]


def eval_items(environments: Mapping[str, loop_pb2.Environment], encode: Callable[[str], list[int]],
               default_stop_ids: Sequence[int], max_tasks: int) -> list[EvalItem]:
    """The first `max_tasks` eval tasks of each environment (all with 0), in order; environments
    without an eval split contribute nothing."""
    items = []
    for key, env in sorted(environments.items()):
        tasks = env.eval_tasks[:max_tasks] if max_tasks else env.eval_tasks
        stops = tuple(env.sampling.stop_token_ids or default_stop_ids)
        for i, spec in enumerate(tasks):
            prompt = list(spec.prompt_token_ids) or (encode(spec.prompt_text) if spec.prompt_text else [])
            template = bus_pb2.Trajectory(
                trajectory_id=f"eval:{key}:{i}", environment=key, prompt_token_ids=prompt,
                prompt_text=spec.prompt_text, metadata=spec.metadata, scorer=task_scorer(env, spec),
                group_size=1,
            )
            items.append(EvalItem(key, i, template, env.sampling.max_new_tokens or DEFAULT_MAX_NEW_TOKENS, stops,
                                  tuple(env.tools), max(1, env.max_turns), driver_of(env)))
    return items


@dataclass(frozen=True)
class Outcome:
    environment: str
    reward: float
    passed: bool


MODEL_PASS = 0.5  # a model scorer's reward that passes: a sigmoid reward model's P(good), a judge's half-range


def passed(traj: bus_pb2.Trajectory, reward: float, breakdown: Sequence[bus_pb2.RewardComponent]) -> bool:
    """A task passes when every component of its score passed (arithmetic: well formed and exact);
    an environment program's episode, when the rewards it gave sum to 1 or more; a sample a model
    scored (reward model, judge), when its reward is at least MODEL_PASS."""
    kind = traj.scorer.WhichOneof("kind")
    if kind == "environment_reward":
        return reward >= 1.0
    if kind in ("reward_model", "judge"):
        return reward >= MODEL_PASS
    return bool(breakdown) and all(part.value >= 1.0 for part in breakdown)


async def score_version(engine: SGLangClient, items: Sequence[EvalItem], registry: ScorerRegistry, *, version: int,
                        decode: Callable[[Sequence[int]], str], concurrency: int, rid_prefix: str,
                        lora_path: str | None = None,
                        open_episode: EpisodeOpener | None = None) -> list[loop_pb2.EnvironmentScore]:
    """Samples every item greedily and scores it; raises EvaluationError when an answer came from
    another version than `version` (the engine must be pinned to it). `open_episode` opens an
    episodic item's episode (items with tools or a program need it); the rest are single completions."""
    gate = asyncio.Semaphore(max(1, concurrency))

    async def generate_batch(requests: list[GenerateRequest]) -> list[Completion]:
        return [await generate_resumable(engine, request) for request in requests]

    async def one(item: EvalItem) -> Outcome:
        rid = f"{rid_prefix}-{item.environment}-{item.index}"
        if item.episodic and open_episode is None:
            raise EvaluationError(f"{item.environment} eval task {item.index}: a multi-turn item needs open_episode")
        opened = open_episode(item, rid) if item.episodic and open_episode is not None \
            else nullcontext((SingleTurn(), list(item.template.prompt_token_ids)))
        async with gate, opened as (episode, prompt):
            request = GenerateRequest(
                input_ids=prompt, rid=rid, return_logprob=False, lora_path=lora_path,
                sampling_params=SamplingParams(max_new_tokens=item.max_new_tokens, temperature=0.0,
                                               stop_token_ids=item.stop_token_ids))
            [done] = await run_episodes([request], [episode], generate_batch=generate_batch, decode=decode,
                                        max_turns=item.max_turns)
        result = done.result
        answered = {str(result.weight_version), *(str(s.version) for s in result.weight_versions or [])}
        if answered != {str(version)}:
            raise EvaluationError(f"the engine answered with version {', '.join(sorted(answered))}, not {version}: "
                                  f"it must serve only the version under evaluation")
        traj = bus_pb2.Trajectory()
        traj.CopyFrom(item.template)
        del traj.prompt_token_ids[:]
        traj.prompt_token_ids.extend(prompt)
        traj.response_token_ids.extend(result.output_ids)
        traj.finish_reason = _FINISH.get(result.finish_reason, bus_pb2.FINISH_REASON_ERROR)
        if item.episodic:  # scored as the rollout's trajectories are: the turns say which tokens are whose
            traj.loss_mask.extend(done.loss_mask)
            traj.turns.extend(done.turns)
            traj.response_text = transcript(done.turns, tool_formats(list(item.tools))) if item.tools \
                else environment_transcript(done.turns)
        else:
            traj.response_text = done.turns[0].text
        try:
            reward, breakdown = await registry.score(traj)
        except ValueError as exc:  # UnscorableTrajectory: the environment's scorer cannot score it
            raise EvaluationError(f"{item.environment} eval task {item.index}: {exc}") from exc
        return Outcome(item.environment, reward, passed(traj, reward, breakdown))

    outcomes = await asyncio.gather(*(one(item) for item in items))
    by_env: dict[str, list[Outcome]] = {}
    for outcome in outcomes:
        by_env.setdefault(outcome.environment, []).append(outcome)
    return [environment_score(env, results) for env, results in sorted(by_env.items())]


def environment_score(environment: str, outcomes: Sequence[Outcome]) -> loop_pb2.EnvironmentScore:
    total, good = len(outcomes), sum(o.passed for o in outcomes)
    low, high = wilson_interval(good, total)
    return loop_pb2.EnvironmentScore(
        environment=environment, tasks=total, passed=good, pass_rate=good / total if total else 0.0,
        pass_rate_low=low, pass_rate_high=high,
        mean_reward=sum(o.reward for o in outcomes) / total if total else 0.0)


def version_eval(run_id: str, model: str, version: int, step: int, scores: Sequence[loop_pb2.EnvironmentScore],
                 *, seconds: float, evaluator: str) -> loop_pb2.VersionEval:
    """The result over every environment: the pass rate over all their tasks, with its interval."""
    total, good = sum(s.tasks for s in scores), sum(s.passed for s in scores)
    low, high = wilson_interval(good, total)
    return loop_pb2.VersionEval(
        run_id=run_id, model=model, version=version, step=step, environments=scores,
        pass_rate=good / total if total else 0.0, pass_rate_low=low, pass_rate_high=high,
        evaluated_unix_ms=now_ms(), seconds=seconds, evaluator=evaluator)
