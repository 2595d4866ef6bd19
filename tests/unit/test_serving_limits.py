"""The serving endpoint's limits (policyloop.serving.limits) and the tokenizer it reads prompts
with: what the context holds, and what a tokenizer would not let the model see."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from policyloop.models.tokenizer import VOCAB, load_tokenizer, save_tokenizer, unreadable_characters
from policyloop.rl.batching import ModelLimits
from policyloop.serving.errors import ApiError
from policyloop.serving.limits import check_vocabulary, limits_of, new_tokens


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    """The project's tokenizer in a directory whose config.json names a qwen2 model, as the
    bootstrap model's does (no weights: only the tokenizer is loaded)."""
    save_tokenizer(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2", "vocab_size": len(VOCAB),
                                                      "max_position_embeddings": 64}))
    return tmp_path


def test_what_the_model_would_not_see_is_named_whichever_way_the_tokenizer_was_loaded(model_dir: Path) -> None:
    from transformers import AutoTokenizer

    for tokenizer in (load_tokenizer(model_dir), AutoTokenizer.from_pretrained(model_dir)):
        # <unk> in their place, or left out (a class without an unknown token): named either way.
        assert {"A", "d", ".", "é"} <= set(unreadable_characters(tokenizer, "Add. 1+2=é")), type(tokenizer)
        assert unreadable_characters(tokenizer, "12+34=<tools><unk>") == []  # known tokens, written out
    assert unreadable_characters(load_tokenizer(model_dir), "Add. 1 + 2") == ["A", "d", "."]


def test_the_completion_gets_what_fits_beside_the_prompt(model_dir: Path) -> None:
    limits = limits_of(model_dir)
    assert limits == ModelLimits(vocab_size=len(VOCAB), context_tokens=64)
    assert new_tokens(limits, 6, "prompt", None) == 58  # no max_tokens: the room left
    assert new_tokens(limits, 6, "prompt", ("max_tokens", 58)) == 58
    assert new_tokens(limits_of(model_dir / "nowhere"), 6, "prompt", None) is None  # unknown: the engine's room
    for prompt_len, requested, param in [(64, None, "messages"), (6, ("max_completion_tokens", 59),
                                                                   "max_completion_tokens")]:
        with pytest.raises(ApiError) as refused:
            new_tokens(limits, prompt_len, "messages", requested)
        assert (refused.value.status, refused.value.code, refused.value.param) == (400, "context_length_exceeded",
                                                                                    param)
    with pytest.raises(ApiError, match=rf"outside the model.s vocabulary \[0, {len(VOCAB)}\)"):
        check_vocabulary(limits, [1, len(VOCAB)], "prompt")
