"""The embedded engine's sampling, as pure functions: truncation, seeding, finish rules."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from policyloop.engines.embedded.sampling import draw, finish_after, request_generator, sample_rows
from policyloop.engines.protocol import SamplingParams


def _logprobs(seed: int, vocab: int = 32) -> torch.Tensor:
    return torch.log_softmax(torch.randn(vocab, generator=torch.Generator().manual_seed(seed)), dim=-1)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31), top_k=st.integers(1, 32), draw_seed=st.integers(0, 2**31))
def test_a_token_outside_the_top_k_is_never_drawn(seed: int, top_k: int, draw_seed: int) -> None:
    logprobs = _logprobs(seed)
    allowed = set(torch.sort(logprobs, descending=True, stable=True).indices[:top_k].tolist())
    token = draw(logprobs, top_k, 1.0, torch.Generator().manual_seed(draw_seed))
    assert token in allowed


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31), top_p=st.floats(0.01, 1.0), draw_seed=st.integers(0, 2**31))
def test_top_p_keeps_the_smallest_prefix_reaching_p(seed: int, top_p: float, draw_seed: int) -> None:
    logprobs = _logprobs(seed)
    probs, ids = torch.sort(logprobs.double().exp(), descending=True, stable=True)
    before = probs.cumsum(0) - probs  # mass of the tokens ranked above each one
    allowed = set(ids[before < top_p].tolist()) | {int(ids[0])}
    assert draw(logprobs, -1, top_p, torch.Generator().manual_seed(draw_seed)) in allowed


def test_top_k_1_and_a_tiny_top_p_are_greedy() -> None:
    logprobs = _logprobs(3)
    best = int(torch.argmax(logprobs))
    for generator_seed in range(20):
        assert draw(logprobs, 1, 1.0, torch.Generator().manual_seed(generator_seed)) == best
        assert draw(logprobs, -1, 1e-9, torch.Generator().manual_seed(generator_seed)) == best


def test_a_seeded_request_draws_the_same_tokens_whatever_shares_its_wave() -> None:
    params = SamplingParams(temperature=0.8, sampling_seed=7)
    other = SamplingParams(temperature=1.3, top_k=5)
    logits = torch.randn(3, 32, generator=torch.Generator().manual_seed(1))
    alone = [sample_rows(logits[:1], [params], [g])[0] for g in [request_generator(params)]]
    in_wave = sample_rows(logits, [params, other, SamplingParams(temperature=0.0)],
                          [request_generator(params), request_generator(other), None])
    assert in_wave[0] == alone[0]
    assert in_wave[2][0] == int(torch.argmax(logits[2]))  # greedy row
    # The logprob is the row's log_softmax at its temperature, before truncation.
    expected = torch.log_softmax(logits[1] / 1.3, dim=-1)[in_wave[1][0]]
    assert abs(in_wave[1][1] - float(expected)) < 1e-6


def test_length_is_checked_before_a_stop_token_and_ignore_eos_turns_every_stop_off() -> None:
    params = SamplingParams(stop_token_ids=(5,))
    assert finish_after(5, 4, 4, params, frozenset({2})).type == "length"
    stop = finish_after(5, 3, 4, params, frozenset({2}))
    assert stop.type == "stop" and stop.matched == 5
    assert finish_after(2, 3, 4, params, frozenset({2})).type == "stop"
    ignoring = SamplingParams(stop_token_ids=(5,), ignore_eos=True)
    assert finish_after(5, 3, 4, ignoring, frozenset({2})) is None
    assert finish_after(2, 3, 4, ignoring, frozenset({2})) is None
    assert finish_after(9, 3, 4, params, frozenset({2})) is None


@given(seed=st.integers(0, 2**31), rows=st.integers(1, 12))
def test_rows_drawn_together_take_the_tokens_each_would_draw_alone(seed: int, rows: int) -> None:
    """The vectorised draw of untruncated rows is `draw` row by row: same uniform number from the
    row's generator, same token (and greedy rows stay argmax)."""
    logits = torch.randn(rows, 40, generator=torch.Generator().manual_seed(seed)) * 3
    params = [SamplingParams(temperature=[0.0, 0.7, 1.0, 1.6][i % 4], sampling_seed=seed + i) for i in range(rows)]
    together = sample_rows(logits, params, [request_generator(p) for p in params])
    for i, p in enumerate(params):
        if p.temperature == 0:
            assert together[i][0] == int(torch.argmax(logits[i]))
            continue
        logprobs = torch.log_softmax(logits[i] / p.temperature, dim=-1)
        alone = draw(logprobs, -1, 1.0, request_generator(p))
        assert together[i][0] == alone
        assert abs(together[i][1] - float(logprobs[alone])) < 1e-6
