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


# --- The policy-loss family (issue 5, first slice: pure functions; the learner uses PPO-clip) ---

Normalization = str  # "token" (DAPO), "sequence" (GRPO), "constant" (Dr.GRPO)


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, normalization: Normalization,
              constant: float | None = None) -> torch.Tensor:
    """Reduces a [B, T] per-token loss to a scalar.

    token: every trained token of the batch weighs the same (sum / trained tokens);
    sequence: each sequence's mean, then the mean over sequences (the original GRPO);
    constant: sum / (B × constant), with the generation budget as constant (Dr.GRPO), which
    removes the length bias of both others."""
    mask = mask.to(per_token.dtype)
    if normalization == "token":
        return (per_token * mask).sum() / mask.sum().clamp(min=1.0)
    if normalization == "sequence":
        lengths = mask.sum(dim=1)
        has_tokens = lengths > 0
        per_seq = (per_token * mask).sum(dim=1) / lengths.clamp(min=1.0)
        return per_seq[has_tokens].mean() if bool(has_tokens.any()) else per_token.sum() * 0
    if normalization == "constant":
        budget = float(constant if constant is not None else per_token.shape[1])
        return (per_token * mask).sum() / (per_token.shape[0] * budget)
    raise ValueError(f"normalization must be token, sequence or constant, not {normalization!r}")


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from samples of the policy (Schulman's
    k1, k2, k3): k1 = log r', k2 = ½ (log r')², k3 = r − 1 − log r with r = p_ref / p."""
    log_ratio = ref_logprobs - logprobs
    if estimator == "k1":
        return -log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio**2
    if estimator == "k3":
        return torch.exp(log_ratio) - 1 - log_ratio
    raise ValueError(f"estimator must be k1, k2 or k3, not {estimator!r}")


def truncated_is_weight(proximal_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor,
                        cap: float) -> torch.Tensor:
    """Off-policy correction: min(π_prox / π_behaviour, cap), without gradient."""
    return torch.clamp(torch.exp(proximal_logprobs - behaviour_logprobs), max=cap).detach()


def gspo_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, seq_advantages: torch.Tensor,
              mask: torch.Tensor, *, clip_low: float = 3e-4, clip_high: float = 4e-4) -> torch.Tensor:
    """GSPO: one importance ratio per sequence, the geometric mean of its token ratios
    (exp of the mean log-ratio), clipped, times the sequence's advantage; mean over sequences."""
    mask = mask.to(logprobs.dtype)
    lengths = mask.sum(dim=1).clamp(min=1.0)
    seq_ratio = torch.exp(((logprobs - old_logprobs) * mask).sum(dim=1) / lengths)
    unclipped = seq_ratio * seq_advantages
    clipped = torch.clamp(seq_ratio, 1 - clip_low, 1 + clip_high) * seq_advantages
    valid = mask.sum(dim=1) > 0
    return (-torch.minimum(unclipped, clipped))[valid].mean()


def cispo_per_token(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                    *, clip_high: float = 0.28) -> torch.Tensor:
    """CISPO: the importance weight is clipped and detached, so every token keeps a gradient
    (−sg(min(r, 1 + ε_high)) · A · log π); aggregate it with `aggregate`."""
    weight = torch.clamp(torch.exp(logprobs - old_logprobs), max=1 + clip_high).detach()
    return -weight * advantages * logprobs
