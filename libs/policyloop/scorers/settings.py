"""How the scorers that call a model reach it, wherever samples are scored (the reward service,
the evaluator): fields of those services' settings (`--reward-models`, POLICYLOOP_REWARD_MODELS…)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, SecretStr


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


class JudgeEndpoint(BaseModel):
    model_config = ConfigDict(extra="forbid")

    base_url: str = Field(description="The OpenAI-compatible API's base URL (e.g. http://serving:8000/v1).")
    model: str = Field("", description="The model to ask when the scorer names none.")
    api_key: SecretStr = Field(SecretStr(""), description="Its API key (prefer api_key_file: a mounted secret).")
    api_key_file: Path | None = Field(None, description="A file holding the API key (read at start).")

    def key(self) -> str:
        """The API key: the file's, else api_key's (the OpenAI client needs one: "none" when neither)."""
        if self.api_key_file is not None:
            return self.api_key_file.read_text().strip()
        return self.api_key.get_secret_value() or "none"


class JudgeSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    endpoints: dict[str, JudgeEndpoint] = Field(
        default_factory=dict,
        description="The judges asked, by the name an environment's judge scorer gives, as JSON: "
                    "{\"cluster\": {\"base_url\": \"http://serving:8000/v1\", \"model\": \"policy\"}}.")
    concurrency: int = Field(8, ge=1, description="Judgements in flight per judge.")
    timeout_s: float = Field(60.0, gt=0, description="The most one judgement may take, retries included (a "
                                                     "scorer's own timeout_seconds overrides it).")
    retries: int = Field(2, ge=0, description="Retries of a request that failed for want of the endpoint "
                                              "(connection, timeout, 5xx, 429), within the timeout.")
    cache_ttl_s: float = Field(7 * 24 * 3600.0, gt=0, description="How long a judge's reply is kept (Redis), so "
                                                                  "that a redelivered sample is not judged again.")


class ModelScorerSettings(BaseModel):
    reward_models: RewardModelSettings = Field(default_factory=RewardModelSettings,
                                               description="Reward models' engines (the reward_model scorer).")
    judges: JudgeSettings = Field(default_factory=JudgeSettings,
                                  description="LLM judges' endpoints (the judge scorer).")


@dataclass(frozen=True)
class ScorerContext:
    """What a scorer that calls a model is built with: the service's settings, and its Redis (the
    judge's reply cache, shared by the replicas; None: kept in the process) and namespace."""

    settings: ModelScorerSettings = field(default_factory=ModelScorerSettings)
    redis: Any = None
    namespace: str = "default"
