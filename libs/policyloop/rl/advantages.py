"""Group-relative advantages (GRPO): each sample's reward against the others of its group."""

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
