"""The episode seam: one loop drives every kind of episode, from a single completion to a
multi-turn environment.

An `Episode` is opened for one sample of a task. The loop gives it each model turn (the tokens
the engine produced, decoded) and gets back an `Observation`: tokens to append before the model
goes on (a tool's result, an environment's next message), an optional reward for the step the
model just took, and whether the episode is done. A single completion is the episode that is done
after its first turn (`SingleTurn`); the python tool's episodes (envs/tool_episodes.py) are another
implementation, and environments users bring are more.

The loop keeps the tokens exact: each model turn is the engine's output ids, continued from the
whole transcript's ids, never re-tokenized; observation tokens carry loss mask False and
logprob 0, filed under the version of the model turn before them. Episodes run in lockstep: each
round is one engine call for every episode still going (SGLang's batch form), so a group of
single completions is one call, as before. A turn's budget is what is left of the request's
`max_new_tokens` (counted over model tokens only); `max_turns` caps the model turns.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from policyloop.contracts.v1 import bus_pb2
from policyloop.engines.partial import Completion, join
from policyloop.engines.protocol import GenerateRequest, GenerateResult
from policyloop.telemetry import tracing

TURN_SEED_STRIDE = 7_919  # turn k of a seeded sample draws with seed + k × stride

GenerateBatch = Callable[[list[GenerateRequest]], Awaitable[list[Completion]]]


@dataclass(frozen=True)
class ModelTurn:
    """What the model wrote in one turn."""
    index: int                        # 0 for the episode's first turn
    result: GenerateResult            # the engine's answer (output ids, logprobs, finish)
    text: str                         # its ids decoded, stop ids left out
    final: bool = False               # the loop ends the episode after it (max_turns, token budget):
                                      # give its reward, run nothing


@dataclass(frozen=True)
class Observation:
    """What the episode answers a model turn with."""
    token_ids: tuple[int, ...] = ()   # appended to the transcript, loss mask False
    turn: bus_pb2.Turn | None = None  # how those tokens are recorded (role, tool, status, text)
    reward: float | None = None       # the environment's reward for the model turn just taken
    done: bool = False


class Episode(Protocol):
    """One sample's episode."""

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """Token ids that end a model turn besides the request's own (a tool call's closing marker)."""
        ...

    async def step(self, turn: ModelTurn) -> Observation:
        """The model's turn; what follows it."""
        ...


class SingleTurn:
    """One completion: done after the first model turn."""

    stop_token_ids: tuple[int, ...] = ()

    async def step(self, turn: ModelTurn) -> Observation:
        return Observation(done=True)


@dataclass
class EpisodeResult:
    """An episode as one response: every token with its logprob, version and loss mask."""
    result: GenerateResult            # all response tokens, joined (observation tokens: logprob 0)
    loss_mask: list[bool]             # False on observation tokens
    turns: list[bus_pb2.Turn]         # model turns (with their step rewards) and observations

    @property
    def step_rewards(self) -> list[float]:
        return [t.reward for t in self.turns if t.role == bus_pb2.Turn.ROLE_MODEL and t.HasField("reward")]


@dataclass
class _Progress:
    request: GenerateRequest
    episode: Episode
    budget: int | None
    response: list[int] = field(default_factory=list)
    pieces: list[GenerateResult] = field(default_factory=list)
    mask: list[bool] = field(default_factory=list)
    turns: list[bus_pb2.Turn] = field(default_factory=list)
    done: bool = False

    def turn_request(self, turn: int) -> GenerateRequest:
        """Turn 0 is the request itself; a later turn continues the transcript with what is left of
        the budget and a seed of its own. Every turn also stops on the episode's stop ids."""
        request, params = self.request, self.request.sampling_params
        update: dict[str, object] = {
            "stop_token_ids": tuple(dict.fromkeys([*params.stop_token_ids, *self.episode.stop_token_ids]))}
        if turn == 0:
            return request.model_copy(update=dict(sampling_params=params.model_copy(update=update)))
        seed = params.sampling_seed
        update |= {"max_new_tokens": self.budget,
                   "sampling_seed": None if seed is None else (seed + turn * TURN_SEED_STRIDE) % (1 << 63)}
        return request.model_copy(update=dict(
            input_ids=list(request.input_ids or []) + self.response,
            rid=f"{request.rid}/t{turn}" if request.rid else None,
            sampling_params=params.model_copy(update=update)))

    def add_model_turn(self, piece: GenerateResult, text: str) -> bus_pb2.Turn:
        start = len(self.response)
        self.response.extend(piece.output_ids)
        self.pieces.append(piece)
        self.mask.extend([True] * len(piece.output_ids))
        if self.budget is not None:
            self.budget -= len(piece.output_ids)
        turn = bus_pb2.Turn(role=bus_pb2.Turn.ROLE_MODEL, start=start, end=len(self.response), text=text)
        self.turns.append(turn)
        return turn

    def add_observation(self, observation: Observation, after: GenerateResult) -> None:
        ids = list(observation.token_ids)
        start = len(self.response)
        self.response.extend(ids)
        self.mask.extend([False] * len(ids))
        # Filed under the version of the model turn before them: masked out of the loss, they
        # only need to keep the spans covering the response.
        self.pieces.append(GenerateResult(rid=after.rid, output_ids=ids, output_logprobs=[0.0] * len(ids),
                                          finish_reason="stop", finish_detail=None,
                                          weight_version=after.weight_version, prompt_tokens=0,
                                          completion_tokens=len(ids), weight_versions=None))
        record = bus_pb2.Turn()
        if observation.turn is not None:
            record.CopyFrom(observation.turn)
        record.start, record.end = start, len(self.response)
        self.turns.append(record)


async def run_episodes(requests: Sequence[GenerateRequest], episodes: Sequence[Episode], *,
                       generate_batch: GenerateBatch, decode: Callable[[Sequence[int]], str],
                       max_turns: int = 1) -> list[EpisodeResult]:
    """Drives each request's episode to its end, all of them in lockstep (one engine call a round).
    `decode` reads a turn's ids (the request's stop ids are left out first)."""
    if len(requests) != len(episodes):
        raise ValueError("one episode per request")
    progress = [_Progress(r, e, r.sampling_params.max_new_tokens) for r, e in zip(requests, episodes, strict=True)]
    for turn in range(max(1, max_turns)):
        live = [p for p in progress if not p.done]
        if not live:
            break
        with tracing.span("model turn", attributes={"policyloop.turn": turn, "policyloop.episodes": len(live)}) as made:
            completions = await generate_batch([p.turn_request(turn) for p in live])
            made.set_attributes({"policyloop.output_tokens": sum(len(c.result.output_ids) for c in completions)})
        steps = []
        for p, completion in zip(live, completions, strict=True):
            piece = completion.result  # partial-rollout resubmissions are the caller's to count
            stops = p.request.sampling_params.stop_token_ids
            model_turn = p.add_model_turn(piece, decode([t for t in piece.output_ids if t not in stops]))
            p.done = turn + 1 >= max_turns or (p.budget is not None and p.budget <= 0)
            steps.append((p, model_turn, ModelTurn(turn, piece, model_turn.text, final=p.done)))
        observations = await asyncio.gather(*(p.episode.step(seen) for p, _, seen in steps))
        for (p, model_turn, seen), observation in zip(steps, observations, strict=True):
            if observation.reward is not None:
                model_turn.reward = observation.reward
            if observation.done or p.done:
                p.done = True
                continue
            p.add_observation(observation, seen.result)
    return [EpisodeResult(join(p.request, p.pieces), p.mask, p.turns) for p in progress]
