"""The learner's model side: a Hugging Face causal LM sharded with FSDP2 (`fully_shard`) over
several ranks (a single rank trains it unsharded), one policy-gradient step per batch of
complete groups (the objective of the loss registry's kinds, rl.losses), and its weights exported as safetensors.

The trainer knows nothing of the bus: it takes groups of trajectories and returns figures.
"""

from __future__ import annotations

import functools
import math
import os
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import safetensors.torch
import torch
import torch.distributed as dist
from pydantic import Field
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard

from policyloop.common.device import resolve_device
from policyloop.contracts.v1 import bus_pb2
from policyloop.rl.advantages import gae, masked_whiten
from policyloop.rl.batching import ModelLimits
from policyloop.rl.critic import Critic, ValueLoss, token_rewards, value_loss, whitening_totals
from policyloop.rl.logprobs import (
    PackedBatch,
    pack,
    response_values,
    token_logprobs,
    token_logprobs_and_entropy,
)
from policyloop.rl.losses import KINDS, LossSettings
from policyloop.rl.losses.cross_entropy import CrossEntropyLoss
from policyloop.rl.objective import BatchCounts, LossStatistics, compute_advantages, objective
from policyloop.rl.settings import CriticSettings, OptimizerSettings
from policyloop.telemetry.phases import PhaseClock

if TYPE_CHECKING:
    from policyloop.rl.checkpoint import Snapshot, TrainerState


class TrainerConfig(OptimizerSettings):
    loss: LossSettings = Field(default_factory=KINDS["ppo"])
    threads: int = 1
    device: Literal["auto", "cpu", "cuda"] = "auto"  # auto: CUDA when present
    share_prompts: bool = True  # each distinct prompt of a step computed once (rl.logprobs)
    critic: CriticSettings = Field(default_factory=CriticSettings)  # with loss.advantages gae


@dataclass(frozen=True)
class StepReport:
    step: int
    samples: int
    groups: int
    mean_reward: float
    grad_norm: float
    trained_tokens: int
    seconds: float
    statistics: LossStatistics          # the loss and its statistics by name (rl.objective)
    # Wall time of the step's phases: pack (the batch from the messages), forward (log-probs and
    # entropy, the reference's), backward, optimizer (clip, step, schedule), critic (its update).
    phases: dict[str, float] = field(default_factory=dict, compare=False)
    # With a critic: the value of each trained token of this rank's samples, by trajectory id.
    token_values: dict[str, list[float]] = field(default_factory=dict, compare=False)

    @property
    def loss(self) -> float:
        return self.statistics["loss"]


def init_distributed(device: str = "auto") -> DeviceMesh:
    """One process group per learner: torchrun's when launched by it (RANK etc. in the
    environment), else a single rank on a free local port (FSDP2 needs a process group even
    at world size 1)."""
    device = resolve_device(device)
    backend = "nccl" if device == "cuda" else "gloo"
    if not dist.is_initialized():
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            dist.init_process_group(backend)
        else:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    return init_device_mesh(device, (dist.get_world_size(),))


def load_policy(model_path: Path, mesh: DeviceMesh) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    if mesh.size() == 1:
        # One rank shards nothing: FSDP2's hooks and DTensor parameters would only cost (the
        # optimizer step of the demo's batch took twice as long with them: perf/learner_alone.py).
        model.to(mesh.device_type)
    else:
        layers = getattr(getattr(model, "model", None), "layers", None)
        # Each decoder layer is its own FSDP unit, then the root (embeddings, head).
        for layer in layers or []:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    model.train()
    return model


def load_reference(model_path: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    model.requires_grad_(False)
    return model.eval()


def weight_keys(model_path: Path) -> list[str]:
    """Tensor names of the base checkpoint: what an engine expects to load (tied weights once)."""
    keys: list[str] = []
    for file in sorted(Path(model_path).glob("*.safetensors")):
        with safetensors.safe_open(str(file), framework="pt") as f:
            keys.extend(f.keys())
    if not keys:
        raise FileNotFoundError(f"no *.safetensors in {model_path}")
    return keys


@dataclass(frozen=True)
class LrSchedule:
    """The multiplier of the base learning rate at optimizer step `step` (0-based)."""

    config: OptimizerSettings

    def __call__(self, step: int) -> float:
        c = self.config
        if step < c.warmup_steps:
            return (step + 1) / c.warmup_steps
        if c.schedule == "constant":
            return 1.0
        progress = min(1.0, (step - c.warmup_steps) / (c.decay_steps - c.warmup_steps))
        return c.min_lr_ratio + (1 - c.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


@dataclass
class StepLoss:
    """One step's loss on this rank's share of the batch, before its backward."""

    loss: torch.Tensor
    statistics: LossStatistics
    rewards: torch.Tensor    # [groups, group size]
    groups: int
    samples: int             # the whole batch's, every rank's share
    tokens: float            # trained tokens of the whole batch
    critic: ValueLoss | None = None                                   # with gae: the critic's loss
    token_values: dict[str, list[float]] = field(default_factory=dict)

    def report(self, step: int, grad_norm: torch.Tensor | float, seconds: float,
               phases: dict[str, float]) -> StepReport:
        norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
        return StepReport(step=step, samples=self.samples, groups=self.groups, mean_reward=float(self.rewards.mean()),
                          grad_norm=float(norm), trained_tokens=int(self.tokens), seconds=seconds,
                          statistics=self.statistics, phases=phases, token_values=self.token_values)


def grpo_loss(model: torch.nn.Module, groups: Sequence[Sequence[bus_pb2.Trajectory]], config: LossSettings, *,
              pad_id: int, device: torch.device, rank: int = 0, world_size: int = 1,
              reference: Callable[[PackedBatch], torch.Tensor] | None = None,
              clock: PhaseClock | None = None, share_prompts: bool = False, critic: Critic | None = None) -> StepLoss:
    """The objective of one step on complete groups, for this rank's share of the samples (every
    `world_size`-th from `rank`): the policy loss, or — for a step of demonstrations
    (Trajectory.supervised) — cross-entropy. `reference` gives the KL penalty's reference
    log-probs of a batch (when the penalty is on). `clock` gets the pack and forward phases.
    `share_prompts`: rows of the same prompt compute it once (the same figures, fewer tokens).
    `critic`: the value model of `advantages: gae` (its loss comes back beside the policy's)."""
    clock = clock or PhaseClock()
    group_size = len(groups[0])
    if any(len(g) != group_size for g in groups):
        raise ValueError("every group of a step must have the same size")
    samples = [t for group in groups for t in group]
    supervised = is_supervised_step(groups)
    rewards = torch.tensor([[t.reward for t in g] for g in groups], dtype=torch.float32)
    if len(samples) < world_size:
        raise ValueError(f"{len(samples)} samples cannot be shared by {world_size} ranks")
    masks = [[bool(m) and t.finish_reason != bus_pb2.FINISH_REASON_ERROR for m in t.loss_mask] for t in samples]
    # Every rank knows the whole batch, so the global token count needs no collective.
    total_tokens = float(sum(sum(m) for m in masks))
    mine = list(range(rank, len(samples), world_size))
    prompts = [list(samples[i].prompt_token_ids) for i in mine]
    responses = [list(samples[i].response_token_ids) for i in mine]
    batch = pack(prompts, responses, [masks[i] for i in mine], pad_id=pad_id).to(device)
    # Every rank knows the whole batch: the global counts need no collective either.
    counts = BatchCounts(tokens=total_tokens, sequences=len(samples),
                         width=max(len(t.response_token_ids) for t in samples))
    clock.lap("pack")
    logprobs, entropy = token_logprobs_and_entropy(model, batch, share_prompts=share_prompts)
    if supervised:
        demonstrations = CrossEntropyLoss(normalization=config.normalization, constant=config.constant)
        result = objective(demonstrations, logprobs, batch.response_mask.to(logprobs.dtype), batch.response_mask,
                           counts, entropy=entropy)
        clock.lap("forward")
        return StepLoss(result.loss, result.statistics, rewards, len(groups), len(samples), total_tokens)
    width = batch.input_ids.shape[1]
    behaviour = response_values([list(samples[i].behaviour_logprobs) for i in mine], prompts, width).to(device)
    critic_loss, token_values = None, {}
    if config.advantages == "gae":
        if critic is None:
            raise ValueError("advantages=gae needs the trainer's critic (rl.critic)")
        # One forward: its values before this step's update are the old ones.
        values = critic.values(batch)
        old_values = values.detach()
        token_adv, returns = gae(token_rewards([samples[i] for i in mine], batch), old_values, batch.response_mask,
                                 gamma=config.gamma, lam=config.lam)
        token_adv = masked_whiten(token_adv, batch.response_mask,
                                  total=whitening_totals(token_adv, batch.response_mask))
        critic_loss = value_loss(values, old_values, returns, batch.response_mask, clip=config.value_clip,
                                 total_tokens=total_tokens)
        # One transfer for the whole batch, not one per row.
        trained, values_here = batch.response_mask.cpu() > 0, old_values.cpu()
        token_values = {samples[i].trajectory_id: values_here[row][trained[row]].tolist()
                        for row, i in enumerate(mine)}
    else:
        advantages = compute_advantages(rewards, config.advantages).reshape(-1)
        token_adv = advantages[mine][:, None].to(device).expand_as(batch.response_mask)
    ref_logprobs = None
    if reference is not None:
        with torch.no_grad():
            ref_logprobs = reference(batch)
    result = objective(config, logprobs, token_adv, batch.response_mask, counts, behaviour_logprobs=behaviour,
                       ref_logprobs=ref_logprobs, entropy=entropy)
    clock.lap("forward")
    statistics = result.statistics | (critic_loss.statistics if critic_loss is not None else {})
    return StepLoss(result.loss, statistics, rewards, len(groups), len(samples), total_tokens, critic_loss,
                    token_values)


def is_supervised_step(groups: Sequence[Sequence[bus_pb2.Trajectory]]) -> bool:
    """Whether a step's groups are demonstrations; a step never mixes them with samples (the
    learner takes batches of one kind: rl.batching.GroupCollector.take)."""
    kinds = {t.supervised for group in groups for t in group}
    if len(kinds) > 1:
        raise ValueError("a step trains demonstrations or policy samples, not both")
    return kinds == {True}


def critic_directory(settings: CriticSettings, policy_path: Path) -> Path:
    """The critic's model: settings.model_path (a directory or a Hugging Face id in the cache), or the policy's."""
    if not settings.model_path:
        return policy_path
    from policyloop.models.resolve import resolve_model

    return resolve_model(settings.model_path, setting="critic.model_path")


class PolicyTrainer:
    def __init__(self, model_path: Path, config: TrainerConfig, version: int = 0) -> None:
        torch.set_num_threads(config.threads)
        self.config = config
        self.model_path = Path(model_path)
        self.mesh = init_distributed(config.device)
        self.on_cuda = self.mesh.device_type == "cuda"
        # Where the policy's parameters live: every tensor of a step is moved there.
        self.device = torch.device("cuda", torch.cuda.current_device()) if self.on_cuda else torch.device("cpu")
        self.model = load_policy(self.model_path, self.mesh)
        self.keys = weight_keys(self.model_path)
        # The KL penalty's reference: the base weights, frozen (only when the penalty is on).
        self.reference = load_reference(self.model_path).to(self.device) if config.loss.kl_coef > 0 else None
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=config.lr,
                                           weight_decay=config.weight_decay)
        # PPO's value model, trained beside the policy (only for GAE advantages).
        self.critic = Critic(critic_directory(config.critic, self.model_path), config.critic, self.mesh,
                             self.model.get_input_embeddings().weight.shape[0]) \
            if config.loss.advantages == "gae" else None
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, LrSchedule(config))
        self.version = version
        self.steps = 0
        pad = getattr(self.model.config, "pad_token_id", None)
        self.pad_id = int(pad) if pad is not None else 0
        self.limits = ModelLimits.of(self.model.config)

    @property
    def rank(self) -> int:
        return dist.get_rank()

    @property
    def world_size(self) -> int:
        return dist.get_world_size()

    def step(self, groups: Sequence[Sequence[bus_pb2.Trajectory]]) -> StepReport:
        """One GRPO update on complete groups; the policy version advances by one.

        With several ranks (torchrun), rank 0 calls this and the others run `follow`: the
        groups are broadcast, every rank trains on its share of the samples, and FSDP2 averages
        the gradients — the loss is scaled so that the result is the single-rank update."""
        if self.world_size > 1:
            if self.rank != 0:
                raise RuntimeError("only rank 0 leads steps; other ranks run follow()")
            dist.broadcast_object_list([[[t.SerializeToString() for t in g] for g in groups]], src=0)
        return self._step(groups)

    def follow(self) -> int:
        """Runs the steps rank 0 leads until it closes; returns the number of steps taken."""
        while True:
            box: list[object] = [None]
            dist.broadcast_object_list(box, src=0)
            if box[0] is None:
                return self.steps
            if box[0] == "export":
                self.export_tensors()
                continue
            if isinstance(box[0], tuple):  # ("save", root), ("restore", directory) or ("snapshot", "")
                command, path = box[0]
                if command == "snapshot":
                    self.snapshot()
                else:
                    self.save(Path(path)) if command == "save" else self.restore(Path(path))
                continue
            groups = [[bus_pb2.Trajectory.FromString(b) for b in g] for g in box[0]]  # type: ignore[union-attr]
            self._step(groups)

    def _step(self, groups: Sequence[Sequence[bus_pb2.Trajectory]]) -> StepReport:
        started = time.monotonic()
        clock = PhaseClock(torch.cuda.synchronize if self.on_cuda else lambda: None)
        share = self.config.share_prompts
        reference = None if self.reference is None else functools.partial(token_logprobs, self.reference,
                                                                             share_prompts=share)
        step_loss = grpo_loss(self.model, groups, self.config.loss, pad_id=self.pad_id, device=self.device,
                              rank=self.rank, world_size=self.world_size, reference=reference, clock=clock,
                              share_prompts=share, critic=self.critic)
        # FSDP2 averages gradients over ranks; scaling by the world size makes that the sum.
        (step_loss.loss * self.world_size).backward()
        clock.lap("backward")
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.max_grad_norm)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        clock.lap("optimizer")
        if self.critic is not None and step_loss.critic is not None:
            step_loss.statistics["critic_grad_norm"] = self.critic.step(step_loss.critic.loss, self.world_size)
            clock.lap("critic")
        self.steps += 1
        self.version += 1
        return step_loss.report(self.steps, grad_norm, time.monotonic() - started, clock.seconds)

    def export_tensors(self) -> dict[str, torch.Tensor]:
        """The full weights, with the base checkpoint's tensor names (empty on ranks other
        than 0). Gathering them is collective: rank 0 tells the other ranks to join."""
        if self.world_size > 1 and self.rank == 0:
            dist.broadcast_object_list(["export"], src=0)
        state = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self.rank != 0:
            return {}
        missing = [k for k in self.keys if k not in state]
        if missing:
            raise KeyError(f"the model has no tensors named {missing[:3]}")
        return {k: state[k].detach().contiguous().clone() for k in self.keys}

    def export_safetensors(self) -> bytes:
        """`export_tensors` as safetensors bytes (b"" on ranks other than 0)."""
        tensors = self.export_tensors()
        if not tensors:
            return b""
        return safetensors.torch.save(tensors, metadata={"policy_version": str(self.version)})

    def save(self, root: Path, trained_ids: Sequence[Sequence[str]] = (), extra: dict[str, Any] | None = None,
             keep: int = 2) -> Path:
        """Checkpoints this trainer at its version (see policyloop.rl.checkpoint). Collective:
        with several ranks, rank 0 calls it and tells the others to write their shards.
        `trained_ids`: the ids trained by the most recent steps, one list per step."""
        from policyloop.rl.checkpoint import save_checkpoint

        if self.world_size > 1 and self.rank == 0:
            dist.broadcast_object_list([("save", str(root))], src=0)
        return save_checkpoint(root, self.model, self.optimizer, self._state(trained_ids, extra), keep=keep,
                               critic=self._critic_pair())

    def snapshot(self, trained_ids: Sequence[Sequence[str]] = (), extra: dict[str, Any] | None = None
                 ) -> Snapshot | None:
        """A copy of this trainer's state at its version, for a checkpoint written off the step's
        path (policyloop.rl.checkpoint.write_snapshot). Collective like `save`; rank 0 gets it."""
        from policyloop.rl.checkpoint import take_snapshot

        if self.world_size > 1 and self.rank == 0:
            dist.broadcast_object_list([("snapshot", "")], src=0)
        return take_snapshot(self.model, self.optimizer, self._state(trained_ids, extra), critic=self._critic_pair())

    def _critic_pair(self) -> tuple[torch.nn.Module, torch.optim.Optimizer] | None:
        return None if self.critic is None else (self.critic.model, self.critic.optimizer)

    def _state(self, trained_ids: Sequence[Sequence[str]], extra: dict[str, Any] | None) -> TrainerState:
        from policyloop.rl.checkpoint import TrainerState

        return TrainerState(self.version, self.steps, [list(ids) for ids in trained_ids], dict(extra or {}),
                            scheduler={"last_epoch": self.scheduler.last_epoch})

    def restore(self, directory: Path) -> TrainerState:
        """Loads a checkpoint (saved on any number of ranks) into this trainer; collective like
        `save`. Returns what the checkpoint holds besides tensors."""
        from policyloop.rl.checkpoint import load_checkpoint

        if self.world_size > 1 and self.rank == 0:
            dist.broadcast_object_list([("restore", str(directory))], src=0)
        state = load_checkpoint(directory, self.model, self.optimizer, critic=self._critic_pair())
        self.version, self.steps = state.version, state.steps
        # The optimizer's param groups (their current lr) came back with it; the schedule goes on
        # from the saved position (older checkpoints: the steps taken, which it follows).
        self.scheduler.last_epoch = int(state.scheduler.get("last_epoch", self.steps))
        return state

    def close(self) -> None:
        if dist.is_initialized():
            if self.world_size > 1:
                if self.rank == 0:
                    dist.broadcast_object_list([None], src=0)  # followers return from follow()
                # Every rank is done sending before any tears its group down: gloo aborts the
                # process ("terminate called without an active exception") when a peer destroys
                # the group under a send still in flight.
                dist.barrier()
            dist.destroy_process_group()
