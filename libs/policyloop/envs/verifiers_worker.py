"""Runs a `verifiers` environment inside a sandbox session (the session has the system's Python,
the environment's files and its dependencies, verifiers among them, mounted read-only; nothing of
policyloop).

    python3 -I verifiers_worker.py ENVIRONMENT_ID ARGUMENTS_JSON

The environment drives the episode, as verifiers environments do: `vf.load_environment(id,
**arguments)` makes it, and its own `rollout` runs on the task's dataset row with an OpenAI client
whose transport is this session's channel (the session has no network). Each chat completion it
asks for becomes the answer to the replica's last request — the conversation's new messages — and
the replica's next request, the model's turn, becomes the completion it gets back. When the
rollout ends, its rubric scores it and the last answer carries the reward with `done`.

Lines are policyloop.v1.EnvRequest / EnvReply in protobuf's JSON form, as for programs
(program_worker.py). The conversation only grows: the replica keeps the model's tokens exactly as
they were sampled, so an environment that rewrites earlier messages fails with that reason.
"""

import asyncio
import json
import os
import sys
import time
import traceback

PACKAGE_DIR = "env"      # the environment's own files, below the session's scratch directory
DEPENDENCIES = "/deps/site-packages"  # verifiers and what the environment requires, installed by the sandbox
ROLES = ("system", "user", "tool")
MODEL = "policyloop"     # the model name the environment's client sends (the replica ignores it)


class Malformed(ValueError):
    """A request, a row or a message that is not what the protocol says."""


class RolloutFailed(RuntimeError):
    """The environment's rollout ended in an error that is not the model's."""


def text_of(content):
    """A message's content as text (verifiers may send a list of parts)."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    raise Malformed(f"a message's content is text or a list of parts, not {type(content).__name__}")


def env_messages(messages):
    out = []
    for message in messages:
        if message.get("role") not in ROLES:
            raise Malformed(f"the environment added a {message.get('role')!r} message; it may add {ROLES}")
        out.append({"role": message["role"], "content": text_of(message.get("content"))})
    return out


class Conversation:
    """The messages the replica has, to find what each new request adds."""

    def __init__(self):
        self.roles = None

    def added(self, messages):
        """The messages of `messages` the replica has not seen: after the model's last turn."""
        roles = [m.get("role") for m in messages]
        if self.roles is None:
            self.roles = roles
            return env_messages(messages)
        seen = len(self.roles)
        if roles[:seen] != self.roles or len(roles) <= seen or roles[seen] != "assistant":
            raise Malformed("the environment rewrote the conversation: its requests must extend the last one "
                            "with the model's turn and what follows it")
        self.roles = roles
        return env_messages(messages[seen + 1:])


def completion(action, turn):
    """The chat completion the environment's client gets for the model's turn."""
    calls = [{"id": f"call_{turn}_{i}", "type": "function",
              "function": {"name": call.get("name", ""), "arguments": call.get("arguments_json") or "{}"}}
             for i, call in enumerate(action.get("tool_calls", []))]
    message = {"role": "assistant", "content": action.get("content", "")}
    if calls:
        message["tool_calls"] = calls
    finish = "length" if action.get("truncated") else ("tool_calls" if calls else "stop")
    return {"id": f"policyloop-{turn}", "object": "chat.completion", "created": int(time.time()), "model": MODEL,
            "choices": [{"index": 0, "message": message, "finish_reason": finish}]}


class Channel:
    """The session's lines: requests on stdin, answers on a copy of stdout (the environment's own
    prints go to stderr, so that it cannot forge an answer)."""

    def __init__(self):
        self.out = os.fdopen(os.dup(1), "w", buffering=1)
        os.dup2(2, 1)

    async def request(self):
        line = await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
        if not line:
            raise EOFError("the session closed")
        return json.loads(line)

    def answer(self, answer):
        self.out.write(json.dumps(answer) + "\n")


def load(environment_id, arguments_json):
    """verifiers imported and the environment loaded: seconds of CPU, paid once per process."""
    sys.path[:0] = [os.path.join(os.getcwd(), PACKAGE_DIR), *([DEPENDENCIES] if os.path.isdir(DEPENDENCIES) else [])]
    import verifiers as vf

    return vf.load_environment(environment_id, **json.loads(arguments_json))


async def episode(channel, env):
    import httpx  # verifiers' own dependencies
    import verifiers as vf
    from openai import AsyncOpenAI

    first = await channel.request()
    if "reset" not in first:
        raise Malformed("an episode starts with a reset")
    row = json.loads(first["reset"].get("prompt_text") or "{}")
    if not isinstance(row, dict) or "prompt" not in row:
        raise Malformed("a verifiers task's prompt_text is its dataset row: a JSON object with 'prompt'")
    row.setdefault("answer", first["reset"].get("answer", ""))
    row.setdefault("example_id", 0)

    asked = asyncio.Queue()

    class SessionTransport(httpx.AsyncBaseTransport):
        async def handle_async_request(self, request):
            answered = asyncio.get_running_loop().create_future()
            await asyncio.shield(asked.put((json.loads(await request.aread()), answered)))
            return httpx.Response(200, json=await answered)

    client = vf.OpenAIChatCompletionsClient(AsyncOpenAI(
        base_url="http://session.invalid/v1", api_key="session", max_retries=0,
        http_client=httpx.AsyncClient(transport=SessionTransport(), timeout=None)))

    async def rollout():
        state = await env.rollout(row, client, MODEL, {})
        await (env.rubric.score_rollout(state) if env.score_rollouts else env.rubric.dummy_score_rollout(state))
        await env.rubric.cleanup(state)
        return state

    running = asyncio.ensure_future(rollout())
    conversation, turn = Conversation(), 0
    while True:
        next_request = asyncio.ensure_future(asked.get())
        await asyncio.wait({next_request, running}, return_when=asyncio.FIRST_COMPLETED)
        if not next_request.done():
            next_request.cancel()
            state = running.result()
            error = state.get("error")
            if error is not None and not isinstance(error, vf.ModelError):
                raise RolloutFailed(f"{type(error).__name__}: {error}")
            if turn == 0:
                raise RolloutFailed("the rollout ended without asking the model anything")
            channel.answer({"done": True, "reward": float(state.get("reward") or 0.0)})
            # Nothing is left to do: skip the interpreter's teardown of verifiers' imports, which
            # on a loaded machine outlasts the sandbox's grace after the close (then it is killed).
            channel.out.flush()
            os._exit(0)
        body, answered = next_request.result()
        answer = {"messages": conversation.added(body.get("messages", []))}
        if turn == 0:
            answer["tools_json"] = json.dumps(body.get("tools") or [])
        channel.answer(answer)
        request = await channel.request()
        if "action" not in request:
            raise Malformed("after the reset, each request is the model's turn (an action)")
        answered.set_result(completion(request["action"], turn))
        turn += 1


def failure(exc):
    cause = exc.__cause__  # verifiers wraps what the environment raised
    reason = f"{type(exc).__name__}: {exc}" + (f" (from {type(cause).__name__}: {cause})" if cause else "")
    return reason[:2000]


def run(load_environment):
    """One episode on stdin/stdout: its exit code."""
    channel = Channel()
    try:
        asyncio.run(episode(channel, load_environment()))
    except EOFError:
        return 0
    except Exception as exc:  # the environment's failure ends the episode, with its reason
        traceback.print_exc()
        channel.answer({"error": failure(exc)})
        return 1
    return 0


def prepare(environment_id, arguments_json="{}"):
    """For the sandbox's forkserver (sandbox/forkserver.py): the environment loaded once, then an
    episode per forked session."""
    try:
        env = load(environment_id, arguments_json)
    except Exception as exc:
        raise RuntimeError(failure(exc)) from None
    return lambda: run(lambda: env)


def main(environment_id, arguments_json):
    return run(lambda: load(environment_id, arguments_json))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "{}"))
