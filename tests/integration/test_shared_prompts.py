"""The learner's shared-prompt forward (each distinct prompt computed once, its KV cache indexed
by the rows that share it) gives the plain forward's log-probabilities, entropies and gradients."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from policyloop.rl.logprobs import (
    distinct_prompts,
    length_buckets,
    pack,
    token_logprobs,
    token_logprobs_and_entropy,
)


@pytest.fixture(scope="module")
def model(tiny_model_dir: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).train()


def groups(seed: int, count: int, size: int, prompt_lengths: list[int], response_lengths: list[int]
           ) -> tuple[list[list[int]], list[list[int]], list[list[bool]]]:
    """`count` groups of `size` rows sharing a prompt each (lengths drawn from the lists), some
    response tokens masked out as a tool's are."""
    rng = random.Random(seed)
    prompts, responses, masks = [], [], []
    for _ in range(count):
        prompt = [rng.randrange(4, 20) for _ in range(rng.choice(prompt_lengths))]
        for _ in range(size):
            response = [rng.randrange(4, 20) for _ in range(rng.choice(response_lengths))]
            prompts.append(prompt)
            responses.append(response)
            masks.append([rng.random() > 0.2 for _ in response])
    return prompts, responses, masks


def loss_and_grads(model: torch.nn.Module, batch, share: bool  # type: ignore[no-untyped-def]
                   ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    logprobs, entropy = token_logprobs_and_entropy(model, batch, share_prompts=share)
    weights = torch.linspace(-1.0, 1.0, logprobs.numel()).reshape(logprobs.shape)  # any loss of the values
    (logprobs * batch.response_mask * weights).sum().backward()
    return logprobs.detach(), entropy, [p.grad.clone() for p in model.parameters() if p.grad is not None]


def assert_same_figures(model: torch.nn.Module, prompts: list[list[int]], responses: list[list[int]],
                        masks: list[list[bool]]) -> None:
    batch = pack(prompts, responses, masks)
    plain, plain_entropy, plain_grads = loss_and_grads(model, batch, share=False)
    shared, shared_entropy, shared_grads = loss_and_grads(model, batch, share=True)
    at = batch.response_mask > 0
    torch.testing.assert_close(shared[at], plain[at], rtol=1e-4, atol=1e-5)
    present = torch.zeros_like(at)
    for i, (prompt, response) in enumerate(zip(prompts, responses, strict=True)):
        present[i, len(prompt) - 1 : len(prompt) - 1 + len(response)] = True
    torch.testing.assert_close(shared_entropy[present], plain_entropy[present], rtol=1e-4, atol=1e-5)
    assert len(shared_grads) == len(plain_grads)
    for got, want in zip(shared_grads, plain_grads, strict=True):
        assert torch.isfinite(got).all()
        # Float rounding differs between the two orders of summation: compare each tensor whole. A
        # tensor the loss does not reach (a gradient of exactly 0 one way) gets rounding noise the
        # other way (~3e-6 seen): the absolute floor is the losses' own (1e-5).
        assert float((got - want).norm()) <= 1e-4 * float(want.norm()) + 1e-5


def test_groups_with_prompts_of_several_lengths_give_the_plain_figures(model: torch.nn.Module) -> None:
    prompts, responses, masks = groups(0, count=6, size=4, prompt_lengths=[2, 5, 9], response_lengths=[1, 3, 7])
    assert len(distinct_prompts(pack(prompts, responses))[0]) == 6
    assert_same_figures(model, prompts, responses, masks)


def test_rows_without_a_response_and_single_token_responses(model: torch.nn.Module) -> None:
    prompts, responses, masks = groups(1, count=3, size=3, prompt_lengths=[3, 4], response_lengths=[0, 1])
    responses[0] = [7]  # at least one token somewhere
    masks[0] = [True]
    assert_same_figures(model, prompts, responses, masks)


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 10_000), count=st.integers(1, 4), size=st.integers(1, 4))
def test_any_batch_of_groups_gives_the_plain_figures(model: torch.nn.Module, seed: int, count: int,
                                                      size: int) -> None:
    prompts, responses, masks = groups(seed, count, size, prompt_lengths=[1, 2, 6], response_lengths=[1, 2, 5])
    assert_same_figures(model, prompts, responses, masks)


def test_distinct_prompts_fall_back_to_the_plain_forward(model: torch.nn.Module) -> None:
    batch = pack([[4, 5], [6, 7, 8]], [[9, 10], [11]])
    assert distinct_prompts(batch) == ([[4, 5], [6, 7, 8]], [0, 1])
    with torch.no_grad():
        torch.testing.assert_close(token_logprobs(model, batch, share_prompts=True), token_logprobs(model, batch))


def test_a_few_long_responses_among_short_ones_run_apart_with_the_same_figures(model: torch.nn.Module) -> None:
    prompts, responses, masks = groups(2, count=8, size=8, prompt_lengths=[3, 6], response_lengths=[2, 3])
    for i in (5, 40):  # two samples ran to the length limit
        responses[i] = responses[i] + [9] * (12 - len(responses[i]))
        masks[i] = [True] * 12
    lengths = [len(r) for r in responses]
    short, long = length_buckets(lengths)
    assert long == [5, 40] and sorted(short + long) == list(range(64))
    assert_same_figures(model, prompts, responses, masks)


def test_length_buckets_split_only_where_padding_costs_more_than_a_forward() -> None:
    assert length_buckets([3] * 100 + [8]) == [list(range(100)), [100]]
    assert length_buckets([3, 3, 8, 8]) == [[0, 1, 2, 3]]          # 2 rows × 5 tokens < a forward's cost
    assert length_buckets([4] * 50) == [list(range(50))]
    assert length_buckets([0] * 80 + [2] * 80 + [6] * 80) == [list(range(160)), list(range(160, 240))]
    assert length_buckets([]) == [[]]


def test_pack_refuses_an_empty_prompt_and_a_loss_mask_of_another_length() -> None:
    with pytest.raises(ValueError, match="a prompt needs at least one token"):
        pack([[4, 5], []], [[6], [7]])
    with pytest.raises(ValueError, match="one loss_mask value per response token"):
        pack([[4, 5]], [[6, 7]], [[True]])
