"""OpenEnv environments: an environment server the operator runs (Meta / Hugging Face OpenEnv),
driven with the official `openenv` client (pinned in the `openenv` extra). Each episode is one
session, a WebSocket connection of its own, opened for the episode and closed at its end; the
episode itself is envs/chat_env.py's.

reset is given the task's metadata as keyword arguments (a "seed" as a number; the server keeps
those its environment's reset takes), and the task's prompt_text, when it has one, opens the
conversation as a system message. The model's prose is the action's text field; each observation
(one field of it, or all of it as JSON) is a user message, with the reward and done the server
gave for the step.
"""

from __future__ import annotations

import asyncio
import importlib
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from policyloop.contracts.v1 import bus_pb2
from policyloop.envs.chat_env import ChatTemplate, EnvironmentEpisode, EnvironmentFailed

DEFAULT_ACTION_FIELD = "message"
DEFAULT_STEP_SECONDS = 30.0


def reset_arguments(reset: bus_pb2.EnvReset) -> dict[str, Any]:
    arguments: dict[str, Any] = dict(reset.metadata)
    if "seed" in arguments:
        try:
            arguments["seed"] = int(arguments["seed"])
        except ValueError:
            pass
    return arguments


def observation_text(observation: object, field: str) -> str:
    if not field:
        return json.dumps(observation, sort_keys=True, ensure_ascii=False)
    if not isinstance(observation, dict) or field not in observation:
        raise EnvironmentFailed(f"the observation has no field {field!r}: {str(observation)[:200]}")
    value = observation[field]
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


class OpenEnvClient:
    """EnvRequests as OpenEnv resets and steps over one session; its failures become EnvironmentFailed."""

    def __init__(self, client: Any, server: bus_pb2.OpenEnvServer) -> None:
        self.client, self.server = client, server
        self.step_seconds = server.step_seconds or DEFAULT_STEP_SECONDS

    async def ask(self, request: bus_pb2.EnvRequest) -> bus_pb2.EnvReply:
        kind = request.WhichOneof("kind")
        try:
            if kind == "reset":
                result = await asyncio.wait_for(self.client.reset(**reset_arguments(request.reset)), self.step_seconds)
            else:
                action = request.action
                field = self.server.action_field or DEFAULT_ACTION_FIELD
                result = await asyncio.wait_for(self.client.step({field: action.content or action.text}),
                                                self.step_seconds)
        except TimeoutError as exc:
            raise EnvironmentFailed(f"OpenEnv server {self.server.base_url}: no answer to {kind} within "
                                    f"{self.step_seconds}s") from exc
        except Exception as exc:  # noqa: BLE001 - the client raises what its transport does
            raise EnvironmentFailed(f"OpenEnv server {self.server.base_url} failed on {kind}: {exc!r}") from exc
        messages = [bus_pb2.EnvMessage(role="user", content=observation_text(result.observation,
                                                                             self.server.observation_field))]
        if kind == "reset":
            if request.reset.prompt_text:
                messages.insert(0, bus_pb2.EnvMessage(role="system", content=request.reset.prompt_text))
            return bus_pb2.EnvReply(messages=messages, tools_json="[]")
        reply = bus_pb2.EnvReply(messages=messages, done=bool(result.done))
        if result.reward is not None:
            reply.reward = float(result.reward)
        return reply


@asynccontextmanager
async def openenv_episode(server: bus_pb2.OpenEnvServer, reset: bus_pb2.EnvReset, *, template: ChatTemplate
                          ) -> AsyncIterator[tuple[EnvironmentEpisode, list[int]]]:
    """An episode in a session of its own on `server`, reset with `reset`: the episode and its
    prompt's token ids. The session is closed on exit, however the episode ended."""
    # The library loads its server side too (seconds): imported off the event loop, once.
    core = await asyncio.to_thread(importlib.import_module, "openenv.core")
    step_s = server.step_seconds or DEFAULT_STEP_SECONDS
    client = core.GenericEnvClient(base_url=server.base_url, connect_timeout_s=step_s, message_timeout_s=step_s)
    try:
        await client.connect()
    except Exception as exc:  # noqa: BLE001 - unreachable, refused, at capacity
        raise EnvironmentFailed(f"OpenEnv server {server.base_url}: no session ({exc!r})") from exc
    try:
        episode = EnvironmentEpisode(OpenEnvClient(client, server), template)
        yield episode, await episode.open(reset)
    finally:
        try:
            await client.close()
        except Exception:  # noqa: BLE001, S110 - a session already gone is closed
            pass
