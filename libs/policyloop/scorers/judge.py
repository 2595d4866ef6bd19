"""The judge scorer: an LLM judge's verdict on a sample, from any OpenAI-compatible chat endpoint
(the cluster's own serving replica or an external one), asked through the official `openai`
client, greedy, with a bounded concurrency, a timeout and retries. Its reply is cached by all that
was sent (Redis, shared by the replicas), so a redelivered sample is not judged twice; a judge
that fails or times out fails the scoring with the reason (retried, then dead-lettered), and a
reply that holds no verdict dead-letters the sample with the reply — never a reward of zero."""

from __future__ import annotations

import asyncio
import json
import math
import re
import time
from collections.abc import Mapping
from typing import Any, Protocol

import xxhash

from policyloop.contracts.v1 import bus_pb2
from policyloop.scorers.answer import answer_text
from policyloop.scorers.score import Score, UnscorableTrajectory, component
from policyloop.scorers.settings import JudgeEndpoint, JudgeSettings, ScorerContext
from policyloop.telemetry.metrics import JUDGE_REQUESTS, JUDGE_SECONDS

_SPEC = bus_pb2.JudgeScorer
DEFAULT_MAX_TOKENS = 64
DEFAULT_JSON_FIELD = "score"
PLACEHOLDERS = ("{prompt}", "{response}", "{answer}")
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


class JudgeUnavailable(RuntimeError):
    """The judge gave no reply (unreachable, timed out, overloaded): the scoring is retried later."""


class ReplyCache(Protocol):
    async def get(self, key: str) -> str | None: ...

    async def put(self, key: str, reply: str) -> None: ...


class RedisReplyCache:
    """Replies in Redis under `<namespace>:judge:<key>`, kept `ttl_s`."""

    def __init__(self, redis: Any, namespace: str, ttl_s: float) -> None:
        self.redis = redis
        self.prefix = f"{namespace}:judge:"
        self.ttl_ms = int(ttl_s * 1000)

    async def get(self, key: str) -> str | None:
        value = await self.redis.get(self.prefix + key)
        return value.decode() if isinstance(value, bytes) else value

    async def put(self, key: str, reply: str) -> None:
        await self.redis.set(self.prefix + key, reply, px=self.ttl_ms)


class MemoryReplyCache:
    """Replies in this process (a service without Redis; tests)."""

    def __init__(self) -> None:
        self.replies: dict[str, str] = {}

    async def get(self, key: str) -> str | None:
        return self.replies.get(key)

    async def put(self, key: str, reply: str) -> None:
        self.replies[key] = reply


def verdict_kinds() -> list[str]:
    """The judge's verdict kinds, by the names people give them ("number", "label", "json")."""
    return [n.removeprefix("VERDICT_").lower() for n in _SPEC.Verdict.keys() if not n.endswith("UNSPECIFIED")]


def judge_spec(judge: str, template: str, *, model: str = "", verdict_kind: str = "number",
               labels: Mapping[str, float] | None = None, json_field: str = "", min_score: float = 0.0,
               max_score: float = 0.0, max_tokens: int = 0, timeout_s: float = 0.0) -> bus_pb2.JudgeScorer:
    """A judge scorer from people's terms (the CLI's flags)."""
    if verdict_kind not in verdict_kinds():
        raise ValueError(f"verdict must be one of {', '.join(verdict_kinds())}, got {verdict_kind!r}")
    return _SPEC(judge=judge, model=model, template=template, verdict=_SPEC.Verdict.Value(
        f"VERDICT_{verdict_kind.upper()}"), labels=dict(labels or {}), json_field=json_field, min_score=min_score,
        max_score=max_score, max_tokens=max_tokens, timeout_seconds=timeout_s)


def judge_prompt(template: str, traj: bus_pb2.Trajectory) -> str:
    """The template with the sample's prompt, response (the model's last turn) and the task's answer."""
    values = {"{prompt}": traj.prompt_text, "{response}": answer_text(traj), "{answer}": traj.scorer.answer}
    return re.sub("|".join(re.escape(p) for p in PLACEHOLDERS), lambda m: values[m.group(0)], template)


def reply_key(judge: str, model: str, content: str, max_tokens: int) -> str:
    """The cache key of a judgement: everything that decides the reply."""
    sent = json.dumps([judge, model, content, max_tokens], ensure_ascii=False)
    return xxhash.xxh3_128_hexdigest(sent.encode())


def _in_range(spec: bus_pb2.JudgeScorer, value: float) -> float:
    if spec.max_score > spec.min_score:
        return min(1.0, max(0.0, (value - spec.min_score) / (spec.max_score - spec.min_score)))
    return value


def _label(spec: bus_pb2.JudgeScorer, text: str) -> float | None:
    """The value of the label the text says first (a whole word, any case)."""
    found = [(m.start(), value) for label, value in spec.labels.items()
             if (m := re.search(rf"(?<!\w){re.escape(label)}(?!\w)", text, re.IGNORECASE)) is not None]
    return min(found)[1] if found else None


def _json_object(reply: str) -> dict[str, Any] | None:
    decoder = json.JSONDecoder()
    for start in (m.start() for m in re.finditer(r"\{", reply)):
        try:
            value, _ = decoder.raw_decode(reply, start)
        except ValueError:
            continue
        if isinstance(value, dict):
            return value
    return None


def verdict(spec: bus_pb2.JudgeScorer, reply: str) -> float:
    """The reward a judge's reply gives; UnscorableTrajectory naming what is missing."""
    kind = spec.verdict or _SPEC.VERDICT_NUMBER
    if kind == _SPEC.VERDICT_LABEL:
        value = _label(spec, reply)
        if value is None:
            raise UnscorableTrajectory(f"judge {spec.judge!r}: the reply names none of the labels "
                                       f"{sorted(spec.labels)}: {reply[:200]!r}")
        return value
    if kind == _SPEC.VERDICT_JSON:
        field = spec.json_field or DEFAULT_JSON_FIELD
        found = _json_object(reply)
        if found is None or field not in found:
            raise UnscorableTrajectory(f"judge {spec.judge!r}: the reply holds no JSON object with {field!r}: "
                                       f"{reply[:200]!r}")
        value = found[field]
        if isinstance(value, str) and spec.labels:
            labelled = _label(spec, value)
            if labelled is not None:
                return labelled
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise UnscorableTrajectory(f"judge {spec.judge!r}: {field!r} is {value!r}, not a number"
                                       + (" or a label" if spec.labels else ""))
        return _in_range(spec, float(value))
    number = _NUMBER.search(reply)
    if number is None:
        raise UnscorableTrajectory(f"judge {spec.judge!r}: the reply holds no number: {reply[:200]!r}")
    return _in_range(spec, float(number.group(0)))


class Judge:
    """One endpoint: its client (retries inside the timeout) and its concurrency."""

    def __init__(self, name: str, endpoint: JudgeEndpoint, settings: JudgeSettings) -> None:
        from openai import AsyncOpenAI

        self.name = name
        self.default_model = endpoint.model
        self.client = AsyncOpenAI(base_url=endpoint.base_url, api_key=endpoint.key(), max_retries=settings.retries)
        self.gate = asyncio.Semaphore(settings.concurrency)

    async def ask(self, model: str, content: str, max_tokens: int, timeout_s: float) -> str:
        import openai

        started = time.monotonic()
        try:
            async with self.gate:
                answer = await asyncio.wait_for(self.client.chat.completions.create(
                    model=model, messages=[{"role": "user", "content": content}], max_tokens=max_tokens,
                    temperature=0.0), timeout_s)
        except TimeoutError:
            JUDGE_REQUESTS.labels(self.name, "timeout").inc()
            raise JudgeUnavailable(f"judge {self.name!r}: no reply within {timeout_s:g} s") from None
        except (openai.BadRequestError, openai.UnprocessableEntityError, openai.NotFoundError) as exc:
            JUDGE_REQUESTS.labels(self.name, "refused").inc()
            raise UnscorableTrajectory(f"judge {self.name!r} refused the request: {exc}") from None
        except openai.OpenAIError as exc:  # connection, timeouts, 5xx, 429, a bad key: the endpoint's side
            JUDGE_REQUESTS.labels(self.name, "unavailable").inc()
            raise JudgeUnavailable(f"judge {self.name!r}: {type(exc).__name__}: {exc}") from None
        JUDGE_SECONDS.labels(self.name).observe(time.monotonic() - started)
        JUDGE_REQUESTS.labels(self.name, "asked").inc()
        return answer.choices[0].message.content or ""

    async def close(self) -> None:
        await self.client.close()


class JudgeScorer:
    """Scores through the judge a trajectory's scorer names, its replies cached."""

    def __init__(self, judges: Mapping[str, Judge], cache: ReplyCache, default_timeout_s: float) -> None:
        self.judges = dict(judges)
        self.cache = cache
        self.default_timeout_s = default_timeout_s

    async def score(self, traj: bus_pb2.Trajectory) -> Score:
        spec = traj.scorer.judge
        judge = self.judges.get(spec.judge)
        if judge is None:  # another replica may reach it: retried, then dead-lettered with this
            reached = ", ".join(sorted(self.judges)) or "none"
            raise JudgeUnavailable(f"scorer.judge.judge: {spec.judge!r} is not a judge this replica reaches "
                                   f"(judges.endpoints: {reached})")
        model = spec.model or judge.default_model
        if not model:
            raise UnscorableTrajectory(f"scorer.judge.model: judge {spec.judge!r} has no default model: name one")
        content = judge_prompt(spec.template, traj)
        max_tokens = spec.max_tokens or DEFAULT_MAX_TOKENS
        key = reply_key(spec.judge, model, content, max_tokens)
        reply = await self.cache.get(key)
        if reply is None:
            reply = await judge.ask(model, content, max_tokens, spec.timeout_seconds or self.default_timeout_s)
            await self.cache.put(key, reply)
        else:
            JUDGE_REQUESTS.labels(spec.judge, "cached").inc()
        reward = verdict(spec, reply)
        return reward, [component("judge", reward, 1.0, f"{spec.judge}: {reply[:120]!r}")]

    async def close(self) -> None:
        for judge in self.judges.values():
            await judge.close()


def judge_scorer(context: ScorerContext) -> JudgeScorer:
    """The scorer of the judges in the settings; replies cached in Redis when the service has it."""
    judges = context.settings.judges
    cache: ReplyCache = RedisReplyCache(context.redis, context.namespace, judges.cache_ttl_s) \
        if context.redis is not None else MemoryReplyCache()
    return JudgeScorer({name: Judge(name, endpoint, judges) for name, endpoint in judges.endpoints.items()},
                       cache, judges.timeout_s)
