"""Environments written as programs: a team's class with `reset(task)` and `step(action)` (see
envs/program_worker.py for what it is given and returns), run out of process in a sandbox
session per episode, so that one process keeps the episode's state and no user code runs in a
service.

An episode opens its session and resets it with the task: the answer's messages and tools,
rendered by the model's chat template, are the prompt. Each model turn is parsed by the chat
format's parser (prose and `<tool_call>` blocks) and sent as an EnvAction; the answer gives the
step's reward, whether the episode is done, and the messages that follow, which the chat template
renders into the observation's tokens (loss mask False) with the next assistant header. The
model's own tokens are never re-rendered: an observation starts after the end-of-turn token the
model wrote, with the text the template puts there.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from importlib import resources
from typing import TYPE_CHECKING, Any

from google.protobuf import json_format

from policyloop.contracts.v1 import bus_pb2
from policyloop.envs.episode import ModelTurn, Observation
from policyloop.models.chat_format import parse_assistant
from policyloop.sandbox.session import Session, SessionEnded
from policyloop.telemetry import tracing

if TYPE_CHECKING:
    from policyloop.bus import Bus

WORKER = "program_worker.py"
PACKAGE_DIR = "env"
DEFAULT_STEP_SECONDS = 10.0
DEFAULT_EPISODE_SECONDS = 60.0
SESSION_KIND = "program"


class EnvironmentFailed(RuntimeError):
    """The environment could not go on: it raised, answered something malformed, ran past a
    limit, or its session could not be had. The episode is not trained; its task is retried."""


class NoChatTemplate(ValueError):
    """The model has no chat template: it cannot be given an environment's messages."""


@dataclass(frozen=True)
class ChatTemplate:
    """What an environment's episode needs of the model's chat template and tokenizer."""
    render: Callable[[list[dict[str, Any]], list[dict[str, Any]] | None, bool], str]  # messages, tools, gen. prompt
    encode: Callable[[str], list[int]]   # special tokens in the text are read as such
    end_of_turn: str                     # the text of the token that ends the model's turn
    end_of_turn_id: int


def chat_template(tokenizer: Any) -> ChatTemplate:
    """The chat template of a Hugging Face tokenizer (its eos token ends a turn, as in ChatML)."""
    if not getattr(tokenizer, "chat_template", None):
        raise NoChatTemplate("the model's tokenizer has no chat template: environment programs need a chat model")

    def render(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, generation: bool) -> str:
        return tokenizer.apply_chat_template(messages, tools=tools or None, add_generation_prompt=generation,
                                             tokenize=False)

    return ChatTemplate(render=render, encode=lambda text: list(tokenizer(text, add_special_tokens=False).input_ids),
                        end_of_turn=tokenizer.eos_token, end_of_turn_id=int(tokenizer.eos_token_id))


def program_job(program: bus_pb2.EnvironmentProgram, *, job_id: str, run_id: str) -> bus_pb2.SandboxJob:
    """The session's job: the worker and the program's files, under the program's limits."""
    episode_s = program.episode_seconds or DEFAULT_EPISODE_SECONDS
    files = {WORKER: resources.files("policyloop.envs").joinpath(WORKER).read_bytes()}
    files |= {f"{PACKAGE_DIR}/{path}": content for path, content in program.files.items()}
    return bus_pb2.SandboxJob(
        job_id=job_id, run_id=run_id, files=files, command=["python3", "-I", WORKER, program.entry],
        limits=bus_pb2.SandboxLimits(wall_seconds=episode_s, cpu_seconds=episode_s,
                                     memory_bytes=program.memory_bytes, max_output_bytes=1024 * 1024))


class ProgramClient:
    """Typed requests to the program in a session; its failures become EnvironmentFailed."""

    def __init__(self, session: Session) -> None:
        self.session = session

    async def ask(self, request: bus_pb2.EnvRequest) -> bus_pb2.EnvReply:
        line = json_format.MessageToJson(request, preserving_proto_field_name=True, indent=None).encode()
        kind = request.WhichOneof("kind")
        with tracing.span("environment step", attributes={"policyloop.env_request": kind or ""}) as made:
            try:
                answer = await self.session.step(line)
            except SessionEnded as exc:
                raise EnvironmentFailed(str(exc)) from exc
            except TimeoutError as exc:
                raise EnvironmentFailed(f"no sandbox session: {exc}") from exc
            reply = bus_pb2.EnvReply()
            try:
                json_format.Parse(answer, reply)
            except json_format.ParseError as exc:
                raise EnvironmentFailed(f"a malformed answer to {kind}: {exc}") from exc
            if reply.error:
                raise EnvironmentFailed(f"the environment failed on {kind}: {reply.error}")
            if reply.HasField("reward"):
                made.set_attribute("policyloop.step_reward", reply.reward)
            made.set_attribute("policyloop.done", reply.done)
        return reply


@dataclass
class Opened:
    """What reset gave: the conversation so far and the tools offered."""
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]]


def read_tools(tools_json: str) -> list[dict[str, Any]]:
    try:
        tools = json.loads(tools_json or "[]")
    except ValueError as exc:
        raise EnvironmentFailed(f"tools: not JSON ({exc})") from exc
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise EnvironmentFailed("tools: a list of OpenAI function tools")
    return tools


def as_messages(reply: bus_pb2.EnvReply) -> list[dict[str, Any]]:
    return [{"role": m.role, "content": m.content} for m in reply.messages]


class ProgramEpisode:
    """One sample of a program environment's task, over its session."""

    stop_token_ids: tuple[int, ...] = ()  # a turn ends on the end-of-turn token (the request's eos)

    def __init__(self, client: ProgramClient, template: ChatTemplate) -> None:
        self.client, self.template = client, template
        self.conversation: list[dict[str, Any]] = []
        self.tools: list[dict[str, Any]] = []

    async def open(self, reset: bus_pb2.EnvReset) -> list[int]:
        """Resets the environment with the task; the prompt's token ids."""
        reply = await self.client.ask(bus_pb2.EnvRequest(reset=reset))
        self.conversation, self.tools = as_messages(reply), read_tools(reply.tools_json)
        if not self.conversation:
            raise EnvironmentFailed("reset gave no messages: the model has nothing to answer")
        return self.template.encode(self.template.render(self.conversation, self.tools, True))

    async def step(self, turn: ModelTurn) -> Observation:
        parsed = parse_assistant(turn.text)
        ended = turn.result.finish_reason == "stop" and bool(turn.result.output_ids) \
            and turn.result.output_ids[-1] == self.template.end_of_turn_id
        action = bus_pb2.EnvAction(text=turn.text, content=parsed.content or "", truncated=not ended, tool_calls=[
            bus_pb2.EnvToolCall(name=c.name, arguments_json=c.arguments_json()) for c in parsed.tool_calls])
        reply = await self.client.ask(bus_pb2.EnvRequest(action=action))
        reward = reply.reward if reply.HasField("reward") else None
        if reply.done or turn.final:
            return Observation(reward=reward, done=True)
        assistant: dict[str, Any] = {"role": "assistant", "content": parsed.content or ""}
        if parsed.tool_calls:
            assistant["tool_calls"] = [{"type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                                       for c in parsed.tool_calls]
        before = [*self.conversation, assistant]
        observed = as_messages(reply)
        self.conversation = [*before, *observed]
        text = self.observation_text(before, observed, ended)
        return Observation(tuple(self.template.encode(text)),
                           bus_pb2.Turn(role=bus_pb2.Turn.ROLE_ENVIRONMENT, status="ok", text=text), reward=reward)

    def observation_text(self, before: Sequence[dict[str, Any]], observed: Sequence[dict[str, Any]],
                         ended: bool) -> str:
        """What follows the model's turn: the template's text after its end-of-turn token, the new
        messages, and the next assistant header (a difference of two renderings, so any template
        that renders a conversation as a sequence of turns is read right)."""
        render, end = self.template.render, self.template.end_of_turn
        upto = render(list(before), self.tools, False)
        full = render([*before, *observed], self.tools, True)
        if not full.startswith(upto) or end not in upto:
            raise EnvironmentFailed("the chat template does not render the conversation turn by turn")
        after_end = upto[upto.rindex(end) + len(end):]
        return ("" if ended else end) + after_end + full[len(upto):]


def transcript(turns: Sequence[bus_pb2.Turn]) -> str:
    """The episode as text: the model's turns as written, the observations as rendered."""
    return "".join(t.text for t in turns)


def is_program(task: bus_pb2.Task) -> bool:
    return bool(task.program.entry)


def task_reset(task: bus_pb2.Task | bus_pb2.Trajectory) -> bus_pb2.EnvReset:
    """What reset is given of a task (a rollout's Task, or an eval item's trajectory template)."""
    return bus_pb2.EnvReset(prompt_text=task.prompt_text, answer=task.scorer.answer, metadata=dict(task.metadata))


@asynccontextmanager
async def program_episode(bus: Bus, program: bus_pb2.EnvironmentProgram, reset: bus_pb2.EnvReset, *,
                          template: ChatTemplate, job_id: str, run_id: str, open_timeout_s: float
                          ) -> AsyncIterator[tuple[ProgramEpisode, list[int]]]:
    """An episode of `program` in a sandbox session of its own, reset with `reset`: the episode and
    its prompt's token ids. The session is closed on exit, however the episode ended."""
    job = program_job(program, job_id=job_id, run_id=run_id)
    async with Session(bus, job, kind=SESSION_KIND, step_seconds=program.step_seconds or DEFAULT_STEP_SECONDS,
                       open_timeout_s=open_timeout_s) as session:
        episode = ProgramEpisode(ProgramClient(session), template)
        yield episode, await episode.open(reset)
