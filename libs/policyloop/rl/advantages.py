"""Advantages: group-relative (GRPO), each sample's reward against the others of its group; or per
token from a critic's values (GAE, PPO with a value model: rl.critic)."""

from __future__ import annotations

import torch


def group_advantages(rewards: torch.Tensor, *, scale_by_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """`rewards` is [groups, group_size]; returns advantages of the same shape.

    A group whose samples all got the same reward carries no signal: its advantages are 0
    (and with std scaling the eps keeps them 0 rather than 0/0)."""
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [groups, group_size], got {tuple(rewards.shape)}")
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    if not scale_by_std:
        return centred
    # Population std (unbiased=False) keeps a group of two from exploding.
    return centred / (rewards.std(dim=1, keepdim=True, unbiased=False) + eps)


def leave_one_out_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """RLOO: each sample's reward minus the mean of the *other* samples of its group."""
    if rewards.dim() != 2 or rewards.shape[1] < 2:
        raise ValueError("leave-one-out needs [groups, group_size] with group_size >= 2")
    n = rewards.shape[1]
    others_mean = (rewards.sum(dim=1, keepdim=True) - rewards) / (n - 1)
    return rewards - others_mean


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, *, gamma: float, lam: float
        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over each row's trained tokens ([rows, tokens], `mask` 1
    on them): δ_t = r_t + γ V_next − V_t and A_t = δ_t + γλ A_next, where "next" is the row's next
    trained token (a tool's output between two model turns is skipped: the model acts again only
    after it) and nothing follows the last. Returns (advantages, returns = A + V), 0 off the mask."""
    if not rewards.shape == values.shape == mask.shape or rewards.dim() != 2:
        raise ValueError("rewards, values and mask must be one [rows, tokens] shape")
    trained = mask > 0
    advantages = torch.zeros_like(values)
    next_value = values.new_zeros(values.shape[0])
    next_advantage = values.new_zeros(values.shape[0])
    for t in range(values.shape[1] - 1, -1, -1):
        here = trained[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        advantage = delta + gamma * lam * next_advantage
        advantages[:, t] = torch.where(here, advantage, 0.0)
        next_value = torch.where(here, values[:, t], next_value)
        next_advantage = torch.where(here, advantage, next_advantage)
    returns = torch.where(trained, advantages + values, 0.0)
    return advantages, returns


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, *, total: tuple[float, float, float] | None = None,
                  eps: float = 1e-8) -> torch.Tensor:
    """`values` shifted and scaled to mean 0 and std 1 over the masked entries (0 elsewhere).
    `total`: (count, sum, sum of squares) over the whole batch when this is a rank's share of it,
    so that every rank whitens alike."""
    maskf = mask.to(values.dtype)
    count, first, second = total if total is not None else (
        float(maskf.sum()), float((values * maskf).sum()), float((values.square() * maskf).sum()))
    count = max(count, 1.0)
    mean = first / count
    variance = max(second / count - mean * mean, 0.0)
    # eps inside the root bounds the scale (1e4 at eps 1e-8): a batch of near-equal advantages
    # is not blown up from rounding noise.
    return (values - mean) / (variance + eps) ** 0.5 * maskf
