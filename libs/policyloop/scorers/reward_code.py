"""The reward-code scorer. A team's source defines `reward(prompt, completion, metadata)`
returning a number (or a (number, detail) pair); it runs in the sandbox with the call's
arguments on its stdin: the prompt, the completion, and the task's metadata with its `answer`
(when the task has one). A crash, a timeout or a non-finite value gives reward 0 with the reason
in the breakdown."""

from __future__ import annotations

import json
import math

from policyloop.contracts.code_scorer import REWARD_FUNCTION
from policyloop.contracts.v1 import bus_pb2
from policyloop.scorers.answer import answer_text
from policyloop.scorers.sandboxed import DEFAULT_TIMEOUT_S, CodeJob, code_job, limits, new_nonce, reported, why_stopped
from policyloop.scorers.score import Score, component

_HARNESS = r'''
import json, sys
nonce = sys.stdin.readline().strip()
args = json.loads(sys.stdin.readline())
namespace = {"__name__": "reward_code"}
exec(compile(open("reward.py").read(), "reward.py", "exec"), namespace)
value = namespace[REWARD_FUNCTION](args["prompt"], args["completion"], args["metadata"])
detail = ""
if isinstance(value, (tuple, list)):
    value, detail = value[0], str(value[1])
sys.stdout.write("\n" + nonce + " " + json.dumps({"reward": float(value), "detail": detail[:500]}) + "\n")
'''.replace("REWARD_FUNCTION", repr(REWARD_FUNCTION))


def call_metadata(traj: bus_pb2.Trajectory) -> dict[str, str]:
    """The `metadata` argument of the team's reward function."""
    metadata = dict(traj.metadata)
    if traj.scorer.answer:
        metadata["answer"] = traj.scorer.answer
    return metadata


def reward_code_job(traj: bus_pb2.Trajectory) -> CodeJob:
    scorer = traj.scorer.reward_code
    nonce = new_nonce()
    files = {"reward.py": scorer.source.encode(), "harness.py": _HARNESS.encode()}
    call = {"prompt": traj.prompt_text, "completion": answer_text(traj), "metadata": call_metadata(traj)}
    stdin = nonce + "\n" + json.dumps(call) + "\n"
    return code_job(traj, files, stdin, nonce, limits(scorer.timeout_seconds or DEFAULT_TIMEOUT_S))


def reward_code_score(traj: bus_pb2.Trajectory, job: CodeJob, result: bus_pb2.SandboxResult) -> Score:
    report = reported(result, job.nonce)
    if report is None:
        return 0.0, [component("reward_code", 0.0, 1.0, "the reward code did not return a value"),
                     *why_stopped(result)]
    value = report.get("reward")
    if not isinstance(value, int | float) or not math.isfinite(value):
        return 0.0, [component("reward_code", 0.0, 1.0, f"not a finite number: {value!r}")]
    return float(value), [component("reward_code", float(value), 1.0, str(report.get("detail", "")))]
