"""CISPO: −sg(clip(r, 1 − clip_low, 1 + clip_high))·A·log π per token: every token keeps its
gradient, the clipped ratio only weighs it. The paper sets no lower bound (clip_low 1)."""

from __future__ import annotations

from typing import Literal

from policyloop.rl.losses.base import LossInputs, LossTerms, PolicyLoss, clip_range


class CispoLoss(PolicyLoss):
    kind: Literal["cispo"] = "cispo"
    clip_low: float = clip_range("Clip range below 1 of the IS weight (1: no lower bound).", 1.0)
    clip_high: float = clip_range("Clip range above 1 of the IS weight.", 0.2)

    def terms(self, inputs: LossInputs) -> LossTerms:
        ratio = inputs.ratio
        low, high = max(0.0, 1.0 - self.clip_low), 1.0 + self.clip_high
        weight = ratio.clamp(low, high).detach()
        return LossTerms(-weight * inputs.advantages * inputs.logprobs,
                         {"clip_fraction": inputs.share((ratio > high) | (ratio < low))})
