"""PPO's value model: a value head on a causal LM's backbone (a copy of the policy, or a separate
model chosen by settings), trained by the learner in the same step as the policy with a clipped
value loss, and the per-token rewards and GAE advantages its values give (rl.advantages.gae).

Values sit in the learner's [rows, tokens - 1] layout (rl.logprobs.pack): column c holds V of the
state after c + 1 tokens, the one from which the token at c + 1 is chosen, so a response token's
value sits where its log-probability does."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard

from policyloop.contracts.v1 import bus_pb2
from policyloop.rl.logprobs import PackedBatch
from policyloop.rl.objective import LossStatistics
from policyloop.rl.settings import CriticSettings


def load_value_model(model_path: Path, mesh: DeviceMesh, vocab_size: int) -> torch.nn.Module:
    """A one-label token-classification model on `model_path`'s backbone, its head zero (every
    value starts at 0) and without dropout (a value is a function of the tokens), sharded like the
    policy."""
    import transformers
    from transformers import AutoConfig, AutoModelForTokenClassification

    config = AutoConfig.from_pretrained(model_path, num_labels=1)
    config.classifier_dropout = 0.0
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # "newly initialized: score": the value head, on purpose
    try:
        model = AutoModelForTokenClassification.from_pretrained(model_path, config=config, dtype=torch.float32)
    finally:
        transformers.logging.set_verbosity(verbosity)
    embeddings = model.get_input_embeddings().weight.shape[0]
    if embeddings < vocab_size:
        raise ValueError(f"the critic's vocabulary ({embeddings} tokens, {model_path}) does not cover the "
                         f"policy's ({vocab_size})")
    for module in model.modules():  # whatever the config's names for it: a value has no dropout
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    head = model.score
    torch.nn.init.zeros_(head.weight)
    if head.bias is not None:
        torch.nn.init.zeros_(head.bias)
    if mesh.size() == 1:
        model.to(mesh.device_type)
    else:
        for layer in getattr(getattr(model, "model", None), "layers", None) or []:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    model.train()
    return model


@dataclass(frozen=True)
class ValueLoss:
    loss: torch.Tensor           # this shard's share of the batch's value loss, with gradient
    statistics: LossStatistics


class Critic:
    def __init__(self, model_path: Path, settings: CriticSettings, mesh: DeviceMesh, vocab_size: int) -> None:
        self.settings = settings
        self.model = load_value_model(model_path, mesh, vocab_size)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=settings.lr,
                                           weight_decay=settings.weight_decay)

    def values(self, batch: PackedBatch) -> torch.Tensor:
        """[rows, tokens - 1] values (with gradient in grad mode)."""
        logits = self.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        return logits[:, :-1, 0].float()

    def step(self, loss: torch.Tensor, world_size: int) -> float:
        """Backward, clip, optimizer step; returns the gradient norm."""
        (loss * world_size).backward()  # FSDP2 averages over ranks: the sum is the single-rank gradient
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.settings.max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)


def value_loss(new: torch.Tensor, old: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor, *,
               clip: float, total_tokens: float) -> ValueLoss:
    """½ max((V − R)², (V_clipped − R)²) per trained token, V_clipped within `clip` of the old
    value (PPO's clipped value loss; clip 0: unclipped), over the whole batch's trained tokens."""
    maskf = mask.to(new.dtype)
    error = (new - returns).square()
    if clip > 0:
        clipped = old + (new - old).clamp(-clip, clip)
        clipped_error = (clipped - returns).square()
        chosen = torch.maximum(error, clipped_error)
        clipped_share = ((clipped_error > error) & (maskf > 0)).sum()
    else:
        chosen, clipped_share = error, torch.zeros(())
    loss = 0.5 * (chosen * maskf).sum() / max(total_tokens, 1.0)
    with torch.no_grad():
        tokens = maskf.sum().clamp(min=1.0)
        residual = (returns - old) * maskf
        returns_mean = (returns * maskf).sum() / tokens
        returns_var = ((returns - returns_mean).square() * maskf).sum() / tokens
        residual_var = ((residual - residual.sum() / tokens).square() * maskf).sum() / tokens
        statistics = {
            "value_loss": float(loss), "value_clip_fraction": float(clipped_share / tokens),
            "values_mean": float((old * maskf).sum() / tokens), "returns_mean": float(returns_mean),
            # How much of the returns' variance the values explain (1: all; ≤ 0: none).
            "explained_variance": float(1 - residual_var / returns_var) if float(returns_var) > 0 else 0.0,
        }
    return ValueLoss(loss, statistics)


def token_rewards(samples: Sequence[bus_pb2.Trajectory], batch: PackedBatch) -> torch.Tensor:
    """Each sample's reward on its trained tokens ([rows, tokens - 1], like `batch.response_mask`):
    a multi-turn episode's step rewards (Turn.reward) on the last trained token of their model
    turns, and what the reward holds beyond them on the row's last trained token."""
    rewards = torch.zeros_like(batch.response_mask, dtype=torch.float32, device="cpu")
    mask = batch.response_mask.cpu() > 0
    for row, traj in enumerate(samples):
        start = int(batch.prompt_lengths[row]) - 1  # the column of response token 0
        trained = mask[row].nonzero().flatten()
        if not len(trained):
            continue
        placed = 0.0
        for turn in traj.turns:
            if turn.role != bus_pb2.Turn.ROLE_MODEL or not turn.reward:
                continue
            columns = trained[(trained >= start + turn.start) & (trained < start + turn.end)]
            if len(columns):
                rewards[row, columns[-1]] += turn.reward
                placed += turn.reward
        rewards[row, trained[-1]] += traj.reward - placed
    return rewards.to(batch.response_mask.device)


def whitening_totals(advantages: torch.Tensor, mask: torch.Tensor) -> tuple[float, float, float]:
    """(count, sum, sum of squares) of the masked advantages over every rank's share."""
    maskf = mask.to(advantages.dtype)
    local = torch.stack([maskf.sum(), (advantages * maskf).sum(), (advantages.square() * maskf).sum()]).double()
    if dist.is_initialized() and dist.get_world_size() > 1:
        local = local.to(advantages.device)
        dist.all_reduce(local)
    count, first, second = (float(v) for v in local)
    return count, first, second
