"""DRO: −(A·log π − β/2·(log π − log π_anchor)²) per token: the policy gradient with a quadratic
pull towards the policy that sampled (or the proximal one, with an off-policy correction)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from policyloop.rl.losses.base import LossInputs, LossTerms, PolicyLoss


class DroLoss(PolicyLoss):
    kind: Literal["dro"] = "dro"
    beta: float = Field(gt=0, description="DRO's weight of the squared log-ratio to the sampling policy (required).")

    def terms(self, inputs: LossInputs) -> LossTerms:
        return LossTerms(-(inputs.advantages * inputs.logprobs - 0.5 * self.beta * inputs.log_ratio**2), {})
