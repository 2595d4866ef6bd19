"""The Tinker API's built-in losses (the loss registry's kinds under the SDK's names): each one's
value and its gradient with respect to the policy's token logprobs, against the formula written
out by hand, datums of different lengths in one padded batch, and the refusals of inputs and
config a loss cannot take."""

from __future__ import annotations

import math

import pytest
import torch

from policyloop.tinker.losses import LossInputError, LossSpec

LOGPROBS = torch.tensor([-0.5, -1.0, -2.0, -0.1])
SAMPLING = torch.tensor([-0.7, -0.4, -2.0, -0.3])
ADVANTAGES = torch.tensor([1.0, -1.0, 0.0, 2.0])
RL = {"target_tokens", "logprobs", "advantages"}


def value_and_grad(spec: LossSpec, inputs: dict[str, torch.Tensor]) -> tuple[float, list[float]]:
    logprobs = LOGPROBS.clone().requires_grad_(True)
    result = spec.compute(logprobs[None, :], [len(LOGPROBS)], [inputs])
    assert float(result.per_token.detach().sum()) == pytest.approx(float(result.loss.detach()))
    result.loss.backward()
    return float(result.loss.detach()), logprobs.grad.tolist()


def rl_inputs() -> dict[str, torch.Tensor]:
    return {"logprobs": SAMPLING, "advantages": ADVANTAGES}


def test_cross_entropy_is_the_weighted_negative_log_likelihood() -> None:
    weights = torch.tensor([1.0, 0.0, 2.0, -1.0])  # negative weights: forward_backward_custom's surrogate
    loss, grad = value_and_grad(LossSpec.parse("cross_entropy", {}, {"target_tokens", "weights"}),
                                {"weights": weights})
    assert loss == pytest.approx(float(-(weights * LOGPROBS).sum()))
    assert grad == pytest.approx((-weights).tolist())


def test_importance_sampling_weights_the_advantage_by_the_ratio() -> None:
    loss, grad = value_and_grad(LossSpec.parse("importance_sampling", {}, RL), rl_inputs())
    ratio = torch.exp(LOGPROBS - SAMPLING)
    assert loss == pytest.approx(float(-(ratio * ADVANTAGES).sum()))
    assert grad == pytest.approx((-ratio * ADVANTAGES).tolist())


def test_ppo_stops_the_gradient_where_the_clipped_term_is_the_smaller() -> None:
    spec = LossSpec.parse("ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}, RL)
    loss, grad = value_and_grad(spec, rl_inputs())
    ratio = torch.exp(LOGPROBS - SAMPLING).tolist()  # [1.22, 0.55, 1.0, 1.22]
    # token 0: A > 0 and r > 1.1: clipped, no gradient; token 1: A < 0 and r < 0.9: clipped;
    # token 2: A = 0; token 3: clipped as token 0.
    assert grad == pytest.approx([0.0, 0.0, 0.0, 0.0])
    assert loss == pytest.approx(-(1.1 * 1.0 + 0.9 * -1.0 + 1.1 * 2.0))
    loss, _ = value_and_grad(LossSpec.parse("ppo", {}, RL), rl_inputs())  # defaults 0.8, 1.2
    assert loss == pytest.approx(-(1.2 * 1.0 + 0.8 * -1.0 + 1.2 * 2.0))
    # Inside the clip range the gradient is the importance-sampling one.
    loss, grad = value_and_grad(LossSpec.parse("ppo", {"clip_low_threshold": 0.5, "clip_high_threshold": 1.5}, RL),
                                rl_inputs())
    assert grad == pytest.approx([-ratio[0], ratio[1], 0.0, -2 * ratio[3]])


def test_cispo_keeps_the_gradient_of_every_token_with_a_clipped_constant_weight() -> None:
    loss, grad = value_and_grad(LossSpec.parse("cispo", {}, RL), rl_inputs())
    weight = torch.exp(LOGPROBS - SAMPLING).clamp(max=1.2)  # the paper's: no lower bound by default
    assert grad == pytest.approx((-weight * ADVANTAGES).tolist())
    loss, grad = value_and_grad(LossSpec.parse("cispo", {"clip_low_threshold": 0.8}, RL), rl_inputs())
    weight = torch.exp(LOGPROBS - SAMPLING).clamp(0.8, 1.2)
    assert grad == pytest.approx((-weight * ADVANTAGES).tolist())
    assert loss == pytest.approx(float(-(weight * ADVANTAGES * LOGPROBS).sum()))


def test_dro_adds_a_quadratic_pull_towards_the_sampling_policy() -> None:
    loss, grad = value_and_grad(LossSpec.parse("dro", {"beta": 0.5}, RL), rl_inputs())
    delta = LOGPROBS - SAMPLING
    assert loss == pytest.approx(float(-(ADVANTAGES * LOGPROBS - 0.25 * delta**2).sum()))
    assert grad == pytest.approx((-ADVANTAGES + 0.5 * delta).tolist())


def test_gspo_uses_one_ratio_per_sequence() -> None:
    mask = torch.tensor([1.0, 1.0, 0.0, 1.0])
    spec = LossSpec.parse("gspo", {"clip_low_threshold": 0.5, "clip_high_threshold": 2.0},
                          RL | {"sequence_ratio_mask"})
    loss, grad = value_and_grad(spec, {**rl_inputs(), "sequence_ratio_mask": mask})
    sequence = math.exp(float(((LOGPROBS - SAMPLING) * mask).sum()) / 3)
    assert loss == pytest.approx(-sequence * float((ADVANTAGES * mask).sum()))
    assert grad == pytest.approx((-sequence * ADVANTAGES * mask).tolist())


@pytest.mark.parametrize(("name", "config", "inputs", "message"), [
    ("cispo", {}, {"target_tokens", "advantages"}, "loss_fn_inputs: cispo needs .* missing \\['logprobs'\\]"),
    ("cross_entropy", {}, {"target_tokens", "weights", "advantages"}, "cross_entropy takes .* not \\['advantages'\\]"),
    ("dro", {}, RL, "loss_fn_config.beta: required by dro"),
    ("ppo", {"clip_epsilon": 0.2}, RL, "loss_fn_config: ppo takes .* not \\['clip_epsilon'\\]"),
    ("ppo", {"clip_low_threshold": 1.5}, RL, "clip_low_threshold <= 1 <= clip_high_threshold"),
    ("dro", {"beta": "high"}, RL, "loss_fn_config.beta: a number"),
    ("custom", {}, RL, "forward_backward_custom"),
    ("kl", {}, RL, "unknown loss 'kl'"),
])
def test_a_loss_refuses_what_it_cannot_take(name: str, config: dict, inputs: set[str], message: str) -> None:
    with pytest.raises(LossInputError, match=message):
        LossSpec.parse(name, config, inputs)


def test_padded_datums_of_a_batch_keep_their_own_losses() -> None:
    """Rows of a micro-batch: each datum's elementwise loss is what it has alone, padding adds nothing."""
    spec = LossSpec.parse("ppo", {}, RL)
    alone = [spec.compute(LOGPROBS[None, :n], [n], [{"logprobs": SAMPLING[:n], "advantages": ADVANTAGES[:n]}])
             for n in (4, 2)]
    padded = torch.stack([LOGPROBS, torch.cat([LOGPROBS[:2], torch.tensor([5.0, 5.0])])])
    both = spec.compute(padded, [4, 2], [{"logprobs": SAMPLING, "advantages": ADVANTAGES},
                                         {"logprobs": SAMPLING[:2], "advantages": ADVANTAGES[:2]}])
    assert both.per_token[0].tolist() == pytest.approx(alone[0].per_token[0].tolist())
    assert both.per_token[1, :2].tolist() == pytest.approx(alone[1].per_token[0].tolist())
    assert both.per_token[1, 2:].tolist() == [0.0, 0.0]
    assert float(both.loss) == pytest.approx(float(alone[0].loss) + float(alone[1].loss))


def test_every_registry_kind_is_a_tinker_loss() -> None:
    """One loss registry: a kind added to it is a Tinker loss_fn with the inputs its flags imply."""
    from policyloop.rl.losses import KINDS
    from policyloop.tinker.losses import config_keys, required_inputs

    for name, model in KINDS.items():
        config = {key: 0.5 for key, field in config_keys(model).items() if model.model_fields[field].is_required()}
        assert LossSpec.parse(name, config, set(required_inputs(model))).loss.kind == name
