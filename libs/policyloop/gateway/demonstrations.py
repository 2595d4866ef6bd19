"""Supervised environments: tasks that carry the response to imitate. The gateway checks them and
turns text into the model's token ids when the environment is submitted, so that what is stored —
and what every run feeds to the learner — is exact ids, the same on every replay."""

from __future__ import annotations

from collections.abc import Sequence

from policyloop.contracts.v1 import loop_pb2
from policyloop.gateway.errors import InvalidField
from policyloop.gateway.model_context import ModelContext


def validate_demonstrations(env: loop_pb2.Environment) -> None:
    """A supervised environment is single-turn and each training task gives its demonstration as
    token ids or as text (one of them); no other task carries a demonstration."""
    lists = (("tasks", env.tasks), ("eval_tasks", env.eval_tasks)) if not env.supervised else (
        ("eval_tasks", env.eval_tasks),)
    for name, tasks in lists:
        for i, task in enumerate(tasks):
            given = "demonstration_token_ids" if task.demonstration_token_ids else "demonstration_text"
            if task.demonstration_token_ids or task.demonstration_text:
                raise InvalidField(f"environment.{name}[{i}].{given}",
                                   "only a supervised environment's training tasks take demonstrations (eval "
                                   "tasks are sampled and scored)")
    if not env.supervised:
        return
    if env.max_turns > 1:
        raise InvalidField("environment.max_turns", "a supervised environment is single-turn")
    for i, task in enumerate(env.tasks):
        field = f"environment.tasks[{i}]"
        if task.demonstration_token_ids and task.demonstration_text:
            raise InvalidField(f"{field}.demonstration_text",
                               "give the demonstration as token ids or as text, not both")
        if not task.demonstration_token_ids and not task.demonstration_text:
            raise InvalidField(f"{field}.demonstration_text", "a supervised task needs a demonstration")
        if any(t < 0 for t in task.demonstration_token_ids):
            raise InvalidField(f"{field}.demonstration_token_ids", "token ids must not be negative")
        mask = task.demonstration_loss_mask
        if mask and len(mask) != len(task.demonstration_token_ids):
            raise InvalidField(f"{field}.demonstration_loss_mask",
                               f"one value per demonstration token id: {len(mask)} for "
                               f"{len(task.demonstration_token_ids)}")
        if mask and not any(mask):
            raise InvalidField(f"{field}.demonstration_loss_mask", "trains on no token")


def tokenize_demonstrations(env: loop_pb2.Environment, model: ModelContext | None) -> None:
    """Gives every training task of a supervised environment its prompt and demonstration as token
    ids: text is tokenized as the rollout tokenizes prompts (no special tokens), and a text
    demonstration ends with the model's end-of-sequence token, so that the policy learns to stop."""
    if not env.supervised:
        return
    needs_text = [i for i, t in enumerate(env.tasks) if t.demonstration_text or not t.prompt_token_ids]
    if not needs_text:
        return
    if model is None or model.tokenizer is None:
        i = needs_text[0]
        field = "demonstration_text" if env.tasks[i].demonstration_text else "prompt_text"
        raise InvalidField(f"environment.tasks[{i}].{field}", "the gateway has no tokenizer for the model: give "
                                                              "token ids (prompt_token_ids, demonstration_token_ids)")
    prompts = [i for i in needs_text if not env.tasks[i].prompt_token_ids]
    for i, ids in zip(prompts, _encode(model, [env.tasks[i].prompt_text for i in prompts]), strict=True):
        if not ids:
            raise InvalidField(f"environment.tasks[{i}].prompt_text", "the model's tokenizer gives no tokens for it")
        env.tasks[i].prompt_token_ids.extend(ids)
    texts = [i for i in needs_text if env.tasks[i].demonstration_text]
    ending = [model.eos_token_id] if model.eos_token_id is not None else []
    for i, ids in zip(texts, _encode(model, [env.tasks[i].demonstration_text for i in texts]), strict=True):
        env.tasks[i].demonstration_token_ids.extend(ids + ending)
        if not env.tasks[i].demonstration_token_ids:
            raise InvalidField(f"environment.tasks[{i}].demonstration_text", "the model's tokenizer gives no tokens")


def check_demonstrations_fit(env: loop_pb2.Environment, model: ModelContext) -> None:
    """Each prompt with its demonstration fits the model's context; every id is in its vocabulary."""
    for i, task in enumerate(env.tasks):
        field = f"environment.tasks[{i}].demonstration_token_ids"
        top = max([*task.prompt_token_ids, *task.demonstration_token_ids], default=0)
        if model.vocab_size is not None and top >= model.vocab_size:
            raise InvalidField(field, f"token id {top} is outside the model's vocabulary of {model.vocab_size}")
        length = len(task.prompt_token_ids) + len(task.demonstration_token_ids)
        if model.context_tokens is not None and length > model.context_tokens:
            raise InvalidField(field, f"the prompt and demonstration are {length} tokens, more than the model's "
                                      f"context of {model.context_tokens} ({model.path})")


def _encode(model: ModelContext, texts: Sequence[str]) -> list[list[int]]:
    encoded = model.tokenizer.encode_batch(list(texts), add_special_tokens=False)
    return [list(e.ids) for e in encoded]
