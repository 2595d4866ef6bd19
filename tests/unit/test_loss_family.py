"""The policy-loss family against hand-computed values and invariants."""

from __future__ import annotations

import math

import pytest
import torch

from policyloop.rl.advantages import leave_one_out_advantages
from policyloop.rl.losses import (
    aggregate,
    cispo_per_token,
    gspo_loss,
    kl_penalty,
    truncated_is_weight,
)

PER_TOKEN = torch.tensor([[1.0, 2.0, 3.0, 0.0], [4.0, 0.0, 0.0, 0.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]])


def test_normalisations() -> None:
    assert float(aggregate(PER_TOKEN, MASK, "token")) == pytest.approx(10 / 4)
    assert float(aggregate(PER_TOKEN, MASK, "sequence")) == pytest.approx((6 / 3 + 4 / 1) / 2)
    assert float(aggregate(PER_TOKEN, MASK, "constant", constant=8)) == pytest.approx(10 / (2 * 8))
    # Masked positions never count, whatever they hold.
    noisy = PER_TOKEN + (1 - MASK) * 100
    for kind in ("token", "sequence", "constant"):
        assert float(aggregate(noisy, MASK, kind)) == pytest.approx(float(aggregate(PER_TOKEN, MASK, kind)))
    with pytest.raises(ValueError):
        aggregate(PER_TOKEN, MASK, "bogus")


def test_kl_estimators() -> None:
    logp, ref = torch.tensor([-1.0]), torch.tensor([-1.5])
    d = float(ref - logp)  # log(p_ref / p) = -0.5
    assert float(kl_penalty(logp, ref, "k1")) == pytest.approx(-d)
    assert float(kl_penalty(logp, ref, "k2")) == pytest.approx(0.5 * d * d)
    assert float(kl_penalty(logp, ref, "k3")) == pytest.approx(math.exp(d) - 1 - d)
    same = kl_penalty(logp, logp, "k3")
    assert float(same) == 0.0 and float(kl_penalty(logp, ref, "k3")) > 0


def test_truncated_is_weight_caps_and_has_no_gradient() -> None:
    prox = torch.tensor([-1.0, -1.0], requires_grad=True)
    weights = truncated_is_weight(prox, torch.tensor([-3.0, -0.5]), cap=2.0)
    assert weights.tolist() == pytest.approx([2.0, math.exp(-0.5)])
    assert not weights.requires_grad


def test_gspo_ratio_one_is_the_sequence_policy_gradient_and_clips_per_sequence() -> None:
    logp = torch.tensor([[-1.0, -2.0], [-0.5, 0.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    adv = torch.tensor([1.0, -2.0])
    loss = gspo_loss(logp, logp.detach(), adv, mask)
    assert float(loss.detach()) == pytest.approx(-(1.0 - 2.0) / 2)
    loss.backward()
    # d/dlogp of -s·A/2 at s=1: -A/(2·len) on each trained token, 0 on the masked one.
    assert torch.allclose(logp.grad, torch.tensor([[-0.25, -0.25], [1.0, 0.0]]))
    far = gspo_loss(logp.detach() + 0.1, logp.detach(), torch.tensor([1.0, 1.0]), mask)
    assert float(far) == pytest.approx(-(1 + 4e-4))  # ratio e^0.1 clipped at 1 + 4e-4


def test_cispo_keeps_gradients_through_clipped_tokens() -> None:
    old = torch.zeros(1, 2)
    logp = torch.tensor([[0.5, -0.1]], requires_grad=True)  # ratios e^0.5 (clipped) and e^-0.1
    adv = torch.ones(1, 2)
    per_token = cispo_per_token(logp, old, adv, clip_high=0.28)
    aggregate(per_token, torch.ones(1, 2), "token").backward()
    # The gradient is -sg(w)·A/N on every token, the clipped one included (unlike PPO-clip).
    assert torch.allclose(logp.grad, torch.tensor([[-1.28 / 2, -math.exp(-0.1) / 2]]))


def test_leave_one_out() -> None:
    adv = leave_one_out_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0]]))
    assert torch.allclose(adv, torch.tensor([[1 - 1 / 3, -2 / 3, -2 / 3, 1 - 1 / 3]]))
    with pytest.raises(ValueError):
        leave_one_out_advantages(torch.tensor([[1.0]]))
