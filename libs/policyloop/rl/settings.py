"""The learner's training knobs, each defined once with its default and description: the
objective (LossConfig) and the optimizer (OptimizerSettings). Imported by the learner's settings
and the CLI without torch."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

if TYPE_CHECKING:
    from peft import LoraConfig

    from policyloop.contracts.v1 import loop_pb2

LossKind = Literal["ppo", "gspo", "cispo"]
Normalization = Literal["token", "sequence", "constant"]
AdvantageKind = Literal["group", "group_no_std", "leave_one_out", "none"]
OffPolicy = Literal["none", "tis", "decoupled"]
KLEstimator = Literal["k1", "k2", "k3"]

LOSS_KINDS: tuple[str, ...] = get_args(LossKind)
NORMALIZATIONS: tuple[str, ...] = get_args(Normalization)
ADVANTAGE_KINDS: tuple[str, ...] = get_args(AdvantageKind)
OFF_POLICY_KINDS: tuple[str, ...] = get_args(OffPolicy)


class LossConfig(BaseModel):
    """Which objective the learner optimises: the `loss` settings of the learner (flags
    `--loss.<field>`, env `POLICYLOOP_LOSS__<FIELD>`), advertised in its status and named by
    runs (StartRunRequest.loss, keys in RUN_LOSS_KEYS). Named presets: GRPO = ppo + sequence +
    group; DAPO = ppo + token + clip_high > clip_low; Dr.GRPO = ppo + constant + group_no_std."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: LossKind = Field(
        "ppo", description="Policy loss: ppo (PPO-clip, GRPO/DAPO/Dr.GRPO by normalization and advantages), "
                           "gspo (sequence-level ratio) or cispo (clipped, detached IS weight).")
    normalization: Normalization = Field(
        "token", description="Loss normalisation: token (DAPO), sequence (GRPO), constant (Dr.GRPO).")
    constant: float = Field(0.0, ge=0, description="Normaliser of normalization=constant (0: the batch's width).")
    clip_low: float = Field(0.2, ge=0, description="PPO clip range below 1 for the importance ratio.")
    clip_high: float = Field(0.2, ge=0, description="PPO clip range above 1 (clip-higher when larger than "
                                                    "clip_low); CISPO's upper bound on its IS weight.")
    gspo_clip_low: float = Field(3e-4, ge=0, description="GSPO clip range below 1 of the sequence ratio.")
    gspo_clip_high: float = Field(4e-4, ge=0, description="GSPO clip range above 1 of the sequence ratio.")
    advantages: AdvantageKind = Field(
        "group", description="Advantages: group mean/std (GRPO), group mean only (Dr.GRPO), leave-one-out, none.")
    off_policy: OffPolicy = Field(
        "none", description="Off-policy correction: none (ratio to behaviour), tis (truncated IS weight "
                            "proximal/behaviour), decoupled (trust region at the proximal policy).")
    tis_cap: float = Field(2.0, ge=0, description="Cap of the IS weight (tis; decoupled when > 0).")
    kl_coef: float = Field(0.0, ge=0, description="Weight of the KL penalty to the base (reference) policy; 0: none.")
    kl_estimator: KLEstimator = Field("k3", description="Estimator of the KL penalty.")

    @model_validator(mode="after")
    def _tis_needs_a_cap(self) -> LossConfig:
        if self.off_policy == "tis" and self.tis_cap <= 0:
            raise ValueError("off_policy=tis needs tis_cap > 0")
        return self


# What a run names in StartRunRequest.loss (the wire keys, kept from the learner's flat setting
# names of earlier releases) -> the LossConfig field it means.
RUN_LOSS_KEYS: dict[str, str] = {"loss": "kind", "loss_constant": "constant"} | {
    name: name for name in LossConfig.model_fields if name not in ("kind", "constant")}


class OptimizerSettings(BaseModel):
    """AdamW and its learning-rate schedule over optimizer steps: linear warmup from 0 over
    `warmup_steps`, then constant, or cosine down to lr × min_lr_ratio at `decay_steps` (and
    flat after). The learner's `optimizer` settings (`--optimizer.<field>`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    lr: float = Field(1e-4, gt=0, description="AdamW learning rate (the peak, with a schedule).")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    warmup_steps: int = Field(0, ge=0, description="Steps of linear warmup from 0 to lr (0: none).")
    schedule: Literal["constant", "cosine"] = Field(
        "constant", description="After warmup: constant lr, or cosine decay to lr × min_lr_ratio at decay_steps.")
    decay_steps: int = Field(0, ge=0, description="Step at which the cosine schedule reaches its floor.")
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="Floor of the cosine schedule, as a fraction of lr.")
    max_grad_norm: float = Field(1.0, gt=0, description="Gradient norm clipping threshold.")

    @model_validator(mode="after")
    def _cosine_needs_room(self) -> OptimizerSettings:
        if self.schedule == "cosine" and self.decay_steps <= self.warmup_steps:
            raise ValueError("a cosine schedule needs decay_steps > warmup_steps")
        return self


# The projections of a Llama/Qwen-style decoder: attention and MLP.
DEFAULT_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_MODULE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class LoraSpec(BaseModel):
    """A run's adapter: rank, scaling, dropout and the modules it adapts (StartRun's LoRA spec)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    rank: int = Field(16, ge=1, le=1024, description="LoRA rank r: the adapter's inner dimension.")
    alpha: float = Field(32.0, gt=0, description="LoRA alpha: the update is scaled by alpha / rank.")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout on the adapter's input while training.")
    target_modules: tuple[str, ...] = Field(
        DEFAULT_TARGET_MODULES, min_length=1,
        description="Names of the linear modules adapted (the last part of their name in the model).")

    @field_validator("target_modules")
    @classmethod
    def _names(cls, names: tuple[str, ...]) -> tuple[str, ...]:
        bad = [n for n in names if not _MODULE_NAME.match(n)]
        if bad:
            raise ValueError(f"not module names: {bad}")
        if len(set(names)) != len(names):
            raise ValueError("a module is named twice")
        return names

    def peft_config(self) -> LoraConfig:
        from peft import LoraConfig

        return LoraConfig(r=self.rank, lora_alpha=self.alpha, lora_dropout=self.dropout,
                          target_modules=list(self.target_modules), bias="none", task_type="CAUSAL_LM")

    @classmethod
    def from_proto(cls, spec: loop_pb2.LoraSpec) -> LoraSpec:
        """StartRunRequest.lora, where a field left unset takes its default (alpha: 2 x rank)."""
        rank = spec.rank or cls.model_fields["rank"].default
        return cls(rank=rank, alpha=spec.alpha or 2.0 * rank, dropout=spec.dropout,
                   target_modules=tuple(spec.target_modules) or DEFAULT_TARGET_MODULES)

    def to_proto(self) -> loop_pb2.LoraSpec:
        from policyloop.contracts.v1 import loop_pb2

        return loop_pb2.LoraSpec(rank=self.rank, alpha=self.alpha, dropout=self.dropout,
                                 target_modules=list(self.target_modules))


def run_directory(run_id: str) -> str:
    """A name for a run in places that take fewer characters than run ids may hold (its
    checkpoint directory, its adapter's model name): readable, and distinct for distinct ids."""
    import xxhash

    readable = re.sub(r"[^A-Za-z0-9._-]", "_", run_id)[:48]
    return f"{readable}-{xxhash.xxh3_64_hexdigest(run_id.encode())[:12]}"


def adapter_model_name(model: str, run_id: str) -> str:
    """The name a LoRA run's adapter versions go under — at the publisher, in LEDGER and in the
    version registry (they travel as the base's do, as exact XOR deltas, but on their own): the
    base model's name, then the run's."""
    from policyloop.weights.store import validate_model_name

    name = f"{model}.lora.{run_directory(run_id)}"
    validate_model_name(name)
    return name


def run_policy_model(run_id: str, definition: loop_pb2.StartRunRequest) -> str:
    """The name a run's policy versions go under: the cluster's model, or a LoRA run's adapter."""
    return adapter_model_name(definition.model, run_id) if definition.HasField("lora") else definition.model
