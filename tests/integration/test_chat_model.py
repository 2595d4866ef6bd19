"""The chat bootstrap model (models/chat.py), the one the session built before the tests
(MODULE_MODELS): a standard Hugging Face directory that transformers loads offline, whose
bootstrap.json states where it starts, and that writes tool calls chat_format parses; plus the
recipe's build through bootstrap.py's machinery on a tiny config, and the CLI's JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from policyloop.models.bootstrap import bootstrap, bootstrap_dir, is_complete, read_record
from policyloop.models.chat import CHAT_BOOTSTRAP, SUMMARY_KEYS, ChatBootstrapConfig
from policyloop.models.chat_format import IM_END, IM_START, MARKUP_TOKENS, parse_assistant
from policyloop.models.chat_tasks import call_correct, tasks
from policyloop.models.chat_tokenizer import build_chat_tokenizer
from policyloop.models.tokenizer import load_tokenizer
from tests.conftest import prebuilt_model

TINY = ChatBootstrapConfig(name="chat-tiny", hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                           intermediate_size=64, batch_size=8, tool_batch_size=1, max_steps=4, eval_every=2,
                           eval_problems=8, report_problems=4, target_accuracy=0.0)


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="module")
def chat_dir(request: pytest.FixtureRequest) -> Path:
    return prebuilt_model(request.config, "chat")


def test_a_standard_directory_that_transformers_loads_offline(chat_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert chat_dir == bootstrap_dir(CHAT_BOOTSTRAP) and is_complete(chat_dir)
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "bootstrap.json"} <= {p.name for p in chat_dir.iterdir()}
    tokenizer = AutoTokenizer.from_pretrained(chat_dir)
    model = AutoModelForCausalLM.from_pretrained(chat_dir)
    raw = build_chat_tokenizer()
    assert model.config.model_type == "qwen2" and model.config.architectures == ["Qwen2ForCausalLM"]
    assert model.config.tie_word_embeddings and str(model.dtype) == "torch.float32"
    assert model.config.max_position_embeddings == CHAT_BOOTSTRAP.max_position_embeddings == 1024
    assert model.config.vocab_size == len(tokenizer) == raw.get_vocab_size()
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id == raw.token_to_id(IM_END)
    assert tokenizer.bos_token is None
    for loaded in (tokenizer, load_tokenizer(chat_dir)):
        for task in tasks(8, 11, heldout=True, tool_fraction=0.5):
            ids = loaded.apply_chat_template(list(task.messages), tools=list(task.tools) if task.tools else None,
                                             add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
            text = loaded.apply_chat_template(list(task.messages), tools=list(task.tools) if task.tools else None,
                                              add_generation_prompt=True, tokenize=False)
            assert ids == raw.encode(text).ids
            assert ids.count(raw.token_to_id(IM_START)) == text.count(IM_START)
        assert all(len(loaded(token, add_special_tokens=False).input_ids) == 1 for token in MARKUP_TOKENS)


def test_its_record_states_a_start_that_rl_can_raise(chat_dir: Path) -> None:
    record = read_record(chat_dir)
    assert CHAT_BOOTSTRAP.target_accuracy <= record["heldout_tool_call_validity"] <= CHAT_BOOTSTRAP.max_accuracy
    assert record["text_accuracy"] <= 0.6  # the report's fresh held-out problems: text is not what it learns first
    assert 0.05 <= record["tool_call_validity"] <= 0.95
    assert 0.1 <= record["accuracy_after_tool"] <= 0.95
    assert record["parameters"] > 1_000_000 and record["steps"] > 0 and record["seconds"] > 0
    assert record["config"] == CHAT_BOOTSTRAP.model_dump(mode="json")


def test_from_a_tools_prompt_it_writes_calls_that_parse(chat_dir: Path) -> None:
    """Greedy generation through transformers' own generate: some of the turns are calls that
    parse_assistant reads (and some of those are the right call)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(chat_dir)
    model = AutoModelForCausalLM.from_pretrained(chat_dir)
    questions = tasks(24, 12, heldout=True, tool_fraction=1.0)
    parsed = right = 0
    for task in questions:
        ids = tokenizer.apply_chat_template(list(task.messages), tools=list(task.tools or ()),
                                            add_generation_prompt=True, return_tensors="pt", return_dict=True)
        with torch.inference_mode():
            out = model.generate(**ids, max_new_tokens=40, do_sample=False)
        text = tokenizer.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
        turn = parse_assistant(text)
        parsed += bool(turn.tool_calls)
        right += call_correct(turn, task)
    assert parsed >= 3 and right >= 1, (parsed, right)


def test_a_tiny_recipe_builds_through_the_bootstrap_machinery(tmp_path: Path) -> None:
    path = bootstrap(TINY, tmp_path)
    assert path == tmp_path / f"chat-tiny-{TINY.digest()}" and is_complete(path)
    record = read_record(path)
    assert record["steps"] == 2 and record["config"] == TINY.model_dump(mode="json")
    assert set(SUMMARY_KEYS) <= set(record)
    assert TINY.digest() != CHAT_BOOTSTRAP.digest() != TINY.model_copy(update={"seed": 1}).digest()
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no staging directory left


def test_cli_prints_the_chat_models_json(tmp_path: Path) -> None:
    """`policyloop bootstrap --chat` builds CHAT_BOOTSTRAP, so here it only reports a cache entry."""
    fake = bootstrap_dir(CHAT_BOOTSTRAP, tmp_path)
    fake.mkdir(parents=True)
    figures = {"parameters": 3_000_000, "steps": 80, "seconds": 90.5, "heldout_tool_call_validity": 0.4,
               "text_accuracy": 0.05, "tool_call_validity": 0.3, "tool_call_validity_t1": 0.06,
               "accuracy_after_tool": 0.5}
    (fake / "bootstrap.json").write_text(json.dumps({**figures, "history": []}))
    result = subprocess.run([sys.executable, "-m", "policyloop", "bootstrap", "--chat", "--out", str(tmp_path)],
                            capture_output=True, text=True, env=dict(os.environ), timeout=60)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {"path": str(fake.resolve()), **figures, "cached": True}
    both = subprocess.run([sys.executable, "-m", "policyloop", "bootstrap", "--chat", "--tools", "--out",
                           str(tmp_path)], capture_output=True, text=True, env=dict(os.environ), timeout=60)
    assert both.returncode == 2
