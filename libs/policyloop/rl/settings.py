"""The learner's training knobs, each defined once with its default and description: the
optimizer (OptimizerSettings) and runs' LoRA adapters (LoraSpec); the objective's are the loss
registry's (rl.losses). Imported by the learner's settings and the CLI without torch."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

if TYPE_CHECKING:
    from peft import LoraConfig

    from policyloop.contracts.v1 import loop_pb2


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


class CriticSettings(BaseModel):
    """The value model PPO's GAE advantages need (loss `advantages: gae`): trained by the learner
    in the same step as the policy, checkpointed and restored with it. The learner's `critic`
    settings (`--critic.<field>`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model_path: str = Field(
        "", description="The critic's model (a directory or a Hugging Face id; its vocabulary must cover the "
                        "policy's): a value head on its backbone. Empty: a copy of the policy with a value head.")
    lr: float = Field(1e-4, gt=0, description="AdamW learning rate of the critic.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay of the critic.")
    max_grad_norm: float = Field(1.0, gt=0, description="Gradient norm clipping threshold of the critic.")


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
