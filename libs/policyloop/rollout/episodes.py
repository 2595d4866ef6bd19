"""Multi-turn episodes: model turns alternating with tool turns, as one trajectory.

The model writes until it stops; a turn that ends with a tool's closing marker is a call (see
envs/tools.py), which the rollout runs and whose result it appends as a tool turn; the model
then continues from the whole transcript. The episode ends with a model turn that makes no call,
when the model has had `max_turns` turns, or when its token budget (`max_new_tokens`, counted
over model tokens only) is spent.

The result is one response: every model token with its behaviour logprob and version (joined
as in a partial rollout), every tool token with loss_mask False and logprob 0, so the learner
trains on what the policy wrote and never on what the tool printed. The turns record which
tokens are which, with each tool run's status.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from policyloop.contracts.v1 import bus_pb2
from policyloop.engines.partial import Completion, join
from policyloop.engines.protocol import GenerateRequest, GenerateResult
from policyloop.envs.tools import ToolCall, ToolFormat, find_call, result_text, tool_job, wrap_result
from policyloop.sandbox.client import run_in_sandbox
from policyloop.telemetry import tracing

if TYPE_CHECKING:
    from policyloop.bus import Bus

TURN_SEED_STRIDE = 7_919  # turn k of a seeded sample draws with seed + k × stride

Generate = Callable[[GenerateRequest], Awaitable[Completion]]
RunTool = Callable[[ToolCall], Awaitable[tuple[str, str]]]  # → (result text, status)


@dataclass(frozen=True)
class Episode:
    result: GenerateResult           # all response tokens, joined (tool tokens: logprob 0)
    loss_mask: list[bool]            # False on tool tokens
    turns: list[bus_pb2.Turn]


@dataclass(frozen=True)
class Tokenizer:
    """What the episode needs of the model's tokenizer."""
    encode: Callable[[str], list[int]]           # text → ids, no special tokens added
    decode: Callable[[Sequence[int]], str]       # ids → text (stop ids left out by the caller's choice)
    marker_id: Callable[[str], int | None]       # a marker's single token id, None when it has none


def from_hf(tokenizer: Any) -> Tokenizer:
    """The episode's view of a Hugging Face tokenizer (markers are its added tokens)."""
    unknown = {None, tokenizer.unk_token_id}

    def marker_id(marker: str) -> int | None:
        token_id = tokenizer.convert_tokens_to_ids(marker)
        return None if token_id in unknown else int(token_id)

    return Tokenizer(encode=lambda text: list(tokenizer(text, add_special_tokens=False).input_ids),
                     decode=lambda ids: tokenizer.decode(list(ids), skip_special_tokens=True),
                     marker_id=marker_id)


class ToolSetupError(ValueError):
    """The model's tokenizer cannot express a tool's markers as single tokens."""


def close_ids(formats: Sequence[ToolFormat], tokenizer: Tokenizer) -> dict[int, ToolFormat]:
    """The closing-marker token id of each tool (a call ends on it, as a stop token)."""
    out: dict[int, ToolFormat] = {}
    for fmt in formats:
        for marker in fmt.markers:
            if tokenizer.marker_id(marker) is None:
                raise ToolSetupError(f"tools: the model's tokenizer has no single token for {marker!r} "
                                     f"(the {fmt.name} tool needs it)")
        out[int(tokenizer.marker_id(fmt.call_close))] = fmt  # type: ignore[arg-type]
    return out


async def run_episode(request: GenerateRequest, *, generate: Generate, run_tool: RunTool, tokenizer: Tokenizer,
                      formats: Sequence[ToolFormat], max_turns: int, max_tool_tokens: int) -> Episode:
    """Runs model and tool turns from `request` (its prompt, sampling and model-token budget)."""
    calls = close_ids(formats, tokenizer)
    params = request.sampling_params
    stop_ids = tuple(dict.fromkeys([*params.stop_token_ids, *calls]))
    prompt = list(request.input_ids or [])
    budget = params.max_new_tokens
    response: list[int] = []
    pieces: list[GenerateResult] = []
    mask: list[bool] = []
    turns: list[bus_pb2.Turn] = []
    for turn in range(max(1, max_turns)):
        seed = params.sampling_seed
        turn_request = request.model_copy(update=dict(
            input_ids=prompt + response, rid=f"{request.rid}/t{turn}" if request.rid else None,
            sampling_params=params.model_copy(update=dict(
                stop_token_ids=stop_ids,
                max_new_tokens=budget,
                sampling_seed=None if seed is None else (seed + turn * TURN_SEED_STRIDE) % (1 << 63))),
        ))
        with tracing.span("model turn", attributes={"policyloop.turn": turn}) as made:
            completion = await generate(turn_request)
            made.set_attributes({"policyloop.output_tokens": len(completion.result.output_ids),
                                 "policyloop.finish_reason": completion.result.finish_reason or "",
                                 tracing.POLICY_VERSION: completion.result.weight_version or ""})
        piece = completion.result  # partial-rollout resubmissions are the caller's to count
        start = len(response)
        response.extend(piece.output_ids)
        pieces.append(piece)
        mask.extend([True] * len(piece.output_ids))
        if budget is not None:
            budget -= len(piece.output_ids)
        text = tokenizer.decode([t for t in piece.output_ids if t not in params.stop_token_ids])
        turns.append(bus_pb2.Turn(role=bus_pb2.Turn.ROLE_MODEL, start=start, end=len(response), text=text))
        ends_in_call = (piece.finish_reason == "stop" and piece.output_ids and piece.output_ids[-1] in calls)
        if not ends_in_call or turn + 1 >= max_turns or (budget is not None and budget <= 0):
            break
        call = find_call(text, [calls[piece.output_ids[-1]]])
        assert call is not None  # the turn ends with this tool's closing marker
        if call.complete:
            with tracing.span("tool call", attributes={"policyloop.tool": call.tool.name}) as made:
                result, status = await run_tool(call)  # a sandbox job: its span is this one's child
                made.set_attribute("policyloop.tool_status", status)
        else:
            result, status = f"no {call.tool.call_open} before {call.tool.call_close}", "no_call_open"
        tool_ids = tool_turn_ids(call.tool, result, tokenizer, max_tool_tokens)
        start = len(response)
        response.extend(tool_ids)
        mask.extend([False] * len(tool_ids))
        # The tool's tokens are filed under the version of the model turn before them: masked out
        # of the loss, they only need to keep the spans covering the response.
        pieces.append(GenerateResult(rid=piece.rid, output_ids=tool_ids, output_logprobs=[0.0] * len(tool_ids),
                                     finish_reason="stop", finish_detail=None, weight_version=piece.weight_version,
                                     prompt_tokens=0, completion_tokens=len(tool_ids), weight_versions=None))
        turns.append(bus_pb2.Turn(role=bus_pb2.Turn.ROLE_TOOL, start=start, end=len(response), tool=call.tool.name,
                                  status=status, text=result))
    return Episode(join(request, pieces), mask, turns)


def sandbox_tools(bus: Bus, *, job_id: str, run_id: str, timeout_s: float, reply_timeout_s: float,
                  max_chars: int, on_result: Callable[[ToolCall, str], None] | None = None) -> RunTool:
    """Runs each call as a job on the SANDBOX stream (request/reply; any sandbox replica) and
    gives the model what the job printed. A call that gets no result within `reply_timeout_s`
    raises SandboxTimeout: the episode is not finished without its tool's answer."""

    async def run(call: ToolCall) -> tuple[str, str]:
        job = tool_job(call, job_id=job_id, run_id=run_id, timeout_s=timeout_s)
        text, status = result_text(await run_in_sandbox(bus, job, timeout_s=reply_timeout_s), max_chars)
        if on_result is not None:
            on_result(call, status)
        return text, status

    return run


def tool_turn_ids(fmt: ToolFormat, result: str, tokenizer: Tokenizer, max_tool_tokens: int) -> list[int]:
    """The tool turn's tokens: the result markers around the result, cut to `max_tool_tokens`."""
    open_id, close_id = tokenizer.marker_id(fmt.result_open), tokenizer.marker_id(fmt.result_close)
    assert open_id is not None and close_id is not None  # close_ids() checked every marker
    body = tokenizer.encode(result)[: max(0, max_tool_tokens - 2)]
    return [open_id, *body, close_id]


def transcript(turns: Sequence[bus_pb2.Turn], formats: Sequence[ToolFormat]) -> str:
    """The episode as one text: model turns as written, tool results inside their markers."""
    by_name = {f.name: f for f in formats}
    return "".join(wrap_result(by_name[t.tool], t.text) if t.role == bus_pb2.Turn.ROLE_TOOL and t.tool in by_name
                   else t.text for t in turns)
