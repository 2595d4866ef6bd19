"""The objective over the loss registry's kinds: each loss against hand-computed values and invariants — ratio 1
gives the plain policy gradient, clipping boundaries, masked tokens contribute nothing, the
right count normalises, a batch split over ranks sums to the whole."""

from __future__ import annotations

import math
from functools import partial

import pytest
import torch

from policyloop.rl.losses import PolicyLoss, loss_settings
from policyloop.rl.objective import BatchCounts, aggregate, compute_advantages, kl_penalty, objective

close = partial(math.isclose, rel_tol=1e-5, abs_tol=1e-7)
MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
ADV = torch.tensor([[1.0] * 4, [-2.0] * 4])
COUNTS = BatchCounts(tokens=5.0, sequences=2, width=4)


def grad_of(config: PolicyLoss, logprobs: torch.Tensor, behaviour: torch.Tensor, counts: BatchCounts = COUNTS,
            mask: torch.Tensor = MASK, adv: torch.Tensor = ADV, **kw):  # type: ignore[no-untyped-def]
    lp = logprobs.clone().requires_grad_(True)
    result = objective(config, lp, adv, mask, counts, behaviour_logprobs=behaviour, **kw)
    result.loss.backward()
    return result.loss, result.statistics, lp.grad


@pytest.mark.parametrize("kind", ["ppo", "cispo"])
def test_on_policy_ratio_one_is_the_plain_policy_gradient(kind: str) -> None:
    logprobs = torch.full((2, 4), -1.0)
    loss, stats, grad = grad_of(loss_settings(kind=kind), logprobs, logprobs.clone())
    expected = -ADV * MASK / 5.0  # d/dlogπ of −A·π/π_old at π = π_old, token-normalised
    assert torch.allclose(grad, expected)
    assert stats["clip_fraction"] == 0 and close(stats["ratio_mean"], 1.0)
    assert "is_weight_mean" not in stats and "kl_reference" not in stats  # no correction, no penalty
    if kind == "ppo":
        assert close(float(loss.detach()), -(3 * 1.0 + 2 * -2.0) / 5.0)


def test_ppo_clips_at_the_asymmetric_bounds() -> None:
    behaviour = torch.zeros(2, 4)
    # Sequence 0 (A > 0): ratios e^0.1 (inside 1+0.28) and e^0.5 (beyond: clipped, no gradient).
    logprobs = torch.tensor([[0.1, 0.5, 0.0, 0.0], [-0.5, -0.1, 0.0, 0.0]])
    config = loss_settings(clip_low=0.2, clip_high=0.28)
    _, stats, grad = grad_of(config, logprobs, behaviour)
    assert grad[0, 1] == 0 and grad[0, 0] != 0
    # Sequence 1 (A < 0): ratio e^-0.5 < 1 − 0.2 is clipped (no gradient), e^-0.1 is not.
    assert grad[1, 0] == 0 and grad[1, 1] != 0
    assert close(stats["clip_fraction"], 2 / 5)


def test_masked_tokens_contribute_nothing() -> None:
    behaviour = torch.full((2, 4), -1.0)
    logprobs = torch.tensor([[-0.9, -1.2, -1.0, -1.0], [-1.1, -0.8, -1.0, -1.0]])
    for config in (loss_settings(), loss_settings(kind="gspo"), loss_settings(kind="cispo"),
                   loss_settings(off_policy="tis"), loss_settings(normalization="sequence")):
        loss_a, _, grad = grad_of(config, logprobs, behaviour)
        garbage = logprobs.clone()
        garbage[MASK == 0] = 7.0
        odd_behaviour = behaviour.clone()
        odd_behaviour[MASK == 0] = -50.0
        loss_b, _, _ = grad_of(config, garbage, odd_behaviour)
        assert torch.allclose(loss_a, loss_b), config
        assert bool((grad[MASK == 0] == 0).all()), config


def test_normalisations_by_the_right_count() -> None:
    per_token = torch.tensor([[1.0, 2.0, 3.0, 9.0], [4.0, 6.0, 9.0, 9.0]])
    assert close(float(aggregate(per_token, MASK, "token", COUNTS)), (1 + 2 + 3 + 4 + 6) / 5)
    assert close(float(aggregate(per_token, MASK, "sequence", COUNTS)), ((6 / 3) + (10 / 2)) / 2)
    assert close(float(aggregate(per_token, MASK, "constant", COUNTS)), 16 / (2 * 4))
    assert close(float(aggregate(per_token, MASK, "constant", COUNTS, constant=8)), 16 / (2 * 8))


@pytest.mark.parametrize("config", [
    loss_settings(), loss_settings(normalization="sequence"), loss_settings(normalization="constant"),
    loss_settings(kind="gspo"), loss_settings(kind="cispo", off_policy="tis"), loss_settings(off_policy="decoupled")])
def test_a_batch_split_over_ranks_sums_to_the_whole(config: PolicyLoss) -> None:
    torch.manual_seed(0)
    behaviour = -torch.rand(2, 4)
    logprobs = behaviour + 0.1 * torch.randn(2, 4)
    whole, _, _ = grad_of(config, logprobs, behaviour)
    parts = [grad_of(config, logprobs[i:i + 1], behaviour[i:i + 1], mask=MASK[i:i + 1], adv=ADV[i:i + 1])[0]
             for i in range(2)]
    assert torch.allclose(whole, parts[0] + parts[1], atol=1e-6)


def test_truncated_importance_sampling_weights_each_token() -> None:
    logprobs = torch.tensor([[-1.0, -1.0, -1.0, 0.0], [-1.0, -1.0, 0.0, 0.0]])
    behaviour = torch.tensor([[-1.0, -2.0, -1.5, 0.0], [-0.5, -1.0, 0.0, 0.0]])  # weights 1, e, e^0.5 | e^-0.5, 1
    _, stats, grad = grad_of(loss_settings(off_policy="tis", tis_cap=2.0), logprobs, behaviour)
    weights = torch.tensor([[1.0, 2.0, math.exp(0.5), 0.0], [math.exp(-0.5), 1.0, 0.0, 0.0]])
    # The ratio is to the proximal policy (1 at the forward pass): the plain gradient, weighted.
    assert torch.allclose(grad, -ADV * MASK * weights / 5.0)
    assert close(stats["is_truncated_fraction"], 1 / 5) and close(stats["is_weight_max"], 2.0)
    assert close(stats["is_weight_mean"], float(weights.sum()) / 5)


def test_decoupled_objective_corrects_without_truncation_by_default() -> None:
    logprobs = torch.tensor([[-1.0, -1.0, -1.0, 0.0], [-1.0, -1.0, 0.0, 0.0]])
    behaviour = logprobs - torch.tensor([[0.0, 1.0, 0.5, 0.0], [-0.5, 0.0, 0.0, 0.0]])
    _, stats, grad = grad_of(loss_settings(off_policy="decoupled", tis_cap=0.0), logprobs, behaviour)
    weights = torch.exp(torch.tensor([[0.0, 1.0, 0.5, 0.0], [-0.5, 0.0, 0.0, 0.0]])) * MASK
    assert torch.allclose(grad, -ADV * weights / 5.0)
    assert stats["is_truncated_fraction"] == 0 and close(stats["is_weight_max"], math.e)
    # Against off_policy=none the same batch clips at the behaviour ratio instead (no gradient there).
    _, none_stats, none_grad = grad_of(loss_settings(), logprobs, behaviour)
    assert none_grad[0, 1] == 0 and none_stats["clip_fraction"] > 0


def test_cispo_keeps_a_gradient_on_every_token_with_a_clipped_weight() -> None:
    behaviour = torch.zeros(2, 4)
    logprobs = torch.tensor([[0.5, 0.0, 0.0, 0.0], [0.0, -0.3, 0.0, 0.0]])
    _, stats, grad = grad_of(loss_settings(kind="cispo", clip_high=0.28), logprobs, behaviour)
    ratio = torch.exp(logprobs - behaviour)
    weight = torch.clamp(ratio, max=1.28)
    assert torch.allclose(grad, -weight * ADV * MASK / 5.0)
    assert grad[0, 0] != 0 and close(stats["clip_fraction"], 1 / 5)


def test_gspo_uses_one_ratio_per_sequence() -> None:
    behaviour = torch.zeros(2, 4)
    logprobs = torch.tensor([[3e-4, 3e-4, 3e-4, 9.0], [-1e-4, -1e-4, 0.0, 0.0]])
    loss, stats, grad = grad_of(loss_settings(kind="gspo"), logprobs, behaviour)
    r0, r1 = math.exp(3e-4), math.exp(-1e-4)
    expected = (-(r0 * 1.0) + -(r1 * -2.0)) / 2  # both inside [1 − 3e-4, 1 + 4e-4]
    assert close(float(loss.detach()), expected) and stats["clip_fraction"] == 0
    # The gradient of the sequence-level objective −s·A / sequences, s = exp(mean log r): each
    # trained token gets −A·s / (its sequence's length × sequences) — what the token form gives.
    assert torch.allclose(grad, torch.tensor([[-r0 / 6, -r0 / 6, -r0 / 6, 0.0], [r1 / 2, r1 / 2, 0.0, 0.0]]))
    logprobs[0, :3] = 1e-3  # sequence 0's ratio e^1e-3 beyond 1 + 4e-4 with A > 0: clipped
    _, stats, grad = grad_of(loss_settings(kind="gspo"), logprobs, behaviour)
    assert stats["clip_fraction"] == 0.5 and bool((grad[0] == 0).all())


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_penalty_to_the_reference(estimator: str) -> None:
    logprobs = torch.tensor([[-1.0, -1.0, -1.0, 0.0], [-1.0, -1.0, 0.0, 0.0]])
    config = loss_settings(kl_coef=0.5, kl_estimator=estimator)
    same, stats, _ = grad_of(config, logprobs, logprobs.clone(), ref_logprobs=logprobs.clone())
    plain, _, _ = grad_of(loss_settings(), logprobs, logprobs.clone())
    assert torch.allclose(same, plain) and stats["kl_reference"] == 0
    ref = logprobs - 0.2
    with_kl, stats, _ = grad_of(config, logprobs, logprobs.clone(), ref_logprobs=ref)
    per_token = {"k1": 0.2, "k2": 0.5 * 0.04, "k3": math.exp(-0.2) - 1 + 0.2}[estimator]
    assert close(float((with_kl - plain).detach()), 0.5 * per_token)
    assert close(stats["kl_reference"], per_token)
    with pytest.raises(ValueError, match="ref_logprobs"):
        grad_of(config, logprobs, logprobs.clone())


def test_advantage_options() -> None:
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0]])
    expected = torch.tensor([[0.5, -0.5, -0.5, 0.5], [0.0] * 4])
    assert torch.allclose(compute_advantages(rewards, "group_no_std"), expected)
    assert torch.allclose(compute_advantages(rewards, "group")[0], torch.tensor([1.0, -1.0, -1.0, 1.0]), atol=1e-5)
    assert torch.allclose(compute_advantages(rewards, "leave_one_out")[0], torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3]))
    assert torch.equal(compute_advantages(rewards, "none"), rewards)


def test_configuration_is_checked() -> None:
    with pytest.raises(ValueError, match="kind must be one of ppo, cispo, cross_entropy, dro, gspo"):
        loss_settings(kind="dpo")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="normalization"):
        loss_settings(normalization="batch")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="tis_cap"):
        loss_settings(off_policy="tis", tis_cap=0)


def test_kl_estimators_against_their_formulas() -> None:
    logp, ref = torch.tensor([-1.0]), torch.tensor([-1.5])
    d = float(ref - logp)  # log(p_ref / p) = -0.5
    assert close(float(kl_penalty(logp, ref, "k1")), -d)
    assert close(float(kl_penalty(logp, ref, "k2")), 0.5 * d * d)
    assert close(float(kl_penalty(logp, ref, "k3")), math.exp(d) - 1 - d)
    assert float(kl_penalty(logp, logp, "k3")) == 0.0
    with pytest.raises(ValueError, match="k1, k2, k3"):
        kl_penalty(logp, ref, "k4")  # type: ignore[arg-type]


def test_the_loss_kinds_beside_the_clipped_ones_against_their_formulas() -> None:
    behaviour = torch.zeros(2, 4)
    logprobs = torch.tensor([[0.5, 0.0, -0.2, 0.0], [0.0, -0.3, 0.0, 0.0]])
    ratio = torch.exp(logprobs - behaviour)
    loss, stats, grad = grad_of(loss_settings(kind="importance_sampling"), logprobs, behaviour)
    assert close(float(loss.detach()), float((-ratio * ADV * MASK).sum()) / 5)
    assert torch.allclose(grad, -ratio * ADV * MASK / 5) and "clip_fraction" not in stats
    loss, _, grad = grad_of(loss_settings(kind="dro", beta=0.5), logprobs, behaviour)
    assert close(float(loss.detach()), float((-(ADV * logprobs - 0.25 * logprobs**2) * MASK).sum()) / 5)
    assert torch.allclose(grad, (-ADV + 0.5 * logprobs) * MASK / 5)
    loss, _, grad = grad_of(loss_settings(kind="cross_entropy"), logprobs, behaviour)
    assert torch.allclose(grad, -ADV * MASK / 5)
    # cross_entropy learns from demonstrations: no behaviour logprobs needed, no ratio reported.
    lp = logprobs.clone().requires_grad_(True)
    result = objective(loss_settings(kind="cross_entropy"), lp, MASK, MASK, COUNTS)
    assert close(float(result.loss.detach()), -float((logprobs * MASK).sum()) / 5)
    assert "ratio_mean" not in result.statistics
    with pytest.raises(ValueError, match="the ppo loss needs behaviour logprobs"):
        objective(loss_settings(), lp, MASK, MASK, COUNTS)


def test_cispo_bounds_its_weight_from_below_only_when_asked() -> None:
    behaviour = torch.zeros(2, 4)
    logprobs = torch.tensor([[-0.5, 0.0, 0.0, 0.0], [0.0, -0.3, 0.0, 0.0]])
    ratio = torch.exp(logprobs)
    _, stats, grad = grad_of(loss_settings(kind="cispo"), logprobs, behaviour)
    assert torch.allclose(grad, -ratio * ADV * MASK / 5) and stats["clip_fraction"] == 0
    _, stats, grad = grad_of(loss_settings(kind="cispo", clip_low=0.2), logprobs, behaviour)
    assert torch.allclose(grad, -ratio.clamp(min=0.8) * ADV * MASK / 5) and close(stats["clip_fraction"], 2 / 5)


def test_sum_normalisation_adds_the_tokens_up() -> None:
    per_token = torch.tensor([[1.0, 2.0, 3.0, 9.0], [4.0, 6.0, 9.0, 9.0]])
    assert close(float(aggregate(per_token, MASK, "sum", COUNTS)), 16.0)
