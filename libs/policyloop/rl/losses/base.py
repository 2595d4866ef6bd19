"""What every loss kind is: a small settings model (its own parameters over the objective's
shared ones) with one method from typed per-token inputs to per-token loss terms and its own
statistics. The objective (rl.objective) does the rest for every kind alike: the ratio's anchor
and the off-policy weight, masking, normalisation, the KL penalty and the shared statistics.

Kinds use tensor methods only, so that this package (and the settings, the CLI and the gateway
that read it) import without torch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, model_validator

if TYPE_CHECKING:
    from torch import Tensor

Normalization = Literal["token", "sequence", "constant", "sum"]
AdvantageKind = Literal["group", "group_no_std", "leave_one_out", "none", "gae"]
OffPolicy = Literal["none", "tis", "decoupled"]
KLEstimator = Literal["k1", "k2", "k3"]

NORMALIZATIONS: tuple[str, ...] = get_args(Normalization)
ADVANTAGE_KINDS: tuple[str, ...] = get_args(AdvantageKind)
KL_ESTIMATORS: tuple[str, ...] = get_args(KLEstimator)


@dataclass(frozen=True)
class LossInputs:
    """One batch's per-token tensors, [rows, tokens]."""

    logprobs: Tensor          # the current policy's, with gradient
    log_ratio: Tensor         # logprobs − the anchor (behaviour or proximal policy), 0 off the mask
    advantages: Tensor        # a row's advantage on each of its tokens; a supervised loss's weights
    mask: Tensor              # float, 1 on the tokens trained

    @property
    def ratio(self) -> Tensor:
        return self.log_ratio.exp()

    def share(self, selected: Tensor) -> float:
        """The share of trained tokens where `selected` holds."""
        return float((selected & (self.mask > 0)).sum() / self.mask.sum().clamp(min=1.0))


@dataclass(frozen=True)
class LossTerms:
    per_token: Tensor                                   # [rows, tokens], before weighting and masking
    statistics: dict[str, float]                        # the kind's own (e.g. clip_fraction)


class PolicyLoss(BaseModel):
    """The settings every kind shares: how its terms are normalised, the advantages, the
    off-policy correction and the KL penalty. A kind subclasses it with `kind: Literal[name]`,
    its own parameters and `terms`; the registry (rl.losses) finds it in its module."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # A loss that learns from samples of a policy (the ratio to their behaviour logprobs); false:
    # from weighted demonstrations (no behaviour logprobs).
    uses_behaviour: ClassVar[bool] = True
    # One ratio per sequence rather than per token (its mask says which tokens count).
    sequence_level: ClassVar[bool] = False

    kind: str
    normalization: Normalization = Field(
        "token", description="Loss normalisation: token (DAPO), sequence (GRPO), constant (Dr.GRPO), sum (none).")
    constant: float = Field(0.0, ge=0, description="Normaliser of normalization=constant (0: the batch's width).")
    advantages: AdvantageKind = Field(
        "group", description="Advantages: group mean/std (GRPO), group mean only (Dr.GRPO), leave-one-out, none, "
                             "or gae (PPO's: per token from a critic the learner trains beside the policy).")
    gamma: float = Field(1.0, ge=0, le=1, description="gae: the discount of later rewards per token.")
    lam: float = Field(0.95, ge=0, le=1, description="gae: lambda, between one-step TD (0) and Monte Carlo (1).")
    value_clip: float = Field(
        0.2, ge=0, description="gae: the critic's clipped value loss keeps new values within this of the old "
                               "(0: no clipping).")
    off_policy: OffPolicy = Field(
        "none", description="Off-policy correction: none (ratio to behaviour), tis (truncated IS weight "
                            "proximal/behaviour), decoupled (trust region at the proximal policy).")
    tis_cap: float = Field(2.0, ge=0, description="Cap of the IS weight (tis; decoupled when > 0).")
    kl_coef: float = Field(0.0, ge=0, description="Weight of the KL penalty to the base (reference) policy; 0: none.")
    kl_estimator: KLEstimator = Field("k3", description="Estimator of the KL penalty.")

    @model_validator(mode="after")
    def _tis_needs_a_cap(self) -> PolicyLoss:
        if self.off_policy == "tis" and self.tis_cap <= 0:
            raise ValueError("off_policy=tis needs tis_cap > 0")
        return self

    def terms(self, inputs: LossInputs) -> LossTerms:
        raise NotImplementedError


def clip_range(description: str, default: float) -> float:
    """A clip range around a ratio of 1 (a field of the kinds that clip)."""
    return Field(default, ge=0, description=description)  # type: ignore[no-any-return]
