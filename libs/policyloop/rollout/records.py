"""A group's trajectories: their identities, the engine request each one makes, and what the
engine's answer writes into it (tokens, behaviour logprobs, version spans, finish reason)."""

from __future__ import annotations

import secrets
from collections.abc import Sequence

from pydantic import ValidationError

from policyloop.common.clock import now_ms
from policyloop.contracts.ids import trajectory_id
from policyloop.contracts.v1 import bus_pb2
from policyloop.engines.protocol import GenerateRequest, GenerateResult, SamplingParams, request_error


def group_members(task: bus_pb2.Task, replica: str) -> list[bus_pb2.Trajectory]:
    """One trajectory record per sample of the task's group, with everything the task fixes
    (identity, prompt, metadata, scorer) filled in and no response yet."""
    started = now_ms()
    return [
        bus_pb2.Trajectory(
            trajectory_id=trajectory_id(task.task_id, i),
            task_id=task.task_id,
            group_id=task.task_id,
            sample_index=i,
            group_size=task.group_size,
            run_id=task.run_id,
            environment=task.environment,
            prompt_token_ids=task.prompt_token_ids,
            rollout_replica=replica,
            metadata=task.metadata,
            scorer=task.scorer if task.HasField("scorer") else None,
            timings=bus_pb2.Timings(
                task_created_unix_ms=task.created_unix_ms, generation_started_unix_ms=started
            ),
        )
        for i in range(task.group_size)
    ]


class EngineResultError(ValueError):
    """An engine answer a trajectory cannot be built from (the sample is not published)."""


_FINISH = {"stop": bus_pb2.FINISH_REASON_STOP, "length": bus_pb2.FINISH_REASON_LENGTH,
           "abort": bus_pb2.FINISH_REASON_ABORT}


class TaskRequestError(ValueError):
    """A task whose sampling settings no engine takes (the task is dead-lettered, not retried)."""


def generate_request(task: bus_pb2.Task, traj: bus_pb2.Trajectory, default_stop_ids: Sequence[int]) -> GenerateRequest:
    """The SGLang request for one group member: sample i of a seeded task uses seed + i."""
    try:
        return _generate_request(task, traj, default_stop_ids)
    except ValidationError as exc:
        error = request_error(exc)
        raise TaskRequestError(f"task: no engine takes its request ({error})") from None


def _generate_request(task: bus_pb2.Task, traj: bus_pb2.Trajectory, default_stop_ids: Sequence[int]
                      ) -> GenerateRequest:
    sp = task.sampling
    return GenerateRequest(
        input_ids=list(traj.prompt_token_ids),
        sampling_params=SamplingParams(
            max_new_tokens=sp.max_new_tokens or 32, temperature=sp.temperature, top_p=sp.top_p or 1.0,
            top_k=sp.top_k or -1, stop_token_ids=tuple(sp.stop_token_ids or default_stop_ids),
            sampling_seed=(sp.seed + traj.sample_index) if sp.HasField("seed") else None,
            ignore_eos=sp.ignore_eos,
        ),
        # The trajectory id plus a per-attempt suffix: a redelivered task sampled again must not
        # collide with an attempt an engine shared by replicas may still hold (duplicate rid).
        return_logprob=True, rid=f"{traj.trajectory_id}#{secrets.token_hex(4)}",
    )


def record_response(traj: bus_pb2.Trajectory, result: GenerateResult, response_text: str,
                    loss_mask: Sequence[bool] | None = None) -> None:
    """Fills the response, behaviour logprobs, loss mask (all True unless given: a multi-turn
    episode masks its tool tokens) and version spans from the engine's answer. Checks everything
    first, so a bad answer leaves the trajectory untouched: a trajectory is never published
    without a logprob and a version for every token."""
    n = len(result.output_ids)
    if loss_mask is not None and len(loss_mask) != n:
        raise EngineResultError(f"loss_mask: {len(loss_mask)} values for {n} tokens")
    if result.weight_version in (None, ""):
        raise EngineResultError("meta_info.weight_version: the engine did not report one")
    versions = [result.weight_version, *(s.version for s in result.weight_versions or [])]
    if not all(str(v).isdigit() for v in versions):
        # SGLang's "default" before the rollout names the base weights: no policy version to train by.
        raise EngineResultError(f"meta_info.weight_version: {versions} are not policy versions (integers)")
    if result.output_logprobs is None or len(result.output_logprobs) != n:
        got = "none" if result.output_logprobs is None else len(result.output_logprobs)
        raise EngineResultError(f"meta_info.output_token_logprobs: {got} for {n} tokens")
    if result.weight_versions:
        # The request straddled a weight update: the engine says which tokens came from which.
        spans = [bus_pb2.VersionSpan(version=int(s.version), start=s.start, end=s.end)
                 for s in result.weight_versions]
    else:
        spans = [bus_pb2.VersionSpan(version=int(result.weight_version), start=0, end=n)] if n else []
    if spans and (spans[0].start != 0 or spans[-1].end != n
                  or any(a.end != b.start for a, b in zip(spans, spans[1:], strict=False))):
        raise EngineResultError(f"meta_info.weight_versions: spans do not cover the {n} tokens in order")
    traj.response_token_ids.extend(result.output_ids)
    traj.behaviour_logprobs.extend(result.output_logprobs)
    traj.loss_mask.extend([True] * n if loss_mask is None else loss_mask)
    traj.version_spans.extend(spans)
    traj.finish_reason = _FINISH.get(result.finish_reason, bus_pb2.FINISH_REASON_ERROR)
    traj.response_text = response_text
    traj.timings.generation_finished_unix_ms = now_ms()
