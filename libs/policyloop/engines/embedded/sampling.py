"""Choosing each row's next token (pure functions of logits, the request's parameters and its
generator; the compute thread calls them).

temperature 0 is greedy (argmax); otherwise logits are divided by the temperature, then top-k and
top-p truncate, and one uniform number from the request's own `torch.Generator` (seeded with
`sampling_seed`, or at random) picks the token by inverse CDF, so a seeded request gives the same
tokens whatever else shares its wave. The logprob returned for each token is
`log_softmax(logits / temperature)` (`log_softmax(logits)` when greedy) taken BEFORE top-k/top-p
truncation — as SGLang reports it by default; at temperature 1 it is the model's plain
log-probability, equal to a teacher-forced forward pass over prompt + response.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Sequence

import torch

from policyloop.engines.protocol import FinishReason, SamplingParams


def request_generator(params: SamplingParams) -> torch.Generator | None:
    """The request's own random stream: seeded with `sampling_seed`, or at random (None when greedy)."""
    if params.temperature <= 0:
        return None
    seed = params.sampling_seed if params.sampling_seed is not None else secrets.randbits(63)
    return torch.Generator().manual_seed(seed % (1 << 64))


def sample_rows(logits: torch.Tensor, params: Sequence[SamplingParams],
                generators: Sequence[torch.Generator | None]) -> list[tuple[int, float]]:
    """Each row's token and its logprob under the row's temperature (before truncation). Greedy
    rows and rows without truncation are drawn together (one uniform number from each row's own
    generator, as `draw` takes it); rows with top-k or top-p one by one."""
    rows = len(params)
    temperatures = torch.tensor([p.temperature if p.temperature > 0 else 1.0 for p in params], dtype=logits.dtype)
    logprobs = torch.log_softmax(logits / temperatures[:, None], dim=-1)
    tokens = [0] * rows
    greedy = [i for i, p in enumerate(params) if p.temperature == 0]
    if greedy:
        for i, token in zip(greedy, torch.argmax(logits[greedy], dim=-1).tolist(), strict=True):
            tokens[i] = token
    vocab = logprobs.shape[-1]
    whole = [i for i, p in enumerate(params) if p.temperature > 0 and not truncates(p, vocab)]
    if whole:
        uniform = torch.cat([torch.rand((1,), generator=_generator(generators[i]), dtype=torch.float64)
                             for i in whole])
        cdf = logprobs[whole].double().exp().cumsum(dim=-1)
        picked = torch.searchsorted(cdf, (uniform * cdf[:, -1])[:, None], right=True).clamp_(max=vocab - 1)
        for i, token in zip(whole, picked[:, 0].tolist(), strict=True):
            tokens[i] = token
    for i, p in enumerate(params):
        if p.temperature > 0 and truncates(p, vocab):
            tokens[i] = draw(logprobs[i], p.top_k, p.top_p, _generator(generators[i]))
    chosen = torch.gather(logprobs, 1, torch.tensor(tokens, dtype=torch.long)[:, None])[:, 0].tolist()
    return list(zip(tokens, chosen, strict=True))


def truncates(params: SamplingParams, vocab: int) -> bool:
    """Whether top-k or top-p cut the distribution (-1 or a k of the whole vocabulary, and p 1, do not)."""
    return not ((params.top_k == -1 or params.top_k >= vocab) and params.top_p >= 1.0)


def _generator(generator: torch.Generator | None) -> torch.Generator:
    if generator is None:
        raise ValueError("a row sampled at temperature > 0 needs its generator")
    return generator


def draw(logprobs: torch.Tensor, top_k: int, top_p: float, generator: torch.Generator) -> int:
    """Inverse-CDF sampling with one uniform draw from `generator`, after top-k and top-p
    truncation (ties broken by token id: a stable sort)."""
    probs = logprobs.double().exp()
    ids: torch.Tensor | None = None
    if (top_k == -1 or top_k >= probs.numel()) and top_p >= 1.0:
        values = probs
    else:
        values, ids = torch.sort(probs, descending=True, stable=True)
        if 0 < top_k < values.numel():
            values, ids = values[:top_k], ids[:top_k]
        if top_p < 1.0:
            keep = (values.cumsum(0) - values) < top_p
            keep[0] = True
            values, ids = values[keep], ids[keep]
    cdf = values.cumsum(0)
    u = torch.rand((1,), generator=generator, dtype=torch.float64) * cdf[-1]
    j = min(int(torch.searchsorted(cdf, u, right=True)), cdf.numel() - 1)
    return j if ids is None else int(ids[j])


def finish_after(token: int, produced: int, max_new_tokens: int, params: SamplingParams,
                 eos_ids: frozenset[int], output_text: Callable[[], str] | None = None) -> FinishReason | None:
    """Whether the request ends with `token` (its `produced`-th output token), as SGLang's
    Req.check_finished: the length check first; ignore_eos turns off every stop token, the
    request's stop_token_ids as well as the model's EOS; then the stop strings, in the output
    decoded so far (`output_text`, asked only when the request has stop strings)."""
    if produced >= max_new_tokens:
        return FinishReason(type="length", length=max_new_tokens)
    if not params.ignore_eos and (token in params.stop_token_ids or token in eos_ids):
        return FinishReason(type="stop", matched=token)
    if params.stop and output_text is not None:
        matched = first_stop(output_text(), params.stop)
        if matched is not None:
            return FinishReason(type="stop", matched=matched[1])
    return None


def first_stop(text: str, stops: Sequence[str]) -> tuple[int, str] | None:
    """(position, stop string) of the stop string that begins first in `text`, None if none does."""
    found = [(at, stop) for stop in stops if (at := text.find(stop)) >= 0]
    return min(found) if found else None
