"""What a request must fit, checked before the engine sees it: the engine would refuse it too,
but only as an engine failure, and for a streamed request after the answer's 200 has gone out.

- The model's context (its config's max_position_embeddings) holds the prompt and the
  completion. No `max_tokens` asks for the room the prompt leaves; more than fits is
  `context_length_exceeded`, naming the field that overflows.
- Token ids sent as the prompt are in the model's vocabulary.
- Text the tokenizer cannot represent is refused, naming the characters, never dropped: a
  tokenizer with an unknown token (the bootstrap model's character vocabulary) puts <unk> in
  their place, which every decode with skip_special_tokens hides; one without (what
  transformers 5's AutoTokenizer makes of that vocabulary) leaves them out."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from policyloop.models.tokenizer import unreadable_characters
from policyloop.rl.batching import ModelLimits
from policyloop.serving.errors import CONTEXT_LENGTH_EXCEEDED, ApiError

UNKNOWN_LIMITS = ModelLimits(vocab_size=None, context_tokens=None)
SHOWN_CHARACTERS = 20  # a refusal lists this many of the unknown characters at most


def limits_of(model_dir: str | Path) -> ModelLimits:
    """The vocabulary and context in `model_dir`/config.json (UNKNOWN_LIMITS where it cannot be read:
    the engine then decides, as it would without the endpoint)."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return UNKNOWN_LIMITS
    return ModelLimits.of(SimpleNamespace(**config)) if isinstance(config, dict) else UNKNOWN_LIMITS


def new_tokens(limits: ModelLimits, prompt_len: int, prompt_param: str,
               requested: tuple[str, int] | None) -> int | None:
    """How many tokens the completion may have: `requested` ((field, count), the client's
    max_tokens or max_completion_tokens) when it fits beside the prompt, else the room the prompt
    leaves (None where the context is unknown: the engine's own default is that room too)."""
    context = limits.context_tokens
    if context is None:
        return requested[1] if requested else None
    if prompt_len >= context:
        raise _exceeded(context, f"you sent {prompt_len} tokens in the {prompt_param}, which leaves no room for "
                                 f"a completion", prompt_param)
    if requested is None:
        return context - prompt_len
    field, count = requested
    if prompt_len + count > context:
        raise _exceeded(context, f"you requested {prompt_len + count} tokens ({prompt_len} in the {prompt_param}, "
                                 f"{count} in the completion): {field} can be at most {context - prompt_len} here, "
                                 f"or leave it out for all the room there is", field)
    return count


def _exceeded(context: int, why: str, param: str) -> ApiError:
    return ApiError(f"This model's maximum context length is {context} tokens. However, {why}.", param,
                    code=CONTEXT_LENGTH_EXCEEDED)


def check_vocabulary(limits: ModelLimits, ids: Sequence[int], param: str) -> None:
    vocab = limits.vocab_size
    bad = [t for t in ids if t < 0 or (vocab is not None and t >= vocab)]
    if bad:
        bounds = f" [0, {vocab})" if vocab is not None else ""
        raise ApiError(f"{param}: token ids {bad[:5]} are outside the model's vocabulary{bounds}", param)


def refuse_unknown_characters(tokenizer: Any, parts: Sequence[tuple[str, str]]) -> None:
    """ApiError naming the first (param, text) of `parts` with characters the tokenizer has no
    token for, and which they are."""
    for param, text in parts:
        unknown = unreadable_characters(tokenizer, text)
        if unknown:
            shown = ", ".join(repr(c) for c in unknown[:SHOWN_CHARACTERS])
            more = f" and {len(unknown) - SHOWN_CHARACTERS} more" if len(unknown) > SHOWN_CHARACTERS else ""
            raise ApiError(f"{param}: the model's tokenizer has no token for {shown}{more}; the model could not "
                           f"read them (remove or replace them)", param)
