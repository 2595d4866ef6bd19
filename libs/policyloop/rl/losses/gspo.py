"""GSPO: one ratio per sequence, s = exp(mean over its trained tokens of log r), clipped as PPO's
is. In its token form (the paper's GSPO-token, Tinker's): token t weighs its advantage by
w_t = sg(s)·π_t / sg(π_t) — s in value, the gradient of its own log π —
−min(w_t·A_t, clip(w_t, 1 − clip_low, 1 + clip_high)·A_t); with an advantage constant over the
sequence this is the sequence-level objective. normalization=sequence (the default) is the
paper's mean over sequences, and sum is Tinker's sum over tokens."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from policyloop.rl.losses.base import LossInputs, LossTerms, Normalization, PolicyLoss, clip_range


class GspoLoss(PolicyLoss):
    sequence_level = True

    kind: Literal["gspo"] = "gspo"
    normalization: Normalization = Field(
        "sequence", description="Loss normalisation: sequence (the paper's), token, constant or sum.")
    clip_low: float = clip_range("Clip range below 1 of the sequence ratio.", 3e-4)
    clip_high: float = clip_range("Clip range above 1 of the sequence ratio.", 4e-4)

    def terms(self, inputs: LossInputs) -> LossTerms:
        mask, logprobs = inputs.mask, inputs.logprobs
        lengths = mask.sum(dim=1)
        has = lengths > 0
        sequence_ratio = ((inputs.log_ratio * mask).sum(dim=1) / lengths.clamp(min=1.0)).exp()
        weight = sequence_ratio.detach()[:, None] * (logprobs - logprobs.detach()).exp()
        unclipped = weight * inputs.advantages
        clipped = weight.clamp(1.0 - self.clip_low, 1.0 + self.clip_high) * inputs.advantages
        clipped_sequences = ((unclipped > clipped) & (mask > 0)).any(dim=1) & has
        clip_fraction = float(clipped_sequences.sum() / has.sum().clamp(min=1))
        return LossTerms(-unclipped.minimum(clipped), {"clip_fraction": clip_fraction})
