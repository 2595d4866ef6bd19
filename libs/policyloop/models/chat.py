"""The chat bootstrap model: a small Qwen2 that answers arithmetic questions in chat and calls
function tools in chat_format's (Qwen2.5's) format, warmed up just enough to be improvable.

`CHAT_BOOTSTRAP` builds a 1.05M-parameter Qwen2 (hidden 128, 4 layers, 4 query / 2 key-value
heads, 1024 positions, tied embeddings, float32) with the byte-level BPE of
models/chat_tokenizer.py and a short supervised pass on the conversations of
models/chat_tasks.py: text questions ("What is 47 + 38?" answered "47 + 38 = 85.") and tool
sessions (tools offered, then questions answered each by a `<tool_call>` to `add`/`subtract` or
`calculator`, the tool's answer, and "The answer is 85."). The loss covers only what the
assistant writes (its turns and their `<|im_end|>`), never the system, user or tool turns. It
stops, through bootstrap.py's accuracy window, at the first evaluation whose greedy held-out
tool-call validity (the first turn parses with chat_format.parse_assistant into one call of an
offered tool with the problem's arguments) lies in [target_accuracy, max_accuracy]: an agent
that calls its tool right some of the time, with room for training to show. bootstrap.json then
also states the text accuracy and the accuracy of the answer after a right call's result.

Tool sessions weigh as much as the text questions in a step (4 sessions of 4 questions, ~2k
tokens, beside 32 text questions): with one session a step, validity was 0.05 after 450 steps;
with four it passes 0.2 near step 300 and 0.6 near step 400 (2026-11-28, docs/engine.md).

Why hidden 128 and not a few million parameters: the build must take under 3 minutes on two
cores. The warm-up is bound by how many examples it takes the model to learn to read the
question (a few hundred steps) and then the digits' sums, and a model of hidden 256 (3.4M
parameters) learned no faster per step while each step cost three times as much (docs/engine.md).

Everything else is bootstrap.py's: the cache directory `<cache_root>/<name>-<config hash>/`,
the staging directory renamed into place, bootstrap.json written last, the seeds.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import Field

from policyloop.models.bootstrap import (
    NAME_PATTERN,
    BootstrapRecipe,
    Completion,
    accuracy_window,
    generate_ids,
    optimize,
    qwen2_model,
    seeded_generator,
    step_seed,
    train_and_save,
)
from policyloop.models.chat_format import END_OF_TEXT, IM_END, IM_START
from policyloop.models.chat_tasks import (
    ChatTask,
    problems,
    render,
    session_conversation,
    tasks,
    text_correct,
    tool_call_valid,
    tool_session,
)
from policyloop.models.chat_tokenizer import build_chat_tokenizer, save_chat_tokenizer

if TYPE_CHECKING:
    import torch
    from tokenizers import Tokenizer
    from transformers import Qwen2ForCausalLM

# Part of the cache key: bump it when a code change (the tasks, the tokenizer, the training)
# makes old cached chat models wrong.
CHAT_BUILD_FORMAT = 2
ASSISTANT_PREFIX = f"{IM_START}assistant\n"
IGNORE = -100


class ChatBootstrapConfig(BootstrapRecipe):
    """Everything that determines the chat bootstrap model; its hash names the cache directory."""

    build_format: ClassVar[int] = CHAT_BUILD_FORMAT

    name: str = Field("chat-qwen2-small", pattern=NAME_PATTERN, description="Prefix of the cache directory name.")
    seed: int = Field(0, description="Seeds the weight init, the training batches and the eval problems.")
    hidden_size: int = Field(128, ge=8, description="Qwen2 hidden size.")
    intermediate_size: int = Field(384, ge=8, description="MLP width.")
    max_position_embeddings: int = Field(1024, ge=16, description="Longest sequence (tool schemas + a few turns).")

    ops: tuple[str, ...] = Field(("+", "-"), description='Operators of the questions, a subset of ("+", "-").')
    batch_size: int = Field(32, ge=1, description="Text conversations per training step.")
    tool_batch_size: int = Field(4, ge=1, description="Tool sessions per training step.")
    session_questions: int = Field(4, ge=1, description="Questions of a tool session: one conversation, its system "
                                   "turn and tools (~150-300 tokens) shared by the questions (~60 tokens each).")
    learning_rate: float = Field(2e-3, gt=0, description="AdamW peak learning rate (after linear warm-up).")
    max_steps: int = Field(2000, ge=1, description="Step budget: fail if the target is not reached by then.")
    eval_every: int = Field(25, ge=1, description="Steps between held-out evaluations (validity moves ~0.1 in 25 "
                            "steps while it climbs: the window is seldom overshot).")
    eval_problems: int = Field(64, ge=1, description="Held-out tool questions of each evaluation.")
    max_new_tokens: int = Field(14, ge=1, description="Generation limit of a text answer: \"47 + 58 = 105.\" and "
                                "its <|im_end|> are 13 tokens.")
    tool_max_new_tokens: int = Field(40, ge=1, description="Generation limit of a tool-call turn.")
    report_problems: int = Field(128, ge=1, description="Held-out problems of each measure in bootstrap.json.")
    target_accuracy: float = Field(0.25, ge=0, le=1, description="Stop at the first evaluation with held-out "
                                   "tool-call validity >= this.")
    max_accuracy: float = Field(0.50, ge=0, le=1, description="Upper end of the window (see BootstrapRecipe).")

    def build(self, directory: Path) -> dict[str, Any]:
        return build(self, directory)


CHAT_BOOTSTRAP = ChatBootstrapConfig()


def build(config: ChatBootstrapConfig, directory: Path) -> dict[str, Any]:
    """Trains the chat model and writes the full model directory; returns the bootstrap.json record."""
    tokenizer = build_chat_tokenizer()

    def train(model: Qwen2ForCausalLM) -> dict[str, Any]:
        eval_set = tasks(config.eval_problems, config.seed, heldout=True, tool_fraction=1.0, ops=config.ops)
        steps, validity, history = accuracy_window(
            model, config,
            lambda optimizer, schedule, step: optimize(model, optimizer, schedule,
                                                       lambda: batch_loss(model, tokenizer, config, step)),
            lambda: tool_call_validity(model, tokenizer, eval_set, config.tool_max_new_tokens))
        return {"steps": steps, "heldout_tool_call_validity": validity, **report(model, tokenizer, config),
                "history": [{"step": s, "heldout_tool_call_validity": v} for s, v in history]}

    return train_and_save(config, directory, lambda: make_model(config, tokenizer), train, save_chat_tokenizer)


SUMMARY_KEYS = ("parameters", "steps", "seconds", "heldout_tool_call_validity", "text_accuracy", "tool_call_validity",
                "tool_call_validity_t1", "accuracy_after_tool")


def summary(record: dict[str, Any]) -> dict[str, Any]:
    """What `policyloop bootstrap --chat` prints of a bootstrap.json record: size, cost, and the
    starting figures (held-out tool-call validity of the stopping evaluation, then the report's:
    text accuracy, tool-call validity greedy and at temperature 1, accuracy after the tool's answer)."""
    return {key: record.get(key) for key in SUMMARY_KEYS}


def make_model(config: ChatBootstrapConfig, tokenizer: Tokenizer) -> Qwen2ForCausalLM:
    return qwen2_model(config, vocab_size=tokenizer.get_vocab_size(), pad_id=tokenizer.token_to_id(END_OF_TEXT),
                       eos_id=tokenizer.token_to_id(IM_END), bos_id=None)


def encode_conversation(tokenizer: Tokenizer, messages: Sequence[dict[str, Any]],
                        tools: Sequence[dict[str, Any]] | None) -> tuple[list[int], list[int]]:
    """(ids, labels) of the rendered conversation: labels are the ids of what the assistant writes
    (each assistant turn's content and its `<|im_end|>`), IGNORE everywhere else."""
    text = render(messages, tools)
    spans, start = [], text.find(ASSISTANT_PREFIX)
    while start >= 0:
        begin = start + len(ASSISTANT_PREFIX)
        end = text.index(IM_END, begin) + len(IM_END)
        spans.append((begin, end))
        start = text.find(ASSISTANT_PREFIX, end)
    encoding = tokenizer.encode(text)
    labels = [token if any(b <= lo and hi <= e for b, e in spans) else IGNORE
              for token, (lo, hi) in zip(encoding.ids, encoding.offsets, strict=True)]
    return encoding.ids, labels


def training_conversations(config: ChatBootstrapConfig, step: int
                           ) -> list[tuple[list[dict[str, Any]], tuple[dict[str, Any], ...] | None]]:
    """Step `step`'s conversations (messages, tools), train split: `batch_size` text questions,
    then `tool_batch_size` tool sessions of `session_questions` questions each."""
    text = tasks(config.batch_size, step_seed(config.seed, step), heldout=False, tool_fraction=0.0, ops=config.ops)
    rng = random.Random(step_seed(config.seed + 1, step))
    chosen = problems(config.tool_batch_size * config.session_questions, step_seed(config.seed + 2, step),
                      heldout=False, ops=config.ops)
    sessions = [tool_session(chosen[i:i + config.session_questions], rng)
                for i in range(0, len(chosen), config.session_questions)]
    return [(t.conversation(), None) for t in text] + [(session_conversation(s), s[0].tools) for s in sessions]


def batch_loss(model: Qwen2ForCausalLM, tokenizer: Tokenizer, config: ChatBootstrapConfig, step: int
               ) -> torch.Tensor:
    """Mean cross-entropy over the assistant tokens of step `step`'s conversations. Text and tool
    conversations go through the model as two right-padded batches, so the short ones are not
    padded to the long ones' length."""
    import torch

    pad = tokenizer.token_to_id(END_OF_TEXT)
    encoded = [encode_conversation(tokenizer, messages, tools)
               for messages, tools in training_conversations(config, step)]
    groups = [encoded[:config.batch_size], encoded[config.batch_size:]]
    total = torch.zeros(())
    count = 0
    for group in (g for g in groups if g):
        width = max(len(ids) for ids, _ in group)
        input_ids = torch.tensor([ids + [pad] * (width - len(ids)) for ids, _ in group])
        labels = torch.tensor([lab + [IGNORE] * (width - len(lab)) for _, lab in group])
        attention_mask = (torch.arange(width) < torch.tensor([[len(ids)] for ids, _ in group])).long()
        hidden = model.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        # The output layer only where a label is: a fifth of the positions, a quarter of the step saved.
        predicts = labels[:, 1:] != IGNORE
        logits = model.lm_head(hidden[:, :-1][predicts])
        total = total + torch.nn.functional.cross_entropy(logits, labels[:, 1:][predicts], reduction="sum")
        count += int(predicts.sum())
    return total / max(1, count)


def complete(model: Qwen2ForCausalLM, tokenizer: Tokenizer, prompts: Sequence[str], max_new_tokens: int, *,
             temperature: float = 0.0, seed: int = 0, batch: int = 64) -> list[Completion]:
    """The assistant turns the model writes after rendered prompts (ending at `<|im_end|>`), in
    batches of `batch` prompts of similar length."""
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    encoded = {i: tokenizer.encode(prompts[i]).ids for i in order}
    out: dict[int, Completion] = {}
    rng = seeded_generator(seed)
    for start in range(0, len(order), batch):
        chunk = order[start:start + batch]
        done = generate_ids(model, [encoded[i] for i in chunk], max_new_tokens,
                            pad_id=tokenizer.token_to_id(END_OF_TEXT), eos_id=tokenizer.token_to_id(IM_END),
                            decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=False),
                            temperature=temperature, generator=rng)
        out.update(zip(chunk, done, strict=True))
    return [out[i] for i in range(len(prompts))]


def text_accuracy(model: Qwen2ForCausalLM, tokenizer: Tokenizer, questions: Sequence[ChatTask], max_new_tokens: int,
                  *, temperature: float = 0.0, seed: int = 0) -> float:
    """Share of text questions whose answer ends with the right number (chat_tasks.text_correct)."""
    prompts = [render(t.messages, t.tools, add_generation_prompt=True) for t in questions]
    done = complete(model, tokenizer, prompts, max_new_tokens, temperature=temperature, seed=seed)
    return sum(text_correct(c.text, c.finished_by_stop, t.problem) for c, t in zip(done, questions, strict=True)) \
        / len(questions)


def tool_call_validity(model: Qwen2ForCausalLM, tokenizer: Tokenizer, questions: Sequence[ChatTask],
                       max_new_tokens: int, *, temperature: float = 0.0, seed: int = 0) -> float:
    """Share of tool questions whose first assistant turn is the right call (chat_tasks.tool_call_valid)."""
    prompts = [render(t.messages, t.tools, add_generation_prompt=True) for t in questions]
    done = complete(model, tokenizer, prompts, max_new_tokens, temperature=temperature, seed=seed)
    return sum(tool_call_valid(c.text, c.finished_by_stop, t) for c, t in zip(done, questions, strict=True)) \
        / len(questions)


def accuracy_after_tool(model: Qwen2ForCausalLM, tokenizer: Tokenizer, questions: Sequence[ChatTask],
                        max_new_tokens: int) -> float:
    """Given the right call and the tool's answer, share of final answers with the right number."""
    prompts = [render(t.after_tool(), t.tools, add_generation_prompt=True) for t in questions]
    done = complete(model, tokenizer, prompts, max_new_tokens)
    return sum(text_correct(c.text, c.finished_by_stop, t.problem) for c, t in zip(done, questions, strict=True)) \
        / len(questions)


def report(model: Qwen2ForCausalLM, tokenizer: Tokenizer, config: ChatBootstrapConfig) -> dict[str, Any]:
    """The starting figures on fresh held-out problems: greedy (and temperature-1, as RL samples)
    text accuracy and tool-call validity, and greedy accuracy after the tool's answer."""
    count = config.report_problems
    text = tasks(count, config.seed + 1, heldout=True, tool_fraction=0.0, ops=config.ops)
    tool = tasks(count, config.seed + 2, heldout=True, tool_fraction=1.0, ops=config.ops)
    return {
        "report_problems": count,
        "text_accuracy": text_accuracy(model, tokenizer, text, config.max_new_tokens),
        "text_accuracy_t1": text_accuracy(model, tokenizer, text, config.max_new_tokens, temperature=1.0,
                                          seed=config.seed),
        "tool_call_validity": tool_call_validity(model, tokenizer, tool, config.tool_max_new_tokens),
        "tool_call_validity_t1": tool_call_validity(model, tokenizer, tool, config.tool_max_new_tokens,
                                                    temperature=1.0, seed=config.seed + 1),
        "accuracy_after_tool": accuracy_after_tool(model, tokenizer, tool, config.max_new_tokens),
    }
