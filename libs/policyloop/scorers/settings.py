"""How the scorers that call a model reach it, wherever samples are scored (the reward service,
the evaluator): fields of those services' settings (`--reward-models`, POLICYLOOP_REWARD_MODELS…)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class RewardModelSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    engines: dict[str, list[str]] = Field(
        default_factory=dict,
        description="The reward models scored with, by the name an environment's reward_model scorer gives: each the "
                    "base URLs of engines serving it on SGLang's /classify (SGLang with --is-embedding, or the "
                    "embedded engine), as JSON: {\"arith-rm\": [\"http://rm-0:30000\"]}. Calls go to them in turn.")
    max_batch: int = Field(32, ge=1, description="Most samples in one /classify call (samples of any groups).")
    max_wait_s: float = Field(
        0.01, ge=0, description="How long the first sample of a batch waits for more before the call is made anyway.")
    concurrency: int = Field(2, ge=1, description="/classify calls in flight per reward model, across its engines; "
                                                  "samples queue meanwhile and go in the next batches.")
    timeout_s: float = Field(
        60.0, gt=0, description="The most one sample waits for its score, queueing included (a scorer's own "
                                "timeout_seconds overrides it); then the scoring fails and its group is retried.")


class ModelScorerSettings(BaseModel):
    reward_models: RewardModelSettings = Field(default_factory=RewardModelSettings,
                                               description="Reward models' engines (the reward_model scorer).")
