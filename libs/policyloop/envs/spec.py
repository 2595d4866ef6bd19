"""What an environment definition (policyloop.v1.Environment) fixes for each of its tasks, read
alike by the gateway's feeder (training tasks) and the evaluator (eval tasks): the defaults of
what it leaves unset, and how a task's samples are scored."""

from __future__ import annotations

from policyloop.contracts.v1 import bus_pb2, loop_pb2

DEFAULT_GROUP_SIZE = 8
DEFAULT_MAX_NEW_TOKENS = 32


def group_size(env: loop_pb2.Environment) -> int:
    """Samples a run draws per task: the environment's group_size, the default where it left 0
    (proto3's unset), one for a supervised environment (its demonstration)."""
    return 1 if env.supervised else env.group_size or DEFAULT_GROUP_SIZE


def task_scorer(env: loop_pb2.Environment, spec: loop_pb2.TaskSpec) -> bus_pb2.Scorer:
    """How a task's samples are scored: the environment's scorer, with the task's answer."""
    scorer = bus_pb2.Scorer(answer=spec.answer)
    kind = env.WhichOneof("scorer")
    if kind is not None:
        getattr(scorer, kind).CopyFrom(getattr(env, kind))
    return scorer
