"""Traces as training data: every trace of a served model with the feedback on it, read back from
TRACES and FEEDBACK, and written as JSON lines for supervised fine-tuning (the exact token ids,
so nothing is re-tokenized), optionally only those whose feedback clears a bar; or made an RL
environment whose verifier judges new samples against the recorded outcomes.

An agent session's exchanges are one multi-turn record: each turn's prompt extends the previous
turn's prompt + response, so the session is one token sequence whose loss mask covers what the
model wrote (tool calls included) and nothing else. Where a turn's prompt does not extend the
previous one (the client rewrote history, or tokenized it differently), the session is split
there and the record says why."""

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


def newest_reward(feedback: Iterable[serving_pb2.TraceFeedback]) -> float | None:
    rewards = [f.reward for f in sorted(feedback, key=lambda f: f.created_unix_ms) if f.HasField("reward")]
    return rewards[-1] if rewards else None


@dataclass
class TracedExchange:
    trace: serving_pb2.Trace
    feedback: list[serving_pb2.TraceFeedback] = field(default_factory=list)
    session_feedback: list[serving_pb2.TraceFeedback] = field(default_factory=list)  # on its whole session

    @property
    def reward(self) -> float | None:
        """The newest feedback's reward (None: no reward given)."""
        return newest_reward(self.feedback)


async def read_exchanges(bus: Bus, model: str) -> list[TracedExchange]:
    """Every trace TRACES holds for `model`, oldest first, each with its feedback and its session's."""
    feedback: dict[str, list[serving_pb2.TraceFeedback]] = defaultdict(list)
    on_session: dict[str, list[serving_pb2.TraceFeedback]] = defaultdict(list)
    async for _, msg in bus.read("FEEDBACK", f"{SUBJECT_PREFIX}.feedback.{subject_token(model)}.>"):
        one = serving_pb2.TraceFeedback.FromString(msg.data)
        (feedback[one.trace_id] if one.trace_id else on_session[one.session_id]).append(one)
    exchanges = []
    async for _, msg in bus.read("TRACES", f"{SUBJECT_PREFIX}.traces.{subject_token(model)}.>"):
        trace = serving_pb2.Trace.FromString(msg.data)
        exchanges.append(TracedExchange(trace, feedback.get(trace.trace_id, []),
                                        on_session.get(trace.session_id, []) if trace.session_id else []))
    return exchanges


@dataclass
class SessionSegment:
    """Consecutive exchanges of one session whose tokens continue each other: one sequence."""
    session_id: str
    index: int                       # 0 for the session's start, then one more after each break
    exchanges: list[TracedExchange]
    token_ids: list[int]
    loss_mask: list[bool]            # True where the model wrote the token
    logprobs: list[float]            # the engine's, where the model wrote; 0 elsewhere
    broken_before: str = ""          # why this segment does not continue the one before it

    @property
    def reward(self) -> float | None:
        """Feedback on the session, else on its last exchange."""
        session = newest_reward(self.exchanges[-1].session_feedback)
        return session if session is not None else self.exchanges[-1].reward


def session_segments(exchanges: Iterable[TracedExchange]) -> list[SessionSegment]:
    """The sessions among `exchanges` (first choices of traces with a session id), each cut into
    segments of continuous tokens, in the order of their first exchange."""
    sessions: dict[str, list[TracedExchange]] = defaultdict(list)
    for exchange in exchanges:
        if exchange.trace.session_id and exchange.trace.choice_index == 0:
            sessions[exchange.trace.session_id].append(exchange)
    segments = []
    for session_id, turns in sessions.items():
        turns.sort(key=lambda e: e.trace.created_unix_ms)
        current: SessionSegment | None = None
        for number, exchange in enumerate(turns):
            trace = exchange.trace
            prompt = list(trace.prompt_token_ids)
            if current is not None and prompt[:len(current.token_ids)] == current.token_ids:
                new = prompt[len(current.token_ids):]
                current.exchanges.append(exchange)
            else:
                why = "" if current is None else (f"turn {number}'s prompt does not extend the tokens of turns "
                                                  f"before it (history rewritten or tokenized anew)")
                current = SessionSegment(session_id, len([s for s in segments if s.session_id == session_id]),
                                         [exchange], [], [], [], why)
                segments.append(current)
                new = prompt
            response = list(trace.response_token_ids)
            current.token_ids += new + response
            current.loss_mask += [False] * len(new) + [True] * len(response)
            current.logprobs += [0.0] * len(new) + list(trace.response_logprobs or [0.0] * len(response))
    return segments


def session_record(segment: SessionSegment) -> dict[str, Any]:
    """One JSON line: a session's continuous tokens with their loss mask (what the model wrote),
    the turns it holds and why it was cut from the one before, if it was."""
    last = segment.exchanges[-1]
    return {
        "kind": "session", "session_id": segment.session_id, "segment": segment.index,
        "broken_before": segment.broken_before, "model": last.trace.model,
        "trace_ids": [e.trace.trace_id for e in segment.exchanges],
        "weights_versions": sorted({e.trace.weights_version for e in segment.exchanges}),
        "messages": [MessageToDict(m, preserving_proto_field_name=True) for m in last.trace.messages],
        "tool_calls": [[MessageToDict(c) for c in e.trace.response_tool_calls] for e in segment.exchanges],
        "token_ids": segment.token_ids, "loss_mask": [int(m) for m in segment.loss_mask],
        "logprobs": [round(lp, 6) for lp in segment.logprobs], "reward": segment.reward,
        "feedback": [MessageToDict(f, preserving_proto_field_name=True)
                     for e in segment.exchanges for f in e.feedback]
                    + [MessageToDict(f, preserving_proto_field_name=True) for f in last.session_feedback],
    }


def sft_record(exchange: TracedExchange) -> dict[str, Any]:
    """One JSON line: the prompt and response token ids the engine read and wrote, their text,
    the weights version, and the feedback (a correction, when given, is the better response)."""
    trace = exchange.trace
    return {
        "kind": "exchange", "trace_id": trace.trace_id, "model": trace.model, "endpoint": trace.endpoint,
        "weights_version": trace.weights_version, "messages": [MessageToDict(m) for m in trace.messages],
        "prompt": trace.prompt_text, "prompt_token_ids": list(trace.prompt_token_ids),
        "response": trace.response_text, "response_token_ids": list(trace.response_token_ids),
        "response_logprobs": [round(lp, 6) for lp in trace.response_logprobs],
        "finish_reason": trace.finish_reason, "reward": exchange.reward,
        "feedback": [MessageToDict(f, preserving_proto_field_name=True) for f in exchange.feedback],
    }


def export_sft(exchanges: Iterable[TracedExchange], path: Path, *, min_reward: float | None = None) -> int:
    """Writes the exchanges as JSON lines — an agent session's as its continuous segments, any other
    as itself — keeping those with a reward >= min_reward when given; returns how many lines."""
    exchanges = list(exchanges)
    segments = session_segments(exchanges)
    in_sessions = {e.trace.trace_id for s in segments for e in s.exchanges}

    def kept(reward: float | None) -> bool:
        return min_reward is None or (reward is not None and reward >= min_reward)

    records = [sft_record(e) for e in exchanges if e.trace.trace_id not in in_sessions and kept(e.reward)]
    records += [session_record(s) for s in segments if kept(s.reward)]
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as out:
        for record in records:
            out.write(json.dumps(record) + "\n")
    return len(records)


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
    max_new_tokens 0: twice the longest reference response, at least 8.

    Supervised, an agent session rewarded at least `min_reward` is one task instead of its turns:
    its first prompt, and the rest of the session as the demonstration, trained on where the model
    wrote (its loss mask), never on tool results."""
    exchanges = list(exchanges)
    segments = [s for s in session_segments(exchanges) if s.reward is not None and s.reward >= min_reward] \
        if supervised else []
    in_sessions = {e.trace.trace_id for s in segments for e in s.exchanges}
    by_prompt: dict[tuple[int, ...], tuple[TracedExchange, Outcome]] = {}
    for exchange in exchanges:
        if exchange.trace.trace_id in in_sessions:
            continue
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
    for segment in segments:
        first = segment.exchanges[0].trace
        start = len(first.prompt_token_ids)
        longest = max(longest, max(len(e.trace.response_token_ids) for e in segment.exchanges))
        env.tasks.append(loop_pb2.TaskSpec(
            prompt_token_ids=segment.token_ids[:start], prompt_text=first.prompt_text,
            demonstration_token_ids=segment.token_ids[start:], demonstration_loss_mask=segment.loss_mask[start:],
            metadata={"session_id": segment.session_id, "segment": str(segment.index),
                      "trace_ids": ",".join(e.trace.trace_id for e in segment.exchanges)}))
    env.sampling.max_new_tokens = max_new_tokens or max(8, 2 * longest)
    return env
