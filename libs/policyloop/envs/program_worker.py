"""Runs a team's environment class inside a sandbox session (standard library only: the session
has the system's Python and the environment's own files, nothing of policyloop).

    python3 -I program_worker.py module:Class

One request per stdin line, one answer per stdout line, both policyloop.v1.EnvRequest /
EnvReply in protobuf's JSON form (field names as in bus.proto). The class is written as a team
would write a simulator of its business:

    class RefundDesk:
        tools = [...]                            # OpenAI function tools the model may call
        def reset(self, task) -> observation     # task: {"prompt", "answer", "metadata"}
        def step(self, action) -> (observation, reward, done)

`action` has `.text` (what the model wrote), `.content` (its prose), `.tool_calls` (a list with
`.name` and `.arguments`, a dict) and `.truncated`. An observation is a string (a tool message
when the model called tools, else a user message), a list of {"role", "content"} messages, or
None. What the program prints goes to its stderr, so that it cannot forge an answer. A failure
(an exception, a malformed return) is answered with `error` and ends the worker.
"""

import json
import os
import sys
import traceback
from dataclasses import dataclass, field
from importlib import import_module

PACKAGE_DIR = "env"      # the program's files, below the session's scratch directory
DEPENDENCIES = "/deps/site-packages"  # its dependencies, installed by the sandbox (read-only), when it has any
ROLES = ("system", "user", "tool")


@dataclass
class ToolCall:
    name: str
    arguments: dict


@dataclass
class Action:
    text: str
    content: str = ""
    tool_calls: list = field(default_factory=list)
    truncated: bool = False


class Malformed(ValueError):
    pass


def messages(observation, called_tools):
    if observation is None:
        return []
    if isinstance(observation, str):
        return [{"role": "tool" if called_tools else "user", "content": observation}]
    if not isinstance(observation, list):
        raise Malformed(f"an observation is a string, a list of messages or None, not {type(observation).__name__}")
    out = []
    for message in observation:
        if not isinstance(message, dict) or message.get("role") not in ROLES \
                or not isinstance(message.get("content"), str):
            raise Malformed(f"a message is {{'role': one of {ROLES}, 'content': str}}, not {message!r:.200}")
        out.append({"role": message["role"], "content": message["content"]})
    return out


def answer_reset(env, request):
    task = {"prompt": request.get("prompt_text", ""), "answer": request.get("answer", ""),
            "metadata": dict(request.get("metadata", {}))}
    tools = getattr(env, "tools", [])
    return {"messages": messages(env.reset(task), False), "tools_json": json.dumps(list(tools))}


def answer_step(env, request):
    calls = [ToolCall(c.get("name", ""), json.loads(c.get("arguments_json") or "{}"))
             for c in request.get("tool_calls", [])]
    action = Action(text=request.get("text", ""), content=request.get("content", ""), tool_calls=calls,
                    truncated=bool(request.get("truncated", False)))
    returned = env.step(action)
    if not isinstance(returned, tuple) or len(returned) != 3:
        raise Malformed("step returns (observation, reward, done)")
    observation, reward, done = returned
    if reward is not None and (isinstance(reward, bool) or not isinstance(reward, (int, float))):
        raise Malformed(f"a reward is a number or None, not {reward!r:.100}")
    if not isinstance(done, bool):
        raise Malformed(f"done is True or False, not {done!r:.100}")
    answer = {"messages": messages(observation, bool(calls)), "done": done}
    if reward is not None:
        answer["reward"] = float(reward)
    return answer


def main(entry):
    channel = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # the program's prints go to stderr: only this worker writes answers
    sys.path[:0] = [os.path.join(os.getcwd(), PACKAGE_DIR), *([DEPENDENCIES] if os.path.isdir(DEPENDENCIES) else [])]
    env = None
    for line in sys.stdin:
        try:
            request = json.loads(line)
            if env is None:
                module, _, name = entry.partition(":")
                env = getattr(import_module(module), name)()
            if "reset" in request:
                answer = answer_reset(env, request["reset"])
            elif "action" in request:
                answer = answer_step(env, request["action"])
            else:
                raise Malformed("a request is a reset or an action")
        except Exception as exc:  # the program's failure ends the episode, with its reason
            traceback.print_exc()
            channel.write(json.dumps({"error": f"{type(exc).__name__}: {exc}"[:2000]}) + "\n")
            return 1
        channel.write(json.dumps(answer) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
