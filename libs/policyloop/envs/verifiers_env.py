"""`verifiers` environments (PrimeIntellect's library; its classic API, `vf.load_environment`),
trained unchanged: each episode runs the environment's own rollout and rubric in a sandbox session
(envs/verifiers_worker.py), where the OpenAI client it is given reaches the replica through the
session's channel. The replica answers each of its chat completions with a model turn sampled as
any other (exact tokens and logprobs, the observations masked), so the episode is
envs/chat_env.py's over that session; the rubric's reward comes with the last answer.

Tasks are the environment's dataset rows: `dataset_tasks` reads them where the environment is
installed (the CLI's machine), one TaskSpec per row with the row as its prompt_text.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from policyloop.contracts.v1 import bus_pb2, loop_pb2
from policyloop.envs.program import package_job

VERIFIERS_REQUIREMENT = "verifiers==0.3.1"
"""The release the worker speaks to (its classic API): installed in the sessions beside the
environment's own requirements, and the `verifiers` extra of policyloop's package."""
WORKER = "verifiers_worker.py"
DEFAULT_STEP_SECONDS = 60.0      # the first exchange imports verifiers and loads the environment
DEFAULT_EPISODE_SECONDS = 300.0
DEFAULT_MEMORY_BYTES = 2 * 1024**3  # verifiers imports datasets, pyarrow, openai and the like


def verifiers_job(environment: bus_pb2.VerifiersEnvironment, *, job_id: str, run_id: str) -> bus_pb2.SandboxJob:
    """The session's job: the worker, the environment's files and its dependencies with verifiers."""
    names_verifiers = any(r.strip().lower().startswith("verifiers") for r in environment.requirements)
    job = package_job(environment, worker=WORKER,
                      arguments=[environment.environment_id, environment.arguments_json or "{}"],
                      job_id=job_id, run_id=run_id, step_seconds=environment.step_seconds or DEFAULT_STEP_SECONDS,
                      default_episode_s=DEFAULT_EPISODE_SECONDS,
                      default_memory_bytes=DEFAULT_MEMORY_BYTES,
                      requirements=[] if names_verifiers else [VERIFIERS_REQUIREMENT])
    job.session.prepared = True  # forked from a process that loaded the environment once (sandbox/forked.py)
    return job


def row_task(row: Mapping[str, Any]) -> loop_pb2.TaskSpec:
    """A dataset row as a task: the row itself (JSON) is what the worker's reset is given."""
    if not isinstance(row.get("prompt"), list):
        raise ValueError(f"a verifiers dataset row has a 'prompt' list of messages; this one has {sorted(row)}")
    return loop_pb2.TaskSpec(prompt_text=json.dumps(dict(row), default=str), answer=str(row.get("answer", "")))


def dataset_tasks(environment_id: str, arguments: Mapping[str, Any], *, count: int = -1, eval_count: int = -1
                  ) -> tuple[list[loop_pb2.TaskSpec], list[loop_pb2.TaskSpec]]:
    """The environment's dataset and eval dataset rows as tasks, read through verifiers where the
    environment is installed (importing it needs the `verifiers` extra)."""
    import verifiers as vf  # the official library, here only to read the environment's datasets

    env = vf.load_environment(environment_id, **arguments)
    train = env.get_dataset(n=count) if env.build_dataset() is not None else []
    held_out = env.get_eval_dataset(n=eval_count) if env.build_eval_dataset() is not None else []
    return [row_task(r) for r in train], [row_task(r) for r in held_out]
