"""Log-probabilities of response tokens under a causal LM, the way the learner recomputes them.

Sequences are right-padded prompt+response rows: no position shifts are needed, so the
numbers match an unpadded forward pass (the engine's behaviour logprobs are checked against
this function)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass
class PackedBatch:
    input_ids: torch.Tensor       # [B, T] prompt + response, right-padded
    attention_mask: torch.Tensor  # [B, T] 1 on real tokens
    response_mask: torch.Tensor   # [B, T-1] 1 where the *next* token is a trained response token
    targets: torch.Tensor         # [B, T-1] the next token at each position

    def to(self, device: torch.device) -> PackedBatch:
        """The batch on `device` (the model's: the learner packs on the CPU)."""
        return PackedBatch(self.input_ids.to(device), self.attention_mask.to(device),
                           self.response_mask.to(device), self.targets.to(device))


def pack(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]],
         loss_masks: Sequence[Sequence[bool]] | None = None, pad_id: int = 0) -> PackedBatch:
    if len(prompts) != len(responses):
        raise ValueError("one response per prompt")
    rows = [list(p) + list(r) for p, r in zip(prompts, responses, strict=True)]
    width = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    response_mask = torch.zeros((len(rows), width - 1), dtype=torch.float32)
    for i, (prompt, response) in enumerate(zip(prompts, responses, strict=True)):
        row = rows[i]
        input_ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
        attention[i, : len(row)] = 1
        if not prompt:
            raise ValueError("a prompt needs at least one token")
        # Position t predicts token t+1: response token j sits at len(prompt)+j.
        start = len(prompt) - 1
        trained = [1.0] * len(response) if loss_masks is None else [float(m) for m in loss_masks[i]]
        response_mask[i, start : start + len(response)] = torch.tensor(trained)
    return PackedBatch(input_ids, attention, response_mask, input_ids[:, 1:].clone())


def token_logprobs(model: torch.nn.Module, batch: PackedBatch) -> torch.Tensor:
    """[B, T-1] log-probability of each next token (meaningful where response_mask is 1)."""
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    logps = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    return torch.gather(logps, 2, batch.targets.unsqueeze(-1)).squeeze(-1)


def token_logprobs_and_entropy(model: torch.nn.Module, batch: PackedBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """`token_logprobs` plus each position's entropy of the next-token distribution (no
    gradient: it is reported, not optimised)."""
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    logps = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    with torch.no_grad():
        entropy = -(logps.exp() * logps).sum(dim=-1)
    return torch.gather(logps, 2, batch.targets.unsqueeze(-1)).squeeze(-1), entropy


def response_values(values: Sequence[Sequence[float]], prompts: Sequence[Sequence[int]], width: int) -> torch.Tensor:
    """Places per-response-token values (e.g. behaviour logprobs) at their [B, T-1] positions."""
    out = torch.zeros((len(values), width - 1), dtype=torch.float32)
    for i, (vals, prompt) in enumerate(zip(values, prompts, strict=True)):
        start = len(prompt) - 1
        out[i, start : start + len(vals)] = torch.tensor(list(vals), dtype=torch.float32)
    return out
