"""Traces as training data: every trace of a served model with the feedback on it, read back from
TRACES and FEEDBACK, and written as JSON lines for supervised fine-tuning (the exact token ids,
so nothing is re-tokenized), optionally only those whose feedback clears a bar."""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from google.protobuf.json_format import MessageToDict

from policyloop.bus import Bus
from policyloop.bus.topology import SUBJECT_PREFIX, subject_token
from policyloop.contracts.v1 import serving_pb2


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
