"""Traces as training data: every trace of a served model with the feedback on it, read back from
TRACES and FEEDBACK, and written as JSON lines for supervised fine-tuning (the exact token ids,
so nothing is re-tokenized), optionally only those whose feedback clears a bar; or made an RL
environment whose verifier judges new samples against the recorded outcomes."""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import xxhash
from google.protobuf.json_format import MessageToDict

from policyloop.bus import Bus
from policyloop.bus.topology import SUBJECT_PREFIX, subject_token
from policyloop.contracts.v1 import bus_pb2, loop_pb2, serving_pb2


@dataclass
class TracedExchange:
    trace: serving_pb2.Trace
    feedback: list[serving_pb2.TraceFeedback] = field(default_factory=list)

    @property
    def reward(self) -> float | None:
        """The newest feedback's reward (None: no reward given)."""
        rewards = [f.reward for f in sorted(self.feedback, key=lambda f: f.created_unix_ms) if f.HasField("reward")]
        return rewards[-1] if rewards else None


async def read_exchanges(bus: Bus, model: str) -> list[TracedExchange]:
    """Every trace TRACES holds for `model`, oldest first, each with its feedback."""
    feedback: dict[str, list[serving_pb2.TraceFeedback]] = defaultdict(list)
    async for _, msg in bus.read("FEEDBACK", f"{SUBJECT_PREFIX}.feedback.{subject_token(model)}.>"):
        one = serving_pb2.TraceFeedback.FromString(msg.data)
        feedback[one.trace_id].append(one)
    exchanges = []
    async for _, msg in bus.read("TRACES", f"{SUBJECT_PREFIX}.traces.{subject_token(model)}.>"):
        trace = serving_pb2.Trace.FromString(msg.data)
        exchanges.append(TracedExchange(trace, feedback.get(trace.trace_id, [])))
    return exchanges


def sft_record(exchange: TracedExchange) -> dict[str, Any]:
    """One JSON line: the prompt and response token ids the engine read and wrote, their text,
    the weights version, and the feedback (a correction, when given, is the better response)."""
    trace = exchange.trace
    return {
        "trace_id": trace.trace_id, "model": trace.model, "endpoint": trace.endpoint,
        "weights_version": trace.weights_version, "messages": [MessageToDict(m) for m in trace.messages],
        "prompt": trace.prompt_text, "prompt_token_ids": list(trace.prompt_token_ids),
        "response": trace.response_text, "response_token_ids": list(trace.response_token_ids),
        "response_logprobs": [round(lp, 6) for lp in trace.response_logprobs],
        "finish_reason": trace.finish_reason, "reward": exchange.reward,
        "feedback": [MessageToDict(f, preserving_proto_field_name=True) for f in exchange.feedback],
    }


def export_sft(exchanges: Iterable[TracedExchange], path: Path, *, min_reward: float | None = None) -> int:
    """Writes the exchanges (with a reward >= min_reward, when given) as JSON lines; returns how many."""
    kept = [e for e in exchanges if min_reward is None or (e.reward is not None and e.reward >= min_reward)]
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as out:
        for exchange in kept:
            out.write(json.dumps(sft_record(exchange)) + "\n")
    return len(kept)


def reference_answer(exchange: TracedExchange, min_reward: float) -> str | None:
    """What a new sample of the exchange's prompt is judged against: the newest correction, else
    the response itself when its newest reward is at least `min_reward`; None when neither."""
    outcome = recorded_outcome(exchange, min_reward)
    return outcome.text if outcome is not None else None


@dataclass(frozen=True)
class Outcome:
    """The answer a prompt should get: a person's correction (text), or the served response that
    earned its reward (the engine's exact token ids)."""
    text: str
    token_ids: tuple[int, ...] = ()  # empty for a correction


def recorded_outcome(exchange: TracedExchange, min_reward: float) -> Outcome | None:
    """The newest correction, else the response when its newest reward is at least `min_reward`
    and it ended by itself (not at its length limit)."""
    ordered = sorted(exchange.feedback, key=lambda f: f.created_unix_ms)
    corrections = [f.correction.strip() for f in ordered if f.correction.strip()]
    if corrections:
        return Outcome(corrections[-1])
    reward = exchange.reward
    trace = exchange.trace
    # A response cut off by its length limit is not an answer to imitate or judge against.
    if reward is not None and reward >= min_reward and trace.response_text.strip() and trace.finish_reason == "stop":
        return Outcome(trace.response_text.strip(), tuple(trace.response_token_ids))
    return None


def in_eval_split(trace_id: str, fraction: float) -> bool:
    """A stable split by the trace id's hash: the same in every process and on every machine."""
    return xxhash.xxh64_intdigest(trace_id.encode()) / 2**64 < fraction


def environment_from_traces(exchanges: Iterable[TracedExchange], name: str, version: str, *,
                            min_reward: float = 1.0, eval_fraction: float = 0.2, group_size: int = 8,
                            temperature: float = 1.0, max_new_tokens: int = 0, supervised: bool = False
                            ) -> loop_pb2.Environment:
    """An environment of the served prompts (the exact token ids the engine read), each with its
    recorded outcome (`recorded_outcome`); exchanges without one are left out, and a prompt seen
    again keeps its newest. RL: the outcome is the reference an exact-answer verifier judges new
    samples against. `supervised`: the outcome is the demonstration to imitate — a rewarded
    response as the engine's exact token ids, a correction as text the gateway tokenizes. Either
    way `eval_fraction` of the prompts (by trace id) become the eval split, judged by exact answer.
    max_new_tokens 0: twice the longest reference response, at least 8."""
    by_prompt: dict[tuple[int, ...], tuple[TracedExchange, Outcome]] = {}
    for exchange in exchanges:
        outcome = recorded_outcome(exchange, min_reward)
        if outcome is not None and exchange.trace.prompt_token_ids:
            by_prompt[tuple(exchange.trace.prompt_token_ids)] = (exchange, outcome)
    env = loop_pb2.Environment(
        name=name, version=version, group_size=group_size, supervised=supervised,
        builtin=loop_pb2.BuiltinVerifier(kind=loop_pb2.BuiltinVerifier.KIND_EXACT_ANSWER),
        sampling=bus_pb2.SamplingParams(temperature=temperature))
    longest = 0
    for exchange, outcome in by_prompt.values():
        trace = exchange.trace
        longest = max(longest, len(trace.response_token_ids))
        task = loop_pb2.TaskSpec(prompt_token_ids=trace.prompt_token_ids, prompt_text=trace.prompt_text,
                                 answer=outcome.text, metadata={"trace_id": trace.trace_id,
                                                                "weights_version": trace.weights_version})
        if in_eval_split(trace.trace_id, eval_fraction):
            env.eval_tasks.append(task)
            continue
        if supervised and outcome.token_ids:
            task.demonstration_token_ids.extend(outcome.token_ids)
        elif supervised:
            task.demonstration_text = outcome.text
        env.tasks.append(task)
    env.sampling.max_new_tokens = max_new_tokens or max(8, 2 * longest)
    return env
