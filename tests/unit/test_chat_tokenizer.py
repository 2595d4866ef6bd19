"""The chat tokenizer (models/chat_tokenizer.py): a byte-level BPE trained here that every loader
reads the same way, and that renders chat_format's template."""

from __future__ import annotations

import json
import unicodedata
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policyloop.models.chat_format import (
    CHAT_TEMPLATE,
    END_OF_TEXT,
    IM_END,
    IM_START,
    MARKUP_TOKENS,
    SPECIAL_TOKENS,
    ToolCall,
    function_tool,
    parse_assistant,
    render_tool_call,
)
from policyloop.models.chat_tokenizer import MODEL_MAX_LENGTH, VOCAB_SIZE, build_chat_tokenizer, save_chat_tokenizer
from policyloop.models.tokenizer import load_tokenizer

QWEN2_CONFIG = {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]}


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_chat_tokenizer(tmp_path_factory.mktemp("chat-tokenizer"))


@pytest.fixture(scope="module")
def model_like_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory whose config.json says qwen2, as the chat model's does: transformers 5's
    AutoTokenizer then builds its Qwen2Tokenizer instead of reading tokenizer.json as it is."""
    directory = save_chat_tokenizer(tmp_path_factory.mktemp("chat-tokenizer-qwen2"))
    (directory / "config.json").write_text(json.dumps(QWEN2_CONFIG))
    return directory


@pytest.fixture(scope="module")
def loaders(tokenizer_dir: Path, model_like_dir: Path) -> dict:
    from transformers import AutoTokenizer

    return {"auto": AutoTokenizer.from_pretrained(str(tokenizer_dir)),
            "auto_qwen2": AutoTokenizer.from_pretrained(str(model_like_dir)),
            "load_tokenizer": load_tokenizer(model_like_dir)}


TEXT = st.text(alphabet=st.characters(codec="utf-8"), max_size=80)
SAMPLES = ("What is 47+38?", "héllo wörld 数学 😀🎉\n\n\ttabs  and  spaces\r\n", "e\u0301 (decomposed)",
           '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>',
           "<|im_start|>user\nhi<|im_end|>",
           "12345678901234567890", "   ", "")


def test_vocabulary_size_and_special_ids() -> None:
    tokenizer = build_chat_tokenizer()
    assert tokenizer.get_vocab_size() == VOCAB_SIZE
    assert [tokenizer.token_to_id(t) for t in SPECIAL_TOKENS] == [0, 1, 2]
    assert [tokenizer.token_to_id(t) for t in MARKUP_TOKENS] == list(range(VOCAB_SIZE - len(MARKUP_TOKENS), VOCAB_SIZE))


@settings(max_examples=300, deadline=None)
@given(TEXT)
def test_any_text_round_trips_as_its_nfc_form(text: str) -> None:
    tokenizer = build_chat_tokenizer()
    nfc = unicodedata.normalize("NFC", text)
    assert tokenizer.decode(tokenizer.encode(text).ids, skip_special_tokens=False) == nfc
    assert tokenizer.decode(tokenizer.encode(nfc).ids, skip_special_tokens=False) == nfc


@pytest.mark.parametrize("text", [
    "héllo 😀 数学很有趣 こんにちは\n\n", "a\r\nb\tc  d", "🧑‍🤝‍🧑 ünïcödé ∑∫", "\x00\x7f\u200b"])
def test_emoji_cjk_and_whitespace_round_trip_exactly(text: str) -> None:
    tokenizer = build_chat_tokenizer()
    assert tokenizer.decode(tokenizer.encode(text).ids, skip_special_tokens=False) == text


def test_digits_are_one_token_each() -> None:
    tokenizer = build_chat_tokenizer()
    encoding = tokenizer.encode("What is 1234+56? 7890")
    digits = [token for token in encoding.tokens if any(c.isdigit() for c in token)]
    assert digits == list("1234567890")


@pytest.mark.parametrize("token", [*SPECIAL_TOKENS, *MARKUP_TOKENS])
def test_special_and_markup_tokens_are_single_ids(token: str) -> None:
    tokenizer = build_chat_tokenizer()
    assert tokenizer.encode(f"a{token}b").tokens == ["a", token, "b"]
    assert tokenizer.encode(token).ids == [tokenizer.token_to_id(token)]


def test_markup_survives_skip_special_tokens_and_special_tokens_do_not() -> None:
    tokenizer = build_chat_tokenizer()
    ids = tokenizer.encode(f"{render_tool_call(ToolCall('add', {'a': 1, 'b': 2}))}{IM_END}").ids
    text = tokenizer.decode(ids, skip_special_tokens=True)
    assert IM_END not in text
    assert parse_assistant(text).tool_calls == (ToolCall("add", {"a": 1, "b": 2}),)


def test_the_saved_directory_is_a_standard_one(tokenizer_dir: Path) -> None:
    files = {p.name for p in tokenizer_dir.iterdir()}
    assert {"tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "special_tokens_map.json"} <= files
    config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    assert config["chat_template"] == CHAT_TEMPLATE
    assert (config["eos_token"], config["pad_token"], config["bos_token"]) == (IM_END, END_OF_TEXT, None)
    assert config["model_max_length"] == MODEL_MAX_LENGTH


@pytest.mark.parametrize("loader", ["auto", "auto_qwen2", "load_tokenizer"])
def test_every_loader_gives_the_raw_tokenizers_ids(loaders: dict, loader: str) -> None:
    hf, raw = loaders[loader], build_chat_tokenizer()
    assert len(hf) == VOCAB_SIZE
    assert (hf.eos_token, hf.pad_token, hf.bos_token) == (IM_END, END_OF_TEXT, None)
    assert (hf.eos_token_id, hf.pad_token_id) == (raw.token_to_id(IM_END), raw.token_to_id(END_OF_TEXT))
    for text in SAMPLES:
        ids = raw.encode(text).ids
        assert hf(text).input_ids == ids, text
        assert hf(text, add_special_tokens=False).input_ids == ids, text
        assert hf.decode(ids) == raw.decode(ids, skip_special_tokens=False), text


@settings(max_examples=150, deadline=None)
@given(TEXT)
def test_loaders_agree_on_any_text(loaders: dict, text: str) -> None:
    ids = build_chat_tokenizer().encode(text).ids
    for name, hf in loaders.items():
        assert hf(text).input_ids == ids, name


def test_apply_chat_template_renders_tools_calls_and_responses(loaders: dict) -> None:
    tokenizer, raw = loaders["auto_qwen2"], build_chat_tokenizer()
    tools = [function_tool("add", "Add two numbers.", {"type": "object", "properties": {"a": {"type": "integer"},
                                                                                          "b": {"type": "integer"}}})]
    messages = [{"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": "What is 47+38?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"type": "function", "function": {"name": "add", "arguments": {"a": 47, "b": 38}}}]},
                {"role": "tool", "content": "85"}]
    text = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    assert text.startswith(f"{IM_START}system\nYou are a helpful assistant.\n\n# Tools")
    assert '"name": "add"' in text and "<tools>" in text
    assert '<tool_call>\n{"name": "add", "arguments": {"a": 47, "b": 38}}\n</tool_call>' in text
    assert f"{IM_START}user\n<tool_response>\n85\n</tool_response>{IM_END}" in text
    assert text.endswith(f"{IM_START}assistant\n")
    ids = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True,
                                        return_dict=True)["input_ids"]
    assert ids == raw.encode(text).ids
    assert ids.count(raw.token_to_id(IM_START)) == 5 and ids.count(raw.token_to_id(IM_END)) == 4
    assert ids.count(raw.token_to_id("<tool_call>")) == 3  # two in the instructions, then the call
    assert ids.count(raw.token_to_id("<tool_response>")) == 1


def test_training_is_deterministic_and_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from policyloop.models import chat_tokenizer

    first = build_chat_tokenizer().to_str()
    monkeypatch.setenv("POLICYLOOP_CACHE", str(tmp_path))
    chat_tokenizer._trained_json.cache_clear()
    try:
        assert build_chat_tokenizer().to_str() == first  # trained again from scratch, in the empty cache
        assert len(list((tmp_path / "models" / "chat-tokenizer").glob("tokenizer-*.json"))) == 1
    finally:
        chat_tokenizer._trained_json.cache_clear()
