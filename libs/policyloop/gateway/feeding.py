"""Which task (or demonstration) a run feeds next. The i-th task of a run is a pure function of the run and i, so a
feeder that restarts (or another gateway replica that takes over) produces the very same Task
under the same id, and JetStream deduplicates what was already enqueued."""

from __future__ import annotations

import bisect
import itertools
import random

from policyloop.common.clock import now_ms
from policyloop.contracts.ids import task_id, trajectory_id
from policyloop.contracts.v1 import bus_pb2, loop_pb2
from policyloop.envs.spec import DEFAULT_MAX_NEW_TOKENS, group_size, task_scorer

__all__ = ["demonstration", "nth_item", "nth_task", "task_id", "tasks_total"]


def tasks_total(request: loop_pb2.StartRunRequest, environments: dict[str, loop_pb2.Environment],
                batch: int = 1) -> int:
    """How many items the run feeds: num_tasks, or as many as its environments hold. A run of
    demonstrations only feeds a multiple of the learner's `batch` (rounded up): the learner steps
    on full batches of one kind, so every demonstration fed is trained."""
    total = request.num_tasks or sum(len(environments[m.environment].tasks) for m in request.environments)
    if batch > 1 and all(environments[m.environment].supervised for m in request.environments):
        total = -(-total // batch) * batch
    return total


def _pick(run_id: str, request: loop_pb2.StartRunRequest, environments: dict[str, loop_pb2.Environment],
             index: int) -> tuple[str, loop_pb2.TaskSpec, random.Random]:
    """The environment and task of the run's index-th item (drawn by mixing weight, then a task of
    the environment), with the random state that goes on to draw its sampling seed."""
    rng = random.Random(f"{run_id}:{request.seed}:{index}")
    cumulative = list(itertools.accumulate(m.weight for m in request.environments))
    pick = bisect.bisect_right(cumulative, rng.random() * cumulative[-1])
    mix = request.environments[min(pick, len(cumulative) - 1)]
    env = environments[mix.environment]
    return mix.environment, env.tasks[rng.randrange(len(env.tasks))], rng


def nth_item(run_id: str, request: loop_pb2.StartRunRequest, environments: dict[str, loop_pb2.Environment],
             index: int) -> bus_pb2.Task | bus_pb2.Trajectory:
    """The run's index-th item: a Task for TASKS, or — from a supervised environment — a
    demonstration for TRAJECTORIES, which goes to the learner as it is."""
    name, spec, rng = _pick(run_id, request, environments, index)
    if environments[name].supervised:
        return demonstration(run_id, name, spec, index)
    return _task(run_id, name, environments[name], spec, rng, index)


def nth_task(run_id: str, request: loop_pb2.StartRunRequest, environments: dict[str, loop_pb2.Environment],
             index: int) -> bus_pb2.Task:
    """The index-th Task of a run of environments that are sampled."""
    item = nth_item(run_id, request, environments, index)
    if not isinstance(item, bus_pb2.Task):
        raise ValueError(f"item {index} of run {run_id} is a demonstration, not a task")
    return item


def demonstration(run_id: str, environment: str, spec: loop_pb2.TaskSpec, index: int) -> bus_pb2.Trajectory:
    """A supervised task as a trajectory of one: its demonstration is the response, every token
    trained on; already 'scored' (there is nothing to score), with no behaviour logprobs or versions."""
    tid = task_id(run_id, index)
    tokens = len(spec.demonstration_token_ids)
    return bus_pb2.Trajectory(
        trajectory_id=trajectory_id(tid, 0), task_id=tid, group_id=tid, sample_index=0, group_size=1, run_id=run_id,
        environment=environment, prompt_token_ids=spec.prompt_token_ids,
        response_token_ids=spec.demonstration_token_ids,
        loss_mask=list(spec.demonstration_loss_mask) or [True] * tokens,
        finish_reason=bus_pb2.FINISH_REASON_STOP, metadata=spec.metadata, prompt_text=spec.prompt_text,
        response_text=spec.demonstration_text, scored=True, supervised=True,
        timings=bus_pb2.Timings(task_created_unix_ms=now_ms()))


def _task(run_id: str, environment: str, env: loop_pb2.Environment, spec: loop_pb2.TaskSpec, rng: random.Random,
          index: int) -> bus_pb2.Task:
    sampling = bus_pb2.SamplingParams()
    sampling.CopyFrom(env.sampling)
    if not sampling.max_new_tokens:
        sampling.max_new_tokens = DEFAULT_MAX_NEW_TOKENS
    if not sampling.HasField("seed"):
        sampling.seed = rng.getrandbits(48)
    task = bus_pb2.Task(
        task_id=task_id(run_id, index),
        run_id=run_id,
        environment=environment,
        prompt_token_ids=spec.prompt_token_ids,
        prompt_text=spec.prompt_text,
        group_size=group_size(env),
        sampling=sampling,
        metadata=spec.metadata,
        created_unix_ms=now_ms(),
        max_turns=env.max_turns,
        tools=env.tools,
        scorer=task_scorer(env, spec),
    )
    driver = env.WhichOneof("driver")
    if driver is not None:  # the environment that drives the task's episodes goes with it
        getattr(task, driver).CopyFrom(getattr(env, driver))
    return task
