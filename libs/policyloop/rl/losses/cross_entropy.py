"""Cross-entropy: −w·log π per token, `advantages` being the weights (1 on a demonstration's
trained tokens). The loss of supervised steps, and of Tinker's cross_entropy."""

from __future__ import annotations

from typing import Literal

from policyloop.rl.losses.base import LossInputs, LossTerms, PolicyLoss


class CrossEntropyLoss(PolicyLoss):
    uses_behaviour = False

    kind: Literal["cross_entropy"] = "cross_entropy"

    def terms(self, inputs: LossInputs) -> LossTerms:
        return LossTerms(-inputs.advantages * inputs.logprobs, {})
