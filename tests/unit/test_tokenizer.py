"""The character tokenizer loads offline through AutoTokenizer and round-trips text; in a model
directory, load_tokenizer loads it as its tokenizer.json defines it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from policyloop.models.tokenizer import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    UNK_ID,
    VOCAB,
    build_tokenizer,
    load_tokenizer,
    save_tokenizer,
)


@pytest.fixture
def hf_tokenizer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    save_tokenizer(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    assert isinstance(tokenizer, PreTrainedTokenizerFast)
    return tokenizer


def test_files_written(tmp_path: Path) -> None:
    save_tokenizer(tmp_path)
    names = {p.name for p in tmp_path.iterdir()}
    assert {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"} <= names


def test_vocab_ids() -> None:
    assert (PAD_ID, EOS_ID, BOS_ID, UNK_ID) == (0, 1, 2, 3)
    assert [VOCAB[c] for c in "0123456789+-= "] == list(range(4, 18))
    assert [VOCAB[t] for t in ("<python>", "</python>", "<output>", "</output>", "<tools>")] == list(range(18, 23))
    assert build_tokenizer().get_vocab_size() == len(VOCAB) == 23


def test_special_tokens(hf_tokenizer) -> None:  # type: ignore[no-untyped-def]
    assert hf_tokenizer.pad_token == "<pad>" and hf_tokenizer.pad_token_id == 0
    assert hf_tokenizer.eos_token == "<eos>" and hf_tokenizer.eos_token_id == 1
    assert hf_tokenizer.bos_token_id == 2
    assert len(hf_tokenizer) == 23


def test_tool_markers_are_single_tokens_kept_by_decoding(hf_tokenizer) -> None:  # type: ignore[no-untyped-def]
    text = "<tools>1+2=<python>1+2</python><output>3</output>3"
    ids = hf_tokenizer(text, add_special_tokens=False).input_ids
    assert ids[0] == VOCAB["<tools>"] and ids[5] == VOCAB["<python>"] and ids.count(VOCAB["</output>"]) == 1
    assert len(ids) == 14  # five markers, nine characters
    assert hf_tokenizer.decode(ids + [EOS_ID], skip_special_tokens=True) == text


def test_one_id_per_character(hf_tokenizer) -> None:  # type: ignore[no-untyped-def]
    ids = hf_tokenizer("12+34=", add_special_tokens=False).input_ids
    assert ids == [VOCAB[c] for c in "12+34="]
    # No special tokens are added by default either: every component tokenizes a prompt alike.
    assert hf_tokenizer("12+34=").input_ids == ids
    assert hf_tokenizer("98-99= -1", add_special_tokens=False).input_ids == [VOCAB[c] for c in "98-99= -1"]
    assert hf_tokenizer("1x", add_special_tokens=False).input_ids == [VOCAB["1"], UNK_ID]


def test_decode_round_trip(hf_tokenizer) -> None:  # type: ignore[no-untyped-def]
    for text in ["12+34=46", "10-99=-89", "1 2", "0"]:
        ids = hf_tokenizer(text, add_special_tokens=False).input_ids
        assert hf_tokenizer.decode(ids) == text
        assert hf_tokenizer.decode(ids + [EOS_ID, PAD_ID], skip_special_tokens=True) == text
    assert hf_tokenizer.decode([VOCAB["4"], VOCAB["6"], EOS_ID]) == "46<eos>"


def test_batch_left_padding(hf_tokenizer) -> None:  # type: ignore[no-untyped-def]
    batch = hf_tokenizer(["1+2=", "10+20="], padding=True)
    assert batch.input_ids[0][:2] == [PAD_ID, PAD_ID]
    assert batch.attention_mask[0] == [0, 0, 1, 1, 1, 1]


def test_in_a_model_directory_every_character_it_knows_is_kept(tmp_path: Path) -> None:
    # config.json names a qwen2 model, as the bootstrap model's does: transformers 5's AutoTokenizer
    # then builds a Qwen2Tokenizer from the vocabulary, which drops spaces and unknown characters.
    save_tokenizer(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2", "vocab_size": len(VOCAB)}))
    tokenizer = load_tokenizer(tmp_path)
    assert tokenizer("1 + 2=", add_special_tokens=False).input_ids == [VOCAB[c] for c in "1 + 2="]
    assert tokenizer("<tools>?", add_special_tokens=False).input_ids == [VOCAB["<tools>"], UNK_ID]
