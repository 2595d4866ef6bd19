"""Episodes of environments that speak chat: a team's program in a sandbox session, an OpenEnv
server, and the like, each behind an `EnvironmentClient` that answers typed requests (reset, then
one action per model turn) with typed replies (messages, a reward, done).

The episode resets the environment with the task: the answer's messages and tools, rendered by the
model's chat template, are the prompt. Each model turn is parsed by the chat format's parser
(prose and `<tool_call>` blocks) and sent as an EnvAction; the reply gives the step's reward,
whether the episode is done, and the messages that follow, which the chat template renders into
the observation's tokens (loss mask False) with the next assistant header. The model's own tokens
are never re-rendered: an observation starts after the end-of-turn token the model wrote, with
the text the template puts there.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from policyloop.contracts.v1 import bus_pb2
from policyloop.envs.episode import ModelTurn, Observation
from policyloop.models.chat_format import parse_assistant
from policyloop.telemetry import tracing


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


class EnvironmentClient(Protocol):
    """One episode's environment: a reset, then one action per model turn."""

    async def ask(self, request: bus_pb2.EnvRequest) -> bus_pb2.EnvReply:
        """The environment's reply; raises EnvironmentFailed when it cannot go on."""
        ...


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


class EnvironmentEpisode:
    """One sample of an environment's task, over its client."""

    stop_token_ids: tuple[int, ...] = ()  # a turn ends on the end-of-turn token (the request's eos)

    def __init__(self, client: EnvironmentClient, template: ChatTemplate) -> None:
        self.client, self.template = client, template
        self.conversation: list[dict[str, Any]] = []
        self.tools: list[dict[str, Any]] = []

    async def ask(self, request: bus_pb2.EnvRequest) -> bus_pb2.EnvReply:
        """The client's reply, under a span of the sample's trace."""
        kind = request.WhichOneof("kind") or ""
        with tracing.span("environment step", attributes={"policyloop.env_request": kind}) as made:
            reply = await self.client.ask(request)
            if reply.HasField("reward"):
                made.set_attribute("policyloop.step_reward", reply.reward)
            made.set_attribute("policyloop.done", reply.done)
        return reply

    async def open(self, reset: bus_pb2.EnvReset) -> list[int]:
        """Resets the environment with the task; the prompt's token ids."""
        reply = await self.ask(bus_pb2.EnvRequest(reset=reset))
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
        reply = await self.ask(bus_pb2.EnvRequest(action=action))
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


def task_reset(task: bus_pb2.Task | bus_pb2.Trajectory) -> bus_pb2.EnvReset:
    """What reset is given of a task (a rollout's Task, or an eval item's trajectory template)."""
    return bus_pb2.EnvReset(prompt_text=task.prompt_text, answer=task.scorer.answer, metadata=dict(task.metadata))
