"""GAE against a hand computation, the per-token rewards of single- and multi-turn samples,
whitening, and the critic's clipped value loss."""

from __future__ import annotations

import pytest
import torch

from policyloop.contracts.v1 import bus_pb2
from policyloop.rl.advantages import gae, masked_whiten
from policyloop.rl.critic import token_rewards, value_loss
from policyloop.rl.logprobs import pack
from policyloop.rl.objective import compute_advantages


def test_gae_matches_a_hand_computation() -> None:
    gamma, lam = 0.9, 0.8
    # Row 0: three trained tokens, reward 1 on the last. Row 1: trained, a tool's token (skipped), trained.
    values = torch.tensor([[0.5, 0.4, 0.6, 0.0], [0.2, 9.9, 0.3, 0.0]])
    rewards = torch.tensor([[0.0, 0.0, 1.0, 0.0], [0.5, 0.0, 2.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 1, 0]])
    advantages, returns = gae(rewards, values, mask, gamma=gamma, lam=lam)
    # Row 0, by hand: δ2 = 1 − 0.6 = 0.4; δ1 = 0 + 0.9·0.6 − 0.4 = 0.14; δ0 = 0 + 0.9·0.4 − 0.5 = −0.14.
    a2 = 0.4
    a1 = 0.14 + gamma * lam * a2
    a0 = -0.14 + gamma * lam * a1
    # Row 1: the tool's token (value 9.9) is no state the model acts from: token 0's next is token 2.
    b2 = 2.0 - 0.3
    b0 = 0.5 + gamma * 0.3 - 0.2 + gamma * lam * b2
    assert advantages.flatten().tolist() == pytest.approx([a0, a1, a2, 0.0, b0, 0.0, b2, 0.0])
    assert returns.flatten().tolist() == pytest.approx(
        [a0 + 0.5, a1 + 0.4, a2 + 0.6, 0.0, b0 + 0.2, 0.0, b2 + 0.3, 0.0])
    # λ = 1, γ = 1: the return of every token is the reward to go (Monte Carlo).
    _, mc = gae(rewards, values, mask, gamma=1.0, lam=1.0)
    assert mc[0, :3].tolist() == pytest.approx([1.0, 1.0, 1.0]) and mc[1].tolist() == pytest.approx([2.5, 0, 2.0, 0])
    with pytest.raises(ValueError, match="need a critic"):
        compute_advantages(torch.zeros(2, 2), "gae")


def test_whitening_uses_the_whole_batch_when_told() -> None:
    values = torch.tensor([[1.0, 2.0, 3.0, 100.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    whitened = masked_whiten(values, mask)
    assert whitened[0, :3].mean().item() == pytest.approx(0.0, abs=1e-6)
    assert whitened[0, :3].pow(2).mean().item() == pytest.approx(1.0, rel=1e-4) and whitened[0, 3] == 0
    # Equal advantages (up to rounding) stay about 0, not rounding noise blown up to ±1.
    assert masked_whiten(torch.tensor([[0.5, 0.5 + 1e-7, 0.5]]), torch.ones(1, 3)).abs().max() < 1e-3
    # A rank's share whitened with the batch's totals: as if the batch were whitened at once.
    batch = torch.tensor([[1.0, 2.0], [3.0, 6.0]])
    ones = torch.ones_like(batch)
    total = (4.0, float(batch.sum()), float(batch.square().sum()))
    assert masked_whiten(batch[1:], ones[1:], total=total).flatten().tolist() == pytest.approx(
        masked_whiten(batch, ones)[1:].flatten().tolist())


def test_token_rewards_put_step_rewards_on_their_turns_and_the_rest_last() -> None:
    single = bus_pb2.Trajectory(response_token_ids=[7, 8, 1], loss_mask=[True] * 3, reward=1.5)
    multi = bus_pb2.Trajectory(response_token_ids=[7, 8, 9, 9, 5, 1], loss_mask=[True, True, False, False, True, True],
                               reward=2.0, turns=[
                                   bus_pb2.Turn(role=bus_pb2.Turn.ROLE_MODEL, start=0, end=2, reward=0.5),
                                   bus_pb2.Turn(role=bus_pb2.Turn.ROLE_TOOL, start=2, end=4),
                                   bus_pb2.Turn(role=bus_pb2.Turn.ROLE_MODEL, start=4, end=6, reward=1.0)])
    prompts = [[4, 5, 16], [4, 16]]
    batch = pack(prompts, [list(t.response_token_ids) for t in (single, multi)],
                 [list(t.loss_mask) for t in (single, multi)])
    rewards = token_rewards([single, multi], batch)
    # Response token j sits at column len(prompt) - 1 + j.
    assert rewards[0].tolist() == pytest.approx([0, 0, 0, 0, 1.5, 0, 0])
    # 0.5 on the first turn's last token, 1.0 on the second's, and the 0.5 beyond them last too.
    assert rewards[1].tolist() == pytest.approx([0, 0, 0.5, 0, 0, 0, 1.5])
    assert float(rewards[1].sum()) == pytest.approx(multi.reward)


def test_the_value_loss_is_clipped_around_the_old_values() -> None:
    old = torch.tensor([[0.0, 0.0]])
    new = torch.tensor([[0.5, -0.1]], requires_grad=True)
    returns = torch.tensor([[1.0, 0.0]])
    mask = torch.ones(1, 2)
    result = value_loss(new, old, returns, mask, clip=0.2, total_tokens=2)
    # Token 0: unclipped (0.5 − 1)² = 0.25, clipped (0.2 − 1)² = 0.64: the larger. Token 1: 0.01 both.
    assert float(result.loss.detach()) == pytest.approx(0.5 * (0.64 + 0.01) / 2)
    assert result.statistics["value_clip_fraction"] == pytest.approx(0.5)
    result.loss.backward()
    assert new.grad is not None and new.grad[0, 0] == 0  # the clipped term carries no gradient to it
    unclipped = value_loss(new.detach(), old, returns, mask, clip=0.0, total_tokens=2)
    assert float(unclipped.loss) == pytest.approx(0.5 * (0.25 + 0.01) / 2)
