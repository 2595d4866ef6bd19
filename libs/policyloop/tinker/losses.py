"""The Tinker API's built-in losses: the loss registry's kinds (rl.losses) under the SDK's names
for their inputs and config, computed by the one objective (rl.objective) as sums over tokens
(Tinker reports `loss:sum`), with no off-policy correction or KL penalty.

- `loss_fn` is a registry kind: cross_entropy, importance_sampling, ppo, cispo, dro, gspo.
- `loss_fn_inputs`: target_tokens, with logprobs (the sampling policy's) and advantages for a kind
  that learns from samples, weights for cross_entropy; sequence_ratio_mask optionally for gspo
  (default: the tokens with a nonzero advantage).
- `loss_fn_config`: clip_low_threshold and clip_high_threshold are the clip bounds 1 − clip_low and
  1 + clip_high of the kinds that clip (defaults the kind's: ppo 0.8/1.2, cispo 0/1.2, gspo
  1 − 3e-4/1 + 4e-4); beta is dro's (required); other settings of a kind are the kind's defaults.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch.nn.utils.rnn import pad_sequence

from policyloop.rl.losses import KINDS, PolicyLoss
from policyloop.rl.objective import BatchCounts, Objective, objective

# Tinker's config names for registry settings whose meaning it writes differently.
THRESHOLDS = {"clip_low": "clip_low_threshold", "clip_high": "clip_high_threshold"}
SHARED = set(PolicyLoss.model_fields)
# Named by the SDK, refused here with the reason.
UNSUPPORTED = {
    "stable_reinforce": "needs the stability information of samples recorded by the hosted service's sampler",
    "custom": "server-side custom losses are not supported: use forward_backward_custom, which runs the "
              "loss in the client (the server answers client/config with custom_loss_server_side false)",
}


class LossInputError(ValueError):
    """A loss asked for with inputs or config it cannot take; the message names them."""


def required_inputs(model: type[PolicyLoss]) -> tuple[str, ...]:
    return ("target_tokens", "logprobs", "advantages") if model.uses_behaviour else ("target_tokens", "weights")


def optional_inputs(model: type[PolicyLoss]) -> tuple[str, ...]:
    return ("sequence_ratio_mask",) if model.sequence_level else ()


def config_keys(model: type[PolicyLoss]) -> dict[str, str]:
    """Tinker's loss_fn_config names of a kind's own settings → the settings."""
    return {THRESHOLDS.get(name, name): name for name in model.model_fields if name not in SHARED}


@dataclass(frozen=True)
class LossSpec:
    loss: PolicyLoss

    @classmethod
    def parse(cls, name: str, config: Mapping[str, float | str], inputs: set[str]) -> LossSpec:
        if name in UNSUPPORTED:
            raise LossInputError(f"loss_fn: {name!r} is not supported: {UNSUPPORTED[name]}")
        if name not in KINDS:
            raise LossInputError(f"loss_fn: unknown loss {name!r} (supported: {sorted(KINDS)})")
        model = KINDS[name]
        needed = required_inputs(model)
        missing = [n for n in needed if n not in inputs]
        if missing:
            raise LossInputError(f"loss_fn_inputs: {name} needs {list(needed)}, missing {missing}")
        known = set(needed) | set(optional_inputs(model))
        extra = sorted(inputs - known)
        if extra:
            raise LossInputError(f"loss_fn_inputs: {name} takes {sorted(known)}, not {extra}")
        keys = config_keys(model)
        unknown = sorted(set(config) - set(keys))
        if unknown:
            raise LossInputError(f"loss_fn_config: {name} takes {sorted(keys)}, not {unknown}")
        settings: dict[str, float | str] = {"kind": name, "normalization": "sum"}
        for key, field in keys.items():
            if key not in config:
                if model.model_fields[field].is_required():
                    raise LossInputError(f"loss_fn_config.{key}: required by {name}")
                continue
            value = config[key]
            if not isinstance(value, int | float):
                raise LossInputError(f"loss_fn_config.{key}: a number, got {value!r}")
            settings[field] = 1.0 - value if key == "clip_low_threshold" else \
                value - 1.0 if key == "clip_high_threshold" else float(value)
        if any(settings.get(field, 0.0) < 0 or (field == "clip_low" and settings[field] > 1)  # type: ignore[operator]
               for field in THRESHOLDS if field in settings):
            raise LossInputError("loss_fn_config: need 0 <= clip_low_threshold <= 1 <= clip_high_threshold")
        try:
            return cls(model.model_validate(settings))
        except ValueError as exc:
            raise LossInputError(f"loss_fn_config: {exc}") from None

    def compute(self, logprobs: torch.Tensor, lengths: Sequence[int],
                inputs: Sequence[Mapping[str, torch.Tensor]]) -> Objective:
        """The loss of right-padded rows ([rows, width] logprobs of their targets; row i's first
        lengths[i] count), each row's loss_fn_inputs other than target_tokens given per token.
        Objective.per_token holds each datum's elementwise loss, its rows' sums the datums'."""
        rows, width = logprobs.shape

        def padded(values: Sequence[torch.Tensor]) -> torch.Tensor:  # right-padded with 0 to the width
            out = pad_sequence([v.to(logprobs.dtype) for v in values], batch_first=True)
            return out if out.shape[1] == width else torch.nn.functional.pad(out, (0, width - out.shape[1]))

        kind = type(self.loss)
        behaviour = padded([given["logprobs"] for given in inputs]) if kind.uses_behaviour else None
        advantages = padded([given["advantages" if kind.uses_behaviour else "weights"] for given in inputs])
        if kind.sequence_level:
            mask = padded([given.get("sequence_ratio_mask", given["advantages"] != 0) for given in inputs])
        else:
            mask = padded([logprobs.new_ones(length) for length in lengths])
        counts = BatchCounts(tokens=float(mask.sum()), sequences=rows, width=width)
        return objective(self.loss, logprobs, advantages, mask, counts, behaviour_logprobs=behaviour)
