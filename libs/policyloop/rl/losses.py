"""Policy losses as pure functions of per-token tensors. All inputs are [batch, tokens] with a
mask that is 1 on trained response tokens and 0 elsewhere (prompt, padding, tool output)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LossStats:
    loss: float
    clip_fraction: float      # share of trained tokens whose ratio was clipped
    ratio_mean: float
    approx_kl: float          # mean of (ratio - 1) - log ratio, k3 estimator vs. the old policy
    tokens: int


def clipped_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    token_count: float | None = None,
) -> tuple[torch.Tensor, LossStats]:
    """PPO-clip objective with token-level normalisation (DAPO/Dr.GRPO style): the sum over
    every trained token of the batch divided by their count, so long and short responses weigh
    by their tokens. `advantages` is per token (a sequence's advantage broadcast over it).
    `token_count` overrides the count when this batch is one rank's shard of a larger one."""
    if not (logprobs.shape == old_logprobs.shape == advantages.shape == mask.shape):
        raise ValueError("logprobs, old_logprobs, advantages and mask must have one shape")
    mask = mask.to(logprobs.dtype)
    log_ratio = (logprobs - old_logprobs) * mask
    ratio = torch.exp(log_ratio)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * advantages
    per_token = -torch.minimum(unclipped, clipped)
    tokens = mask.sum().clamp(min=1.0) if token_count is None else torch.tensor(max(token_count, 1.0))
    loss = (per_token * mask).sum() / tokens
    with torch.no_grad():
        was_clipped = ((unclipped > clipped) & (mask > 0)).to(logprobs.dtype)
        stats = LossStats(
            loss=float(loss),
            clip_fraction=float(was_clipped.sum() / tokens),
            ratio_mean=float((ratio * mask).sum() / tokens),
            approx_kl=float((((ratio - 1) - log_ratio) * mask).sum() / tokens),
            tokens=int(mask.sum()),
        )
    return loss, stats
