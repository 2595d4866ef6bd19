"""PPO-clip: −min(r·A, clip(r, 1 − clip_low, 1 + clip_high)·A) per token. With the shared
settings it is GRPO (sequence, group), DAPO (token, clip_high > clip_low) or Dr.GRPO
(constant, group_no_std)."""

from __future__ import annotations

from typing import Literal

from policyloop.rl.losses.base import LossInputs, LossTerms, PolicyLoss, clip_range


class PpoLoss(PolicyLoss):
    kind: Literal["ppo"] = "ppo"
    clip_low: float = clip_range("Clip range below 1 of the importance ratio.", 0.2)
    clip_high: float = clip_range("Clip range above 1 (clip-higher when larger than clip_low).", 0.2)

    def terms(self, inputs: LossInputs) -> LossTerms:
        ratio, advantages = inputs.ratio, inputs.advantages
        unclipped = ratio * advantages
        clipped = ratio.clamp(1.0 - self.clip_low, 1.0 + self.clip_high) * advantages
        return LossTerms(-unclipped.minimum(clipped), {"clip_fraction": inputs.share(unclipped > clipped)})
