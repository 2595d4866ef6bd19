"""The learner's objective, chosen by configuration from the policy-loss family.

Every variant is a pure function of per-token tensors ([batch, tokens], `mask` 1 on trained
response tokens): current logprobs (with gradient), behaviour logprobs (what the engine sampled
with, version ≤ the learner's), advantages, and optionally reference logprobs.

Off-policy handling. The learner takes one optimizer step per batch, so the proximal policy —
the learner's weights at the start of the step — is the current forward pass without gradient.
- `none`: the PPO ratio is π_θ / π_behaviour (behaviour = old policy, as in on-policy PPO).
- `tis`: truncated importance sampling: the ratio is π_θ / π_prox and each token's loss is
  weighted by min(π_prox / π_behaviour, tis_cap) (no gradient through the weight).
- `decoupled`: the decoupled objective (proximal policy): the trust region is anchored at π_prox
  (ratio π_θ / π_prox, clipped), and the off-policy gap is corrected by the untruncated weight
  π_prox / π_behaviour; `tis_cap` > 0 still bounds it for safety when set.

Normalisation (`aggregate`) is computed with the counts of the whole batch, so a batch split
over ranks gives the same loss (summed over ranks) as on one rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from policyloop.rl.advantages import group_advantages, leave_one_out_advantages
from policyloop.rl.settings import (
    ADVANTAGE_KINDS,
    LOSS_KINDS,
    NORMALIZATIONS,
    AdvantageKind,
    KLEstimator,
    LossConfig,
    Normalization,
)


@dataclass(frozen=True)
class BatchCounts:
    """The whole batch's counts (all ranks), for normalisation."""

    tokens: float
    sequences: int
    width: int                            # padded response width (the "constant" default)


@dataclass(frozen=True)
class ObjectiveStats:
    loss: float
    policy_loss: float
    clip_fraction: float                  # share of trained tokens (sequences for GSPO) clipped
    ratio_mean: float
    kl_behaviour: float                   # k3 estimate of KL(behaviour || current) per token
    kl_reference: float                   # mean per-token KL to the reference (0 when off)
    is_weight_mean: float                 # π_prox / π_behaviour over tokens (1 when off_policy=none)
    is_weight_max: float
    is_truncated_fraction: float          # share of tokens whose weight hit the cap
    entropy: float                        # mean per-token entropy of the current policy
    tokens: int


def compute_advantages(rewards: torch.Tensor, kind: AdvantageKind) -> torch.Tensor:
    """[groups, group_size] rewards → advantages of the same shape."""
    if kind == "group":
        return group_advantages(rewards, scale_by_std=True)
    if kind == "group_no_std":
        return group_advantages(rewards, scale_by_std=False)
    if kind == "leave_one_out":
        return leave_one_out_advantages(rewards)
    if kind == "none":
        return rewards.clone()
    raise ValueError(f"advantages must be one of {', '.join(ADVANTAGE_KINDS)}, not {kind!r}")


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: KLEstimator) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from samples of the policy (Schulman's
    k1, k2, k3): k1 = −log r, k2 = ½ (log r)², k3 = r − 1 − log r with r = p_ref / p."""
    log_ratio = ref_logprobs - logprobs
    if estimator == "k1":
        return -log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio**2
    if estimator == "k3":
        return torch.exp(log_ratio) - 1 - log_ratio
    raise ValueError(f"estimator must be k1, k2 or k3, not {estimator!r}")


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, normalization: Normalization, counts: BatchCounts,
              constant: float = 0.0) -> torch.Tensor:
    """Sum of this shard's contribution to the batch loss.

    token: Σ over tokens / all trained tokens; sequence: Σ over sequences of the sequence mean /
    all sequences; constant: Σ over tokens / (all sequences × constant or the padded width)."""
    mask = mask.to(per_token.dtype)
    masked = per_token * mask
    if normalization == "token":
        return masked.sum() / max(counts.tokens, 1.0)
    if normalization == "sequence":
        lengths = mask.sum(dim=1)
        per_sequence = masked.sum(dim=1) / lengths.clamp(min=1.0)
        return per_sequence.sum() / max(counts.sequences, 1)
    if normalization == "constant":
        budget = constant if constant > 0 else float(counts.width)
        return masked.sum() / (max(counts.sequences, 1) * budget)
    raise ValueError(f"normalization must be one of {', '.join(NORMALIZATIONS)}, not {normalization!r}")


def policy_objective(logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, advantages: torch.Tensor,
                     mask: torch.Tensor, config: LossConfig, counts: BatchCounts, *,
                     ref_logprobs: torch.Tensor | None = None, entropy: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, ObjectiveStats]:
    """The configured loss and its statistics. `advantages` is per token (a sequence's
    advantage broadcast over its tokens); `entropy`, per token, is only reported."""
    if not (logprobs.shape == behaviour_logprobs.shape == advantages.shape == mask.shape):
        raise ValueError("logprobs, behaviour_logprobs, advantages and mask must have one shape")
    maskf = mask.to(logprobs.dtype)
    trained = maskf > 0
    proximal = logprobs.detach()
    if config.off_policy == "none":
        old = behaviour_logprobs
        weight = torch.ones_like(logprobs)
        truncated = torch.zeros_like(logprobs, dtype=torch.bool)
    else:
        old = proximal
        raw_weight = torch.exp((proximal - behaviour_logprobs) * maskf)
        cap = config.tis_cap if (config.off_policy == "tis" or config.tis_cap > 0) else float("inf")
        weight = torch.clamp(raw_weight, max=cap)
        truncated = (raw_weight > cap) & trained
    log_ratio = (logprobs - old) * maskf
    ratio = torch.exp(log_ratio)
    # Statistics describe this shard (a rank's share of the batch), per trained token.
    local_tokens = maskf.sum().clamp(min=1.0)

    if config.kind == "ppo":
        unclipped = ratio * advantages
        clipped = torch.clamp(ratio, 1.0 - config.clip_low, 1.0 + config.clip_high) * advantages
        per_token = -torch.minimum(unclipped, clipped) * weight
        policy_loss = aggregate(per_token, maskf, config.normalization, counts, config.constant)
        clipped_share = ((unclipped > clipped) & trained).sum() / local_tokens
    elif config.kind == "cispo":
        is_weight = torch.clamp(ratio, max=1.0 + config.clip_high).detach()
        per_token = -is_weight * weight * advantages * logprobs
        policy_loss = aggregate(per_token, maskf, config.normalization, counts, config.constant)
        clipped_share = ((ratio > 1.0 + config.clip_high) & trained).sum() / local_tokens
    elif config.kind == "gspo":
        # One ratio per sequence: the geometric mean of its token ratios; the sequence's
        # advantage is its tokens' (constant over the sequence); an off-policy weight enters as
        # its mean over the sequence.
        lengths = maskf.sum(dim=1)
        has = lengths > 0
        seq_ratio = torch.exp(log_ratio.sum(dim=1) / lengths.clamp(min=1.0))
        seq_adv = (advantages * maskf).sum(dim=1) / lengths.clamp(min=1.0)
        seq_weight = (weight * maskf).sum(dim=1) / lengths.clamp(min=1.0)
        unclipped = seq_ratio * seq_adv
        clipped = torch.clamp(seq_ratio, 1 - config.gspo_clip_low, 1 + config.gspo_clip_high) * seq_adv
        per_sequence = -torch.minimum(unclipped, clipped) * seq_weight
        policy_loss = per_sequence[has].sum() / max(counts.sequences, 1)
        clipped_share = ((unclipped > clipped) & has).sum() / has.sum().clamp(min=1)
    else:
        raise ValueError(f"kind must be one of {', '.join(LOSS_KINDS)}, not {config.kind!r}")

    loss = policy_loss
    kl_ref = torch.zeros(())
    if config.kl_coef > 0:
        if ref_logprobs is None:
            raise ValueError("kl_coef > 0 needs ref_logprobs")
        per_token_kl = kl_penalty(logprobs, ref_logprobs, config.kl_estimator)
        kl_term = aggregate(per_token_kl, maskf, config.normalization, counts, config.constant)
        loss = loss + config.kl_coef * kl_term
        kl_ref = (per_token_kl.detach() * maskf).sum() / local_tokens

    with torch.no_grad():
        tokens = local_tokens
        behaviour_log_ratio = (proximal - behaviour_logprobs) * maskf
        stats = ObjectiveStats(
            loss=float(loss), policy_loss=float(policy_loss), clip_fraction=float(clipped_share),
            ratio_mean=float((ratio * maskf).sum() / tokens),
            kl_behaviour=float(((torch.exp(-behaviour_log_ratio) - 1 + behaviour_log_ratio) * maskf).sum() / tokens),
            kl_reference=float(kl_ref),
            is_weight_mean=float((weight * maskf).sum() / tokens),
            is_weight_max=float(weight[trained].max()) if bool(trained.any()) else 1.0,
            is_truncated_fraction=float(truncated.sum() / tokens),
            entropy=float((entropy * maskf).sum() / tokens) if entropy is not None else 0.0,
            tokens=int(maskf.sum()),
        )
    return loss, stats


def supervised_objective(logprobs: torch.Tensor, mask: torch.Tensor, config: LossConfig, counts: BatchCounts, *,
                         entropy: torch.Tensor | None = None) -> tuple[torch.Tensor, ObjectiveStats]:
    """Cross-entropy on demonstrations: the negative log-likelihood of each trained token,
    normalised as the policy loss is (`config.normalization`). There is no ratio, clip or
    off-policy weight to report: those statistics read as their neutral values."""
    if logprobs.shape != mask.shape:
        raise ValueError("logprobs and mask must have one shape")
    maskf = mask.to(logprobs.dtype)
    loss = aggregate(-logprobs, maskf, config.normalization, counts, config.constant)
    with torch.no_grad():
        tokens = maskf.sum().clamp(min=1.0)
        stats = ObjectiveStats(
            loss=float(loss), policy_loss=float(loss), clip_fraction=0.0, ratio_mean=1.0, kl_behaviour=0.0,
            kl_reference=0.0, is_weight_mean=1.0, is_weight_max=1.0, is_truncated_fraction=0.0,
            entropy=float((entropy * maskf).sum() / tokens) if entropy is not None else 0.0,
            tokens=int(maskf.sum()))
    return loss, stats
