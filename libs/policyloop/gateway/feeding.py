"""Which task a run feeds next. The i-th task of a run is a pure function of the run and i, so a
feeder that restarts (or another gateway replica that takes over) produces the very same Task
under the same id, and JetStream deduplicates what was already enqueued."""

from __future__ import annotations

import bisect
import itertools
import random

from policyloop.common.clock import now_ms
from policyloop.contracts.v1 import bus_pb2, loop_pb2
from policyloop.envs.spec import DEFAULT_GROUP_SIZE, DEFAULT_MAX_NEW_TOKENS, task_scorer


def task_id(run_id: str, index: int) -> str:
    return f"{run_id}:{index:09d}"


def tasks_total(request: loop_pb2.StartRunRequest, environments: dict[str, loop_pb2.Environment]) -> int:
    if request.num_tasks:
        return request.num_tasks
    return sum(len(environments[m.environment].tasks) for m in request.environments)


def nth_task(
    run_id: str,
    request: loop_pb2.StartRunRequest,
    environments: dict[str, loop_pb2.Environment],
    index: int,
) -> bus_pb2.Task:
    """The index-th Task of the run: an environment drawn by mixing weight, then a task of it."""
    rng = random.Random(f"{run_id}:{request.seed}:{index}")
    cumulative = list(itertools.accumulate(m.weight for m in request.environments))
    pick = bisect.bisect_right(cumulative, rng.random() * cumulative[-1])
    mix = request.environments[min(pick, len(cumulative) - 1)]
    env = environments[mix.environment]
    spec = env.tasks[rng.randrange(len(env.tasks))]
    sampling = bus_pb2.SamplingParams()
    sampling.CopyFrom(env.sampling)
    if not sampling.max_new_tokens:
        sampling.max_new_tokens = DEFAULT_MAX_NEW_TOKENS
    if not sampling.HasField("seed"):
        sampling.seed = rng.getrandbits(48)
    return bus_pb2.Task(
        task_id=task_id(run_id, index),
        run_id=run_id,
        environment=mix.environment,
        prompt_token_ids=spec.prompt_token_ids,
        prompt_text=spec.prompt_text,
        group_size=env.group_size or DEFAULT_GROUP_SIZE,
        sampling=sampling,
        metadata=spec.metadata,
        created_unix_ms=now_ms(),
        max_turns=env.max_turns,
        tools=env.tools,
        scorer=task_scorer(env, spec),
    )
