"""Partial rollouts: a request the engine ends early for a weight update goes on where it stopped.

With pause mode `abort` (or `abort_all_requests`), SGLang answers every request in flight with
finish_reason abort and the tokens it has. `generate_resumable` then sends prompt + those tokens
again with the rest of the token budget, under a new rid (SGLang refuses a rid in flight) and,
when seeded, a new seed (the same one would replay the same random draws); it joins the pieces
into one result whose `weight_versions` spans say which version made every token. The learner
sees one sample whose tokens came from two (or more) versions, exactly as with an in-place
update, and corrects for it like any off-policy token.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from policyloop.engines.protocol import GenerateRequest, GenerateResult, WeightVersionSpan

if TYPE_CHECKING:
    from policyloop.engines.sglang_client import SGLangClient

SEED_STRIDE = 1_000_003  # a resubmission's seed: seed + k × stride (a different random stream)


@dataclass(frozen=True)
class Completion:
    result: GenerateResult   # the pieces joined
    resubmits: int           # how many times the request was sent again


def piece_spans(piece: GenerateResult) -> list[WeightVersionSpan]:
    """The version spans of one answer (one span of its weight_version when none are reported)."""
    if piece.weight_versions:
        return [s for s in piece.weight_versions if s.end > s.start]
    n = len(piece.output_ids)
    return [WeightVersionSpan(piece.weight_version, 0, n)] if n else []


def join(request: GenerateRequest, pieces: list[GenerateResult]) -> GenerateResult:
    """One result from consecutive answers: tokens, logprobs and spans end to end (adjacent spans
    of one version merged); the finish reason and served version of the last."""
    output_ids: list[int] = []
    logprobs: list[float] | None = []
    spans: list[WeightVersionSpan] = []
    for piece in pieces:
        offset = len(output_ids)
        for span in piece_spans(piece):
            start, end = span.start + offset, span.end + offset
            if spans and spans[-1].version == span.version and spans[-1].end == start:
                spans[-1] = WeightVersionSpan(span.version, spans[-1].start, end)
            else:
                spans.append(WeightVersionSpan(span.version, start, end))
        output_ids.extend(piece.output_ids)
        if logprobs is not None and piece.output_logprobs is not None:
            logprobs.extend(piece.output_logprobs)
        else:
            logprobs = None
    last = pieces[-1]
    return GenerateResult(
        rid=request.rid or last.rid, output_ids=output_ids, output_logprobs=logprobs,
        finish_reason=last.finish_reason, finish_detail=last.finish_detail, weight_version=last.weight_version,
        prompt_tokens=len(request.input_ids or []), completion_tokens=len(output_ids),
        weight_versions=spans or [WeightVersionSpan(last.weight_version, 0, 0)],
    )


def resubmission(request: GenerateRequest, produced: list[int], attempt: int) -> GenerateRequest | None:
    """The request that continues `request` after `produced` tokens (None: the budget is spent)."""
    params = request.sampling_params
    remaining = None if params.max_new_tokens is None else params.max_new_tokens - len(produced)
    if remaining is not None and remaining <= 0:
        return None
    seed = params.sampling_seed
    return request.model_copy(update=dict(
        input_ids=list(request.input_ids or []) + produced,
        rid=f"{request.rid}+{attempt}" if request.rid else None,
        sampling_params=params.model_copy(update=dict(
            max_new_tokens=remaining,
            sampling_seed=None if seed is None else (seed + attempt * SEED_STRIDE) % (1 << 63))),
    ))


async def generate_resumable(client: SGLangClient, request: GenerateRequest, *, max_resubmits: int = 8
                             ) -> Completion:
    """`client.generate(request)`, resubmitting what an abort cut short (at most `max_resubmits`
    times; then the aborted result stands). Needs `input_ids` (the continuation is token ids)."""
    _check_resumable(request)
    return await _resume(client, request, await client.generate(request), max_resubmits)


async def generate_resumable_batch(client: SGLangClient, requests: Sequence[GenerateRequest], *,
                                   max_resubmits: int = 8) -> list[Completion]:
    """The requests in one batch call (`client.generate_batch`), each then resumed on its own
    as `generate_resumable` would if an abort cut it short."""
    for request in requests:
        _check_resumable(request)
    answered = list(zip(requests, await client.generate_batch(requests), strict=True))
    # Only the answers an abort cut short go on, concurrently; the others are complete as they are.
    resumed = iter(await asyncio.gather(*(_resume(client, request, first, max_resubmits)
                                          for request, first in answered if first.finish_reason == "abort")))
    return [next(resumed) if first.finish_reason == "abort" else Completion(join(request, [first]), 0)
            for request, first in answered]


def _check_resumable(request: GenerateRequest) -> None:
    if request.input_ids is None:
        raise ValueError("partial rollouts resubmit token ids: give input_ids, not text")


async def _resume(client: SGLangClient, request: GenerateRequest, first: GenerateResult, max_resubmits: int
                  ) -> Completion:
    pieces = [first]
    produced = list(first.output_ids)
    attempt = 0
    while pieces[-1].finish_reason == "abort" and attempt < max_resubmits:
        attempt += 1
        follow_up = resubmission(request, produced, attempt)
        if follow_up is None:
            break
        pieces.append(await client.generate(follow_up))
        produced.extend(pieces[-1].output_ids)
    return Completion(join(request, pieces), attempt)
