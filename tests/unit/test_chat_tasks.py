"""The chat model's warm-up tasks (models/chat_tasks.py) and how a conversation becomes training
ids (models/chat.py): the split, the checks of an answer and of a call, and a loss that covers
what the assistant writes and nothing else."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from policyloop.envs.arithmetic import Problem, is_heldout
from policyloop.models.chat import ASSISTANT_PREFIX, IGNORE, encode_conversation
from policyloop.models.chat_format import IM_END, ToolCall, parse_assistant, render_tool_call
from policyloop.models.chat_tasks import (
    ADD,
    CALCULATOR,
    SUBTRACT,
    calculate,
    call_correct,
    problems,
    render,
    session_conversation,
    tasks,
    text_correct,
    tool_call_valid,
    tool_session,
)
from policyloop.models.chat_tokenizer import build_chat_tokenizer, save_chat_tokenizer


def test_the_splits_are_disjoint_and_deterministic() -> None:
    train = problems(2000, 1, heldout=False)
    heldout = problems(300, 2, heldout=True)
    assert not set(train) & set(heldout)
    assert all(is_heldout(p) for p in heldout)
    assert problems(50, 1, heldout=False) == train[:50]
    assert all(p.b <= p.a for p in train if p.op == "-")  # no negative results
    assert {len(str(p.a)) for p in train} == {1, 2}


def test_tasks_vary_the_question_the_tools_and_the_system_prompt() -> None:
    chosen = tasks(300, 3, heldout=False, tool_fraction=0.5)
    tool = [t for t in chosen if t.tools]
    assert 100 < len(tool) < 200
    assert len({t.messages[-1]["content"].replace(str(t.problem.a), "A").replace(str(t.problem.b), "B")
                for t in chosen}) >= 6
    schemas = [json.dumps(s) for t in tool for s in t.tools or ()]
    assert any('"strict": true' in s and '"additionalProperties": false' in s for s in schemas)
    assert any('"description"' not in s for s in schemas)
    assert {t.messages[0]["role"] for t in tool} == {"system", "user"}
    assert all(t.call is not None and call_correct(parse_assistant(render_tool_call(t.call)), t) for t in tool)


def test_text_answers_are_checked_by_their_last_number() -> None:
    problem = Problem(47, "+", 38)
    assert text_correct("47 + 38 = 85.", True, problem)
    assert text_correct("85", True, problem)
    assert not text_correct("47 + 38 = 85.", False, problem)  # cut off by the length limit
    assert not text_correct("85 or 86", True, problem)
    assert not text_correct("The answer is", True, problem)


@pytest.mark.parametrize(("call", "right"), [
    (ToolCall("add", {"a": 47, "b": 38}), True),
    (ToolCall("add", {"a": 38, "b": 47}), False),
    (ToolCall("subtract", {"a": 47, "b": 38}), False),
    (ToolCall("add", {"a": 47, "b": 38, "c": 1}), False),
    (ToolCall("calculator", {"expression": "47 + 38"}), False),  # not offered
])
def test_a_call_is_right_when_it_names_an_offered_tool_with_the_problems_arguments(call: ToolCall,
                                                                                    right: bool) -> None:
    task = next(t for t in tasks(200, 4, heldout=False, tool_fraction=1.0)
                if {s["function"]["name"] for s in t.tools or ()} >= {"add", "subtract"}
                and "calculator" not in {s["function"]["name"] for s in t.tools or ()})
    task = type(task)(Problem(47, "+", 38), task.messages, task.tools, task.call, task.tool_output, task.answer)
    text = render_tool_call(call)
    assert tool_call_valid(text, True, task) is right
    assert not tool_call_valid(text, False, task)
    assert not tool_call_valid(text.replace("}\n</tool_call>", "\n</tool_call>"), True, task)  # malformed JSON


def test_calculator_calls_may_space_the_expression() -> None:
    task = next(t for t in tasks(200, 5, heldout=False, tool_fraction=1.0)
                if t.call is not None and t.call.name == "calculator")
    p = task.problem
    for expression in (f"{p.a}{p.op}{p.b}", f"{p.a} {p.op} {p.b}", f" {p.a} {p.op}  {p.b} "):
        assert call_correct(parse_assistant(render_tool_call(ToolCall("calculator", {"expression": expression}))), task)
    assert {ADD.name, SUBTRACT.name, CALCULATOR.name} == {"add", "subtract", "calculator"}


def test_the_calculator_tool_computes_what_its_calls_may_ask_and_refuses_the_rest() -> None:
    assert (calculate("47 + 38"), calculate("9-12"), calculate(" -3 + 4 ")) == (85, -3, 1)
    for bad in ("", "4 * 5", "1 + 2 + 3", "__import__('os')", "x + 1"):
        with pytest.raises(ValueError, match="not an expression"):
            calculate(bad)


def test_the_loss_covers_the_assistant_turns_only() -> None:
    tokenizer = build_chat_tokenizer()
    for task in tasks(40, 6, heldout=False, tool_fraction=0.5):
        ids, labels = encode_conversation(tokenizer, task.conversation(), task.tools)
        text = render(task.conversation(), task.tools)
        assert ids == tokenizer.encode(text).ids  # what apply_chat_template + encode gives
        trained = tokenizer.decode([t for t in labels if t != IGNORE], skip_special_tokens=False)
        turns = [chunk.split(IM_END)[0] + IM_END for chunk in text.split(ASSISTANT_PREFIX)[1:]]
        assert trained == "".join(turns)
        assert task.answer + IM_END in trained and "<|im_start|>" not in trained
        assert (task.tool_output is None) or "<tool_response>" not in trained
        # the labelled ids are a contiguous run for each assistant turn
        runs = sum(1 for i, t in enumerate(labels) if t != IGNORE and (i == 0 or labels[i - 1] == IGNORE))
        assert runs == len(turns) == (2 if task.tools else 1)


def test_rendering_matches_the_tokenizers_own_template(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(save_chat_tokenizer(tmp_path)))
    for task in tasks(20, 7, heldout=True, tool_fraction=0.5):
        assert render(task.conversation(), task.tools) == hf.apply_chat_template(
            task.conversation(), tools=list(task.tools) if task.tools else None, tokenize=False)
        assert render(task.messages, task.tools, add_generation_prompt=True) == hf.apply_chat_template(
            list(task.messages), tools=list(task.tools) if task.tools else None, tokenize=False,
            add_generation_prompt=True)


def test_a_tool_session_is_one_conversation_whose_questions_share_the_system_turn_and_tools() -> None:
    import random

    tokenizer = build_chat_tokenizer()
    session = tool_session(problems(4, 8, heldout=False), random.Random(8))
    messages = session_conversation(session)
    assert [m["role"] for m in messages if m["role"] != "system"] == ["user", "assistant", "tool", "assistant"] * 4
    assert sum(m["role"] == "system" for m in messages) == (session[0].messages[0]["role"] == "system")
    assert all(t.tools == session[0].tools for t in session)
    ids, labels = encode_conversation(tokenizer, messages, session[0].tools)
    trained = tokenizer.decode([t for t in labels if t != IGNORE], skip_special_tokens=False)
    assert trained.count("<tool_call>") == 4 and trained.count("The answer is") == 4
    assert all(call_correct(parse_assistant(render_tool_call(t.call)), t) for t in session if t.call)
