"""The python tool's episodes: model turns alternating with tool turns, driven by the one
episode loop (envs/episode.py).

A model turn that ends with a tool's closing marker is a call (see envs/tools.py), which the
episode runs (as a sandbox job) and whose result it answers as an observation, between the
tool's result markers; the model then continues from the whole transcript. The episode ends with
a model turn that makes no call, or when the loop stops it (`max_turns`, the token budget). The
result's tool tokens have loss_mask False and logprob 0, so the learner trains on what the policy
wrote and never on what the tool printed; the turns record which tokens are which, with each tool
run's status.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, Field

from policyloop.contracts.v1 import bus_pb2
from policyloop.envs.episode import ModelTurn, Observation
from policyloop.envs.tools import ToolCall, ToolFormat, find_call, result_text, tool_job, wrap_result
from policyloop.sandbox.client import run_in_sandbox
from policyloop.telemetry import tracing

if TYPE_CHECKING:
    from policyloop.bus import Bus

RunTool = Callable[[ToolCall], Awaitable[tuple[str, str]]]  # → (result text, status)


class ToolSettings(BaseModel):
    """How the python tool's calls run, wherever episodes are driven (rollout replicas, the
    evaluator): fields of those services' settings (`--tool-timeout-s`, POLICYLOOP_TOOL_TIMEOUT_S…)."""

    tool_timeout_s: float = Field(10.0, description="Wall and CPU seconds of one tool call's sandbox job.")
    tool_reply_timeout_s: float = Field(
        120.0, description="How long a tool call waits for a sandbox's result (queueing included) before the task "
                           "is given back to be sampled again.")
    max_tool_tokens: int = Field(64, ge=3, description="Most tokens of one tool turn (its result is cut to fit).")
    max_tool_chars: int = Field(2000, description="Most characters of a tool's result kept before tokenizing.")

    def episode(self, bus: Bus, *, job_id: str, run_id: str, tokenizer: Tokenizer, formats: Sequence[ToolFormat],
                on_result: Callable[[ToolCall, str], None] | None = None) -> ToolEpisode:
        """A tool episode whose calls run as sandbox jobs under these limits."""
        return ToolEpisode(run_tool=sandbox_tools(bus, job_id=job_id, run_id=run_id, timeout_s=self.tool_timeout_s,
                                                  reply_timeout_s=self.tool_reply_timeout_s,
                                                  max_chars=self.max_tool_chars, on_result=on_result),
                           tokenizer=tokenizer, formats=formats, max_tool_tokens=self.max_tool_tokens)


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


class ToolEpisode:
    """A sample of a task that offers tools: each call its turn ends with is run by `run_tool`."""

    def __init__(self, *, run_tool: RunTool, tokenizer: Tokenizer, formats: Sequence[ToolFormat],
                 max_tool_tokens: int) -> None:
        self.calls = close_ids(formats, tokenizer)
        self.run_tool, self.tokenizer, self.max_tool_tokens = run_tool, tokenizer, max_tool_tokens

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        return tuple(self.calls)

    async def step(self, turn: ModelTurn) -> Observation:
        piece = turn.result
        ends_in_call = piece.finish_reason == "stop" and bool(piece.output_ids) and piece.output_ids[-1] in self.calls
        if not ends_in_call or turn.final:
            return Observation(done=True)
        call = find_call(turn.text, [self.calls[piece.output_ids[-1]]])
        assert call is not None  # the turn ends with this tool's closing marker
        if call.complete:
            with tracing.span("tool call", attributes={"policyloop.tool": call.tool.name}) as made:
                result, status = await self.run_tool(call)  # a sandbox job: its span is this one's child
                made.set_attribute("policyloop.tool_status", status)
        else:
            result, status = f"no {call.tool.call_open} before {call.tool.call_close}", "no_call_open"
        return Observation(tuple(tool_turn_ids(call.tool, result, self.tokenizer, self.max_tool_tokens)),
                           bus_pb2.Turn(role=bus_pb2.Turn.ROLE_TOOL, tool=call.tool.name, status=status, text=result))


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
