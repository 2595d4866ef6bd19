"""The objective of every kind of step: a loss kind of the registry (rl.losses) over per-token
tensors ([rows, tokens], `mask` 1 on trained tokens) — current logprobs (with gradient),
behaviour logprobs (what the engine sampled with, version ≤ the learner's; none for
demonstrations), advantages (or a supervised loss's weights) and optionally reference logprobs —
with what every kind shares done here once.

Off-policy handling. The learner takes one optimizer step per batch, so the proximal policy —
the learner's weights at the start of the step — is the current forward pass without gradient.
- `none`: the ratio is π_θ / π_behaviour (behaviour = old policy, as in on-policy PPO).
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
from policyloop.rl.losses import ADVANTAGE_KINDS, KL_ESTIMATORS, NORMALIZATIONS, LossInputs, PolicyLoss
from policyloop.rl.losses.base import AdvantageKind, KLEstimator, Normalization

# The statistics of a step: the loss kind's own (rl.losses) and those below, by name. They go
# unchanged to the learner's status, its Prometheus gauge, the trackers and the demo.
LossStatistics = dict[str, float]


@dataclass(frozen=True)
class BatchCounts:
    """The whole batch's counts (all ranks), for normalisation."""

    tokens: float
    sequences: int
    width: int                            # padded response width (the "constant" default)


@dataclass(frozen=True)
class Objective:
    loss: torch.Tensor                    # this shard's share of the batch's loss, with gradient
    per_token: torch.Tensor               # [rows, tokens] weighted, masked terms, before normalisation
    statistics: LossStatistics


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
    if kind == "gae":  # per token, from the values of a critic: only a trainer that holds one computes them
        raise ValueError("gae advantages need a critic (rl.critic): the full-model trainer computes them")
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
    raise ValueError(f"estimator must be one of {', '.join(KL_ESTIMATORS)}, not {estimator!r}")


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, normalization: Normalization, counts: BatchCounts,
              constant: float = 0.0) -> torch.Tensor:
    """Sum of this shard's contribution to the batch loss.

    token: Σ over tokens / all trained tokens; sequence: Σ over sequences of the sequence mean /
    all sequences; constant: Σ over tokens / (all sequences × constant or the padded width);
    sum: Σ over tokens."""
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
    if normalization == "sum":
        return masked.sum()
    raise ValueError(f"normalization must be one of {', '.join(NORMALIZATIONS)}, not {normalization!r}")


def objective(loss: PolicyLoss, logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
              counts: BatchCounts, *, behaviour_logprobs: torch.Tensor | None = None,
              ref_logprobs: torch.Tensor | None = None, entropy: torch.Tensor | None = None) -> Objective:
    """The loss of `loss`'s kind and its statistics. `advantages` is per token (a sequence's
    advantage broadcast over its tokens); `behaviour_logprobs` are needed by kinds that use them
    (none: the ratio is to the proximal policy, 1); `entropy`, per token, is only reported."""
    if not logprobs.shape == advantages.shape == mask.shape:
        raise ValueError("logprobs, advantages and mask must have one shape")
    if loss.uses_behaviour and behaviour_logprobs is None:
        raise ValueError(f"the {loss.kind} loss needs behaviour logprobs")
    if behaviour_logprobs is not None and behaviour_logprobs.shape != logprobs.shape:
        raise ValueError("logprobs and behaviour_logprobs must have one shape")
    maskf = mask.to(logprobs.dtype)
    trained = maskf > 0
    proximal = logprobs.detach()
    statistics: LossStatistics = {}
    weight = torch.ones_like(proximal)
    anchor = proximal if behaviour_logprobs is None else behaviour_logprobs
    if behaviour_logprobs is not None and loss.off_policy != "none":
        anchor = proximal
        raw_weight = torch.exp((proximal - behaviour_logprobs) * maskf)
        cap = loss.tis_cap if (loss.off_policy == "tis" or loss.tis_cap > 0) else float("inf")
        weight = torch.clamp(raw_weight, max=cap)
        statistics |= _weight_statistics(weight, (raw_weight > cap) & trained, maskf)
    inputs = LossInputs(logprobs=logprobs, log_ratio=(logprobs - anchor) * maskf, advantages=advantages, mask=maskf)
    terms = loss.terms(inputs)
    per_token = terms.per_token * weight * maskf
    policy_loss = aggregate(per_token, maskf, loss.normalization, counts, loss.constant)
    total = policy_loss
    tokens = maskf.sum().clamp(min=1.0)  # statistics describe this shard (a rank's share), per trained token
    if loss.kl_coef > 0:
        if ref_logprobs is None:
            raise ValueError("kl_coef > 0 needs ref_logprobs")
        per_token_kl = kl_penalty(logprobs, ref_logprobs, loss.kl_estimator)
        total = total + loss.kl_coef * aggregate(per_token_kl, maskf, loss.normalization, counts, loss.constant)
        statistics["kl_reference"] = float((per_token_kl.detach() * maskf).sum() / tokens)
    with torch.no_grad():
        statistics |= {"loss": float(total), "policy_loss": float(policy_loss), **terms.statistics}
        if behaviour_logprobs is not None:
            statistics["ratio_mean"] = float((inputs.ratio * maskf).sum() / tokens)
            behaviour_log_ratio = (proximal - behaviour_logprobs) * maskf
            statistics["kl_behaviour"] = float(
                ((torch.exp(-behaviour_log_ratio) - 1 + behaviour_log_ratio) * maskf).sum() / tokens)
        if entropy is not None:
            statistics["entropy"] = float((entropy * maskf).sum() / tokens)
    return Objective(total, per_token, statistics)


def _weight_statistics(weight: torch.Tensor, truncated: torch.Tensor, maskf: torch.Tensor) -> LossStatistics:
    trained = maskf > 0
    tokens = maskf.sum().clamp(min=1.0)
    return {"is_weight_mean": float((weight * maskf).sum() / tokens),
            "is_weight_max": float(weight[trained].max()) if bool(trained.any()) else 1.0,
            "is_truncated_fraction": float(truncated.sum() / tokens)}
