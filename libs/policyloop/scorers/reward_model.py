"""The reward_model scorer: a reward model's score of a sample's prompt and response, asked of
the engines serving it (scorers.classify_batcher), normalised as the environment says."""

from __future__ import annotations

import math
from collections.abc import Mapping

from policyloop.contracts.v1 import bus_pb2
from policyloop.engines.sglang_client import SGLangClient
from policyloop.scorers.classify_batcher import ClassifyBatcher, RewardModelUnavailable
from policyloop.scorers.score import Score, UnscorableTrajectory, component
from policyloop.scorers.settings import ScorerContext

_SPEC = bus_pb2.RewardModelScorer


def reward_model_text(prompt: str, response: str) -> str:
    """What a reward model scores: the prompt, then the response (eos stripped). The bootstrap
    reward model (models/reward_model.py) is trained on exactly this, so RL shows it what it learned."""
    return prompt + response


def normalizations() -> list[str]:
    """The reward model scorer's normalizations, by the names people give them ("none", "sigmoid")."""
    return ["none" if n.endswith("UNSPECIFIED") else n.removeprefix("NORMALIZATION_").lower()
            for n in bus_pb2.RewardModelScorer.Normalization.keys()]


def normalization_value(name: str) -> int:
    values = bus_pb2.RewardModelScorer.Normalization.values()
    if name not in normalizations():
        raise ValueError(f"normalization must be one of {', '.join(normalizations())}, got {name!r}")
    return values[normalizations().index(name)]


def normalized(spec: bus_pb2.RewardModelScorer, score: float) -> float:
    """The reward for a model's `score`: scale * normalization(score) + shift (scale 0: 1)."""
    value = 1.0 / (1.0 + math.exp(-score)) if spec.normalization == _SPEC.NORMALIZATION_SIGMOID else score
    return (spec.scale or 1.0) * value + spec.shift


class RewardModelScorer:
    """Scores through the batcher of the model a trajectory's scorer names."""

    def __init__(self, batchers: Mapping[str, ClassifyBatcher], default_timeout_s: float) -> None:
        self.batchers = dict(batchers)
        self.default_timeout_s = default_timeout_s

    async def score(self, traj: bus_pb2.Trajectory) -> Score:
        spec = traj.scorer.reward_model
        batcher = self.batchers.get(spec.model)
        if batcher is None:  # another replica may reach it: retried, then dead-lettered with this
            reached = ", ".join(sorted(self.batchers)) or "none"
            raise RewardModelUnavailable(f"scorer.reward_model.model: {spec.model!r} is not a reward model this "
                                         f"replica reaches (reward_models.engines: {reached})")
        if not traj.prompt_text:
            raise UnscorableTrajectory("scorer.reward_model: the sample has no prompt text (its task gave token ids "
                                       "only); a reward model scores text")
        score = await batcher.score(reward_model_text(traj.prompt_text, traj.response_text),
                                    spec.timeout_seconds or self.default_timeout_s)
        if not math.isfinite(score):
            raise UnscorableTrajectory(f"reward model {spec.model!r} gave the score {score}")
        reward = normalized(spec, score)
        return reward, [component("reward_model", reward, 1.0, f"{spec.model}: score {score:.4f}")]

    async def close(self) -> None:
        for batcher in self.batchers.values():
            await batcher.close()


def reward_model_scorer(context: ScorerContext) -> RewardModelScorer:
    """The scorer of the reward models in the settings, a batcher and clients for each."""
    models = context.settings.reward_models
    batchers = {
        name: ClassifyBatcher(name, [SGLangClient(url, timeout_s=models.timeout_s, retries=1) for url in urls],
                              max_batch=models.max_batch, max_wait_s=models.max_wait_s,
                              concurrency=models.concurrency)
        for name, urls in models.engines.items()}
    return RewardModelScorer(batchers, models.timeout_s)
