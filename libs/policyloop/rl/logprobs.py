"""Log-probabilities of response tokens under a causal LM, the way the learner recomputes them.

Sequences are right-padded prompt+response rows: no position shifts are needed, so the
numbers match an unpadded forward pass (the engine's behaviour logprobs are checked against
this function).

With `share_prompts`, rows that share a prompt (a GRPO group's samples do) compute it once: one
forward over the distinct prompts (left-padded, explicit positions) keeps their KV cache, each row
takes its prompt's cache (an index: gradients flow back to the prompt's single computation) and a
second forward runs the responses alone. The figures are those of the plain forward up to float
rounding, in the same [B, T-1] layout; what it saves is the prompt's share of the tokens, times
the group size less one (perf/learner_alone.py against --plain measures it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from transformers import DynamicCache


@dataclass
class PackedBatch:
    input_ids: torch.Tensor       # [B, T] prompt + response, right-padded
    attention_mask: torch.Tensor  # [B, T] 1 on real tokens
    response_mask: torch.Tensor   # [B, T-1] 1 where the *next* token is a trained response token
    targets: torch.Tensor         # [B, T-1] the next token at each position
    prompt_lengths: torch.Tensor  # [B] tokens of each row's prompt (its response starts there)

    def to(self, device: torch.device) -> PackedBatch:
        """The batch on `device` (the model's: the learner packs on the CPU)."""
        return PackedBatch(self.input_ids.to(device), self.attention_mask.to(device),
                           self.response_mask.to(device), self.targets.to(device), self.prompt_lengths.to(device))


def pack(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]],
         loss_masks: Sequence[Sequence[bool]] | None = None, pad_id: int = 0) -> PackedBatch:
    if len(prompts) != len(responses):
        raise ValueError("one response per prompt")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("a prompt needs at least one token")
    if loss_masks is not None and any(len(m) != len(r) for m, r in zip(loss_masks, responses, strict=True)):
        raise ValueError("one loss_mask value per response token")
    rows = [[*p, *r] for p, r in zip(prompts, responses, strict=True)]
    width = max(len(r) for r in rows)
    # Rows are padded as lists and made tensors once: a tensor per row cost more than the rest.
    input_ids = torch.tensor([row + [pad_id] * (width - len(row)) for row in rows], dtype=torch.long)
    attention = torch.tensor([[1] * len(row) + [0] * (width - len(row)) for row in rows], dtype=torch.long)
    # Position t predicts token t+1: response token j sits at len(prompt)+j.
    masks = ([1.0] * len(r) for r in responses) if loss_masks is None else \
        ([float(m) for m in mask] for mask in loss_masks)
    response_mask = torch.tensor([[0.0] * (len(p) - 1) + mask + [0.0] * (width - len(row))
                                  for p, mask, row in zip(prompts, masks, rows, strict=True)], dtype=torch.float32)
    lengths = torch.tensor([len(p) for p in prompts], dtype=torch.long)
    return PackedBatch(input_ids, attention, response_mask, input_ids[:, 1:].clone(), lengths)


def token_logprobs(model: torch.nn.Module, batch: PackedBatch, *, share_prompts: bool = False) -> torch.Tensor:
    """[B, T-1] log-probability of each next token (meaningful where response_mask is 1; with
    `share_prompts`, only there: the prompt's own positions are 0)."""
    return _logprobs(model, batch, share_prompts, entropy=False)[0]


def token_logprobs_and_entropy(model: torch.nn.Module, batch: PackedBatch, *, share_prompts: bool = False
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """`token_logprobs` plus each position's entropy of the next-token distribution (no
    gradient: it is reported, not optimised)."""
    logprobs, entropy = _logprobs(model, batch, share_prompts, entropy=True)
    assert entropy is not None
    return logprobs, entropy


def _logprobs(model: torch.nn.Module, batch: PackedBatch, share_prompts: bool, entropy: bool
              ) -> tuple[torch.Tensor, torch.Tensor | None]:
    if share_prompts:
        shared = _shared_prompt_logprobs(model, batch, entropy)
        if shared is not None:
            return shared
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    return _chosen_and_entropy(logits[:, :-1], batch.targets, entropy)


def _chosen_and_entropy(logits: torch.Tensor, targets: torch.Tensor, entropy: bool
                        ) -> tuple[torch.Tensor, torch.Tensor | None]:
    logps = torch.log_softmax(logits.float(), dim=-1)
    chosen = torch.gather(logps, 2, targets.unsqueeze(-1)).squeeze(-1)
    if not entropy:
        return chosen, None
    with torch.no_grad():
        return chosen, -(logps.exp() * logps).sum(dim=-1)


def distinct_prompts(batch: PackedBatch) -> tuple[list[list[int]], list[int]]:
    """The batch's distinct prompts (in order of first use) and the index of each row's."""
    index: dict[tuple[int, ...], int] = {}
    owners = []
    for row, length in zip(batch.input_ids.tolist(), batch.prompt_lengths.tolist(), strict=True):
        owners.append(index.setdefault(tuple(row[:length]), len(index)))
    return [list(prompt) for prompt in index], owners


def _shared_prompt_logprobs(model: torch.nn.Module, batch: PackedBatch, entropy: bool
                            ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """The figures of `_logprobs` with each distinct prompt computed once; None when no two rows
    share a prompt or no row has a response (nothing to save)."""
    prompts, owners = distinct_prompts(batch)
    rows, width = batch.input_ids.shape
    response_lengths = (batch.attention_mask.sum(dim=1) - batch.prompt_lengths).tolist()
    if len(prompts) == rows or max(response_lengths, default=0) == 0:
        return None
    device = batch.input_ids.device
    owner = torch.tensor(owners, dtype=torch.long, device=device)
    prompt_ids, prompt_mask, prompt_positions = (t.to(device) for t in left_padded(prompts, pad_id=0))
    # Left padding puts every prompt's last token in the last column: its logits predict the
    # response's first token.
    out = model(input_ids=prompt_ids, attention_mask=prompt_mask, position_ids=prompt_positions, use_cache=True,
                logits_to_keep=1)
    layers = [(layer.keys, layer.values) for layer in out.past_key_values.layers]
    prefix = Prefix(out.logits[:, -1], prompt_mask, layers)
    placed: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]] = []
    for bucket in length_buckets(response_lengths):
        index = torch.tensor(bucket, dtype=torch.long, device=device)
        placed.append(_responses_on_prefix(model, batch, prefix, index, owner[index], entropy))
    at = (torch.cat([p[0] for p in placed]), torch.cat([p[1] for p in placed]))
    values = torch.cat([p[2] for p in placed])
    chosen = values.new_zeros((rows, width - 1)).index_put(at, values)
    if not entropy:
        return chosen, None
    entropies = torch.cat([p[3] for p in placed])  # type: ignore[misc]
    return chosen, entropies.new_zeros((rows, width - 1)).index_put(at, entropies)


@dataclass
class Prefix:
    """The distinct prompts' forward: each one's next-token logits, its mask and its KV cache."""

    last_logits: torch.Tensor                          # [G, V]
    mask: torch.Tensor                                 # [G, P] left-padded
    layers: list[tuple[torch.Tensor, torch.Tensor]]    # per layer: keys, values [G, heads, P, dim]

    def cache_of(self, owner: torch.Tensor) -> DynamicCache:
        """A cache holding each row's prompt (an index: gradients flow back to the prompt's forward)."""
        from transformers import DynamicCache

        cache = DynamicCache()
        for layer, (keys, values) in enumerate(self.layers):
            cache.update(keys[owner], values[owner], layer)
        return cache


def _responses_on_prefix(model: torch.nn.Module, batch: PackedBatch, prefix: Prefix, rows: torch.Tensor,
                         owner: torch.Tensor, entropy: bool
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Log-probs (and entropies) of the response tokens of `rows`, computed on their prompts'
    cache; returned with their [B, T-1] positions (row, column)."""
    lengths = batch.prompt_lengths[rows]
    response_lengths = batch.attention_mask[rows].sum(dim=1) - lengths
    longest = int(response_lengths.max())
    if longest == 0:  # nothing to predict: no position of these rows is a response token
        nothing = torch.zeros(0, dtype=torch.long, device=rows.device)
        empty = prefix.last_logits.new_zeros(0)
        return nothing, nothing, empty, None if not entropy else empty
    steps = torch.arange(longest, device=rows.device)
    present = steps[None, :] < response_lengths[:, None]                        # [b, R]
    columns = (lengths[:, None] + steps[None, :]).clamp(max=batch.input_ids.shape[1] - 1)
    responses = torch.where(present, batch.input_ids[rows].gather(1, columns), 0)  # [b, R]
    logits = prefix.last_logits[owner].unsqueeze(1)                               # [b, 1, V]
    if longest > 1:
        # Response token j (a real one, j < R-1) predicts token j+1; the last one predicts nothing.
        mask = torch.cat([prefix.mask[owner], present[:, :-1].long()], dim=1)
        positions = lengths[:, None] + steps[None, :-1]
        following = model(input_ids=responses[:, :-1], attention_mask=mask, position_ids=positions,
                          past_key_values=prefix.cache_of(owner), use_cache=True).logits
        logits = torch.cat([logits, following], dim=1)                            # [b, R, V]
    chosen, entropies = _chosen_and_entropy(logits, responses, entropy)
    # Response token j of row b sits at column prompt_length - 1 + j of the plain layout.
    row_index, step_index = present.nonzero(as_tuple=True)
    return (rows[row_index], lengths[row_index] - 1 + step_index, chosen[row_index, step_index],
            None if entropies is None else entropies[row_index, step_index])


def length_buckets(response_lengths: Sequence[int], forward_cost_tokens: int = 64) -> list[list[int]]:
    """Row indices in one bucket, or two — the responses up to some length L and the longer ones —
    when padding every response to the batch's longest would compute more tokens than a second
    forward costs (`forward_cost_tokens`: its fixed cost, in tokens). A few long responses (the
    length limit) in a batch of short ones then cost their own length, not everyone's."""
    rows = list(range(len(response_lengths)))
    longest = max(response_lengths, default=0)
    best_cost, best_limit = len(rows) * longest, longest
    for limit in sorted(set(response_lengths)):
        if limit >= longest:
            break
        short = sum(1 for n in response_lengths if n <= limit)
        cost = short * limit + (len(rows) - short) * longest + forward_cost_tokens
        if cost < best_cost:
            best_cost, best_limit = cost, limit
    if best_limit == longest:
        return [rows]
    return [[i for i in rows if response_lengths[i] <= best_limit],
            [i for i in rows if response_lengths[i] > best_limit]]


def left_padded(rows: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token rows as one batch: ids left-padded to the longest row, the attention mask and
    explicit position ids (0 at each row's first real token), so padding changes no row's logits."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row):] = torch.tensor(list(row), dtype=torch.long)
        mask[i, width - len(row):] = 1
    return ids, mask, (mask.cumsum(1) - 1).clamp_(min=0)


def response_values(values: Sequence[Sequence[float]], prompts: Sequence[Sequence[int]], width: int) -> torch.Tensor:
    """Places per-response-token values (e.g. behaviour logprobs) at their [B, T-1] positions."""
    return torch.tensor([[0.0] * (len(p) - 1) + list(v) + [0.0] * (width - len(p) - len(v))
                         for v, p in zip(values, prompts, strict=True)], dtype=torch.float32)
