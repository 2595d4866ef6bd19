"""The Tinker API's built-in losses over one datum's token logprobs.

Every loss is a sum over tokens (and, in a request, over datums): Tinker reports it as
`loss:sum`. `logprobs` are the current policy's log-probabilities of `target_tokens` (position i
predicts target i); `sampling` are those of the policy that sampled them (loss_fn_inputs
`logprobs`). Tokens whose advantage (or weight) is 0 contribute nothing.

- cross_entropy: -Σ w·logp.
- importance_sampling: -Σ r·A, r = exp(logp - sampling) (the REINFORCE gradient, off-policy corrected).
- ppo: -Σ min(r·A, clip(r, low, high)·A); loss_fn_config clip_low_threshold (0.8), clip_high_threshold (1.2).
- cispo: -Σ sg(clip(r, low, high))·A·logp (the clipped ratio as a constant weight; same thresholds).
- dro: -Σ (A·logp - β/2·(logp - sampling)²); loss_fn_config beta (required).
- gspo: one ratio per sequence, s = exp(mean over masked tokens of (logp - sampling)) (mask:
  loss_fn_inputs sequence_ratio_mask, default tokens with a nonzero advantage); each token's
  weight is s with the gradient of its own logp, -Σ min(w·A, clip(w, low, high)·A); thresholds
  as ppo (defaults 1 - 3e-4, 1 + 4e-4, the GSPO paper's).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

RL_INPUTS = ("target_tokens", "logprobs", "advantages")
REQUIRED_INPUTS: dict[str, tuple[str, ...]] = {
    "cross_entropy": ("target_tokens", "weights"),
    "importance_sampling": RL_INPUTS,
    "ppo": RL_INPUTS,
    "cispo": RL_INPUTS,
    "dro": RL_INPUTS,
    "gspo": RL_INPUTS,
}
OPTIONAL_INPUTS: dict[str, tuple[str, ...]] = {"gspo": ("sequence_ratio_mask",)}
CONFIG_KEYS: dict[str, dict[str, float | None]] = {  # name -> default (None: required)
    "cross_entropy": {},
    "importance_sampling": {},
    "ppo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    "cispo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    "dro": {"beta": None},
    "gspo": {"clip_low_threshold": 1 - 3e-4, "clip_high_threshold": 1 + 4e-4},
}
# Named by the SDK, refused here with the reason.
UNSUPPORTED = {
    "stable_reinforce": "needs the stability information of samples recorded by the hosted service's sampler",
    "custom": "server-side custom losses are not supported: use forward_backward_custom, which runs the "
              "loss in the client (the server answers client/config with custom_loss_server_side false)",
}


class LossInputError(ValueError):
    """A loss asked for with inputs or config it cannot take; the message names them."""


@dataclass(frozen=True)
class LossSpec:
    name: str
    config: Mapping[str, float]

    @classmethod
    def parse(cls, name: str, config: Mapping[str, float | str], inputs: set[str]) -> LossSpec:
        if name in UNSUPPORTED:
            raise LossInputError(f"loss_fn: {name!r} is not supported: {UNSUPPORTED[name]}")
        if name not in REQUIRED_INPUTS:
            raise LossInputError(f"loss_fn: unknown loss {name!r} (supported: {sorted(REQUIRED_INPUTS)})")
        missing = [n for n in REQUIRED_INPUTS[name] if n not in inputs]
        if missing:
            raise LossInputError(f"loss_fn_inputs: {name} needs {list(REQUIRED_INPUTS[name])}, missing {missing}")
        known = set(REQUIRED_INPUTS[name]) | set(OPTIONAL_INPUTS.get(name, ()))
        extra = sorted(inputs - known)
        if extra:
            raise LossInputError(f"loss_fn_inputs: {name} takes {sorted(known)}, not {extra}")
        allowed = CONFIG_KEYS[name]
        unknown = sorted(set(config) - set(allowed))
        if unknown:
            raise LossInputError(f"loss_fn_config: {name} takes {sorted(allowed)}, not {unknown}")
        values: dict[str, float] = {}
        for key, default in allowed.items():
            value = config.get(key, default)
            if value is None:
                raise LossInputError(f"loss_fn_config.{key}: required by {name}")
            if not isinstance(value, int | float):
                raise LossInputError(f"loss_fn_config.{key}: a number, got {value!r}")
            values[key] = float(value)
        if "clip_low_threshold" in values and not 0 <= values["clip_low_threshold"] <= 1 <= \
                values["clip_high_threshold"]:
            raise LossInputError("loss_fn_config: need 0 <= clip_low_threshold <= 1 <= clip_high_threshold")
        return cls(name, values)

    def loss(self, logprobs: torch.Tensor, inputs: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(the datum's loss, its per-token loss) for one datum's logprobs of its targets."""
        if self.name == "cross_entropy":
            per_token = -inputs["weights"] * logprobs
            return per_token.sum(), per_token
        advantages, sampling = inputs["advantages"], inputs["logprobs"]
        ratio = torch.exp(logprobs - sampling)
        if self.name == "importance_sampling":
            per_token = -ratio * advantages
        elif self.name == "ppo":
            clipped = ratio.clamp(self.config["clip_low_threshold"], self.config["clip_high_threshold"])
            per_token = -torch.minimum(ratio * advantages, clipped * advantages)
        elif self.name == "cispo":
            weight = ratio.clamp(self.config["clip_low_threshold"], self.config["clip_high_threshold"]).detach()
            per_token = -weight * advantages * logprobs
        elif self.name == "dro":
            per_token = -(advantages * logprobs - 0.5 * self.config["beta"] * (logprobs - sampling) ** 2)
        else:  # gspo
            mask = inputs.get("sequence_ratio_mask")
            mask = (advantages != 0).to(logprobs.dtype) if mask is None else mask
            count = mask.sum().clamp(min=1.0)
            sequence = torch.exp(((logprobs - sampling) * mask).sum() / count)
            weight = sequence.detach() * torch.exp(logprobs - logprobs.detach())
            clipped = weight.clamp(self.config["clip_low_threshold"], self.config["clip_high_threshold"])
            per_token = -torch.minimum(weight * advantages, clipped * advantages) * mask
        return per_token.sum(), per_token
