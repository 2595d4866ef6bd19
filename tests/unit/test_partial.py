"""Partial rollouts: joining the pieces of a request cut short by weight updates."""

from __future__ import annotations

from policyloop.engines.partial import SEED_STRIDE, join, resubmission
from policyloop.engines.protocol import FinishReason, GenerateRequest, GenerateResult, SamplingParams, WeightVersionSpan


def piece(ids: list[int], version: str, finish: str, spans: list[tuple[str, int, int]] | None = None
          ) -> GenerateResult:
    return GenerateResult(
        rid="r", output_ids=ids, output_logprobs=[-0.5 - i for i in ids], finish_reason=finish,  # type: ignore[arg-type]
        weight_version=version, prompt_tokens=3, completion_tokens=len(ids),
        finish_detail=FinishReason(finish), weight_versions=None if spans is None else [  # type: ignore[arg-type]
            WeightVersionSpan(v, a, b) for v, a, b in spans])


REQUEST = GenerateRequest(input_ids=[1, 2, 3], rid="t/0",
                          sampling_params=SamplingParams(max_new_tokens=10, sampling_seed=7))


def test_join_puts_tokens_logprobs_and_spans_end_to_end() -> None:
    first = piece([5, 6, 7], "3", "abort", spans=[("2", 0, 1), ("3", 1, 3)])
    second = piece([8, 9], "3", "abort")          # no spans reported: one span of its version
    third = piece([10], "4", "stop")
    joined = join(REQUEST, [first, second, third])
    assert joined.output_ids == [5, 6, 7, 8, 9, 10]
    assert joined.output_logprobs == [-5.5, -6.5, -7.5, -8.5, -9.5, -10.5]
    assert [(s.version, s.start, s.end) for s in joined.weight_versions or []] == [
        ("2", 0, 1), ("3", 1, 5), ("4", 5, 6)]  # the two version-3 spans merged
    assert joined.finish_reason == "stop" and joined.weight_version == "4" and joined.rid == "t/0"
    assert joined.prompt_tokens == 3 and joined.completion_tokens == 6


def test_an_empty_aborted_piece_adds_nothing() -> None:
    joined = join(REQUEST, [piece([], "1", "abort"), piece([4, 5], "2", "length")])
    assert joined.output_ids == [4, 5] and [(s.version, s.start, s.end) for s in joined.weight_versions or []] == [
        ("2", 0, 2)]


def test_resubmission_continues_with_the_rest_of_the_budget() -> None:
    follow_up = resubmission(REQUEST, [5, 6, 7], attempt=1)
    assert follow_up is not None
    assert follow_up.input_ids == [1, 2, 3, 5, 6, 7] and follow_up.rid == "t/0+1"
    assert follow_up.sampling_params.max_new_tokens == 7
    assert follow_up.sampling_params.sampling_seed == 7 + SEED_STRIDE  # not the same random draws again
    assert resubmission(REQUEST, list(range(10)), attempt=2) is None  # nothing left to generate
    unseeded = GenerateRequest(input_ids=[1], sampling_params=SamplingParams(max_new_tokens=None))
    again = resubmission(unseeded, [4], attempt=1)
    assert again is not None and again.sampling_params.sampling_seed is None and again.rid is None
