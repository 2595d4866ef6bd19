"""The reward service's settings (flags `--<field>`, env vars `POLICYLOOP_<FIELD>`)."""

from __future__ import annotations

from pydantic import Field

from policyloop.runtime import ServiceSettings
from policyloop.scorers.settings import ModelScorerSettings


class RewardSettings(ServiceSettings, ModelScorerSettings):
    concurrency: int = Field(64, description="Rollouts this replica scores at once.")
    sandbox_timeout_s: float = Field(
        120.0, description="How long a code scorer (unit tests, reward code) may wait for the sandbox's result, "
                           "queueing included; then the Rollout is handed back and tried again later.")
