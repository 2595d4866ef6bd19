"""Importance sampling (REINFORCE corrected off-policy): −r·A per token."""

from __future__ import annotations

from typing import Literal

from policyloop.rl.losses.base import LossInputs, LossTerms, PolicyLoss


class ImportanceSamplingLoss(PolicyLoss):
    kind: Literal["importance_sampling"] = "importance_sampling"

    def terms(self, inputs: LossInputs) -> LossTerms:
        return LossTerms(-inputs.ratio * inputs.advantages, {})
