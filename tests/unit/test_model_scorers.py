"""What the model scorers refuse before asking any model: a reward model or a judge this replica
does not reach (retried: another replica may), a sample without the text a reward model scores,
and a judge with no model to ask (dead-lettered: no replica can)."""

from __future__ import annotations

import pytest

from policyloop.contracts.v1 import bus_pb2
from policyloop.scorers.classify_batcher import RewardModelUnavailable
from policyloop.scorers.judge import JudgeUnavailable, judge_scorer, judge_spec
from policyloop.scorers.reward_model import normalization_value, normalized, reward_model_scorer
from policyloop.scorers.score import UnscorableTrajectory
from policyloop.scorers.settings import (
    JudgeEndpoint,
    JudgeSettings,
    ModelScorerSettings,
    RewardModelSettings,
    ScorerContext,
)

NOWHERE = "http://127.0.0.1:1"  # never reached: each refusal comes before a request


def sample(scorer: bus_pb2.Scorer, prompt: str = "1+1=") -> bus_pb2.Trajectory:
    return bus_pb2.Trajectory(trajectory_id="t/0", prompt_text=prompt, response_text="2", scorer=scorer)


async def test_the_reward_model_scorer_refuses_what_it_cannot_score() -> None:
    scorer = reward_model_scorer(ScorerContext(ModelScorerSettings(
        reward_models=RewardModelSettings(engines={"rm": [NOWHERE]}))))
    try:
        with pytest.raises(RewardModelUnavailable, match=r"'other' is not a reward model this replica reaches "
                                                         r"\(reward_models.engines: rm\)"):
            await scorer.score(sample(bus_pb2.Scorer(reward_model=bus_pb2.RewardModelScorer(model="other"))))
        with pytest.raises(UnscorableTrajectory, match="no prompt text"):
            await scorer.score(sample(bus_pb2.Scorer(reward_model=bus_pb2.RewardModelScorer(model="rm")), prompt=""))
    finally:
        await scorer.close()
    spec = bus_pb2.RewardModelScorer(model="rm", normalization=normalization_value("sigmoid"), scale=2, shift=-1)
    assert normalized(spec, 0.0) == 0.0 and normalized(bus_pb2.RewardModelScorer(model="rm"), 3.5) == 3.5


async def test_the_judge_scorer_refuses_what_it_cannot_judge() -> None:
    scorer = judge_scorer(ScorerContext(ModelScorerSettings(judges=JudgeSettings(
        endpoints={"cluster": JudgeEndpoint(base_url=NOWHERE)}))))
    try:
        with pytest.raises(JudgeUnavailable, match=r"'other' is not a judge this replica reaches "
                                                   r"\(judges.endpoints: cluster\)"):
            await scorer.score(sample(bus_pb2.Scorer(judge=judge_spec("other", "{response}"))))
        with pytest.raises(UnscorableTrajectory, match="judge 'cluster' has no default model: name one"):
            await scorer.score(sample(bus_pb2.Scorer(judge=judge_spec("cluster", "{response}"))))
    finally:
        await scorer.close()
