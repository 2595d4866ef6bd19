"""Checks of bus messages beyond what protobuf decoding guarantees. Each raises
`InvalidMessage` naming the field, which the bus layer turns into a dead letter."""

from __future__ import annotations

import math
import re

from policyloop.contracts.v1 import bus_pb2


class InvalidMessage(ValueError):
    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field, self.problem = field, problem


def validate_task(task: bus_pb2.Task) -> None:
    if not task.task_id:
        raise InvalidMessage("task_id", "is empty")
    if not task.environment:
        raise InvalidMessage("environment", "is empty")
    if task.HasField("program") and (not task.program.entry or not task.program.files):
        raise InvalidMessage("program", "names no entry (module:Class) or has no files")
    if task.HasField("openenv") and not task.openenv.base_url:
        raise InvalidMessage("openenv.base_url", "is empty")
    if task.HasField("verifiers") and not task.verifiers.environment_id:
        raise InvalidMessage("verifiers.environment_id", "is empty")
    # The prompt of an environment that drives its episodes is what its reset answers.
    if not task.prompt_token_ids and not task.prompt_text and task.WhichOneof("driver") is None:
        raise InvalidMessage("prompt_token_ids", "and prompt_text are both empty")
    if task.group_size < 1:
        raise InvalidMessage("group_size", "must be at least 1")
    if task.tools and task.sampling.ignore_eos:
        raise InvalidMessage("sampling.ignore_eos", "cannot be combined with tools (a tool call ends at a stop token)")
    if task.HasField("scorer"):
        validate_scorer(task.scorer)


def validate_trajectory(traj: bus_pb2.Trajectory) -> None:
    if not traj.trajectory_id:
        raise InvalidMessage("trajectory_id", "is empty")
    if not traj.task_id:
        raise InvalidMessage("task_id", "is empty")
    if traj.group_size < 1 or traj.sample_index >= traj.group_size:
        raise InvalidMessage("sample_index", f"{traj.sample_index} is outside a group of {traj.group_size}")
    n = len(traj.response_token_ids)
    if traj.supervised:
        _validate_demonstration(traj)
    elif len(traj.behaviour_logprobs) != n:
        raise InvalidMessage("behaviour_logprobs", f"has {len(traj.behaviour_logprobs)} values for {n} tokens")
    if len(traj.loss_mask) != n:
        raise InvalidMessage("loss_mask", f"has {len(traj.loss_mask)} values for {n} tokens")
    position = 0
    for i, span in enumerate(traj.version_spans):
        if span.start != position or span.end <= span.start:
            raise InvalidMessage(f"version_spans[{i}]", f"[{span.start}, {span.end}) does not continue at {position}")
        position = span.end
    if traj.version_spans and position != n:
        raise InvalidMessage("version_spans", f"cover {position} of {n} response tokens")
    _validate_turns(traj)
    if traj.HasField("scorer"):
        validate_scorer(traj.scorer)


def validate_group(group: bus_pb2.TrajectoryGroup) -> None:
    """A group message: at least one sample, each valid and a member of this group (its id, run
    and environment), none twice."""
    if not group.group_id:
        raise InvalidMessage("group_id", "is empty")
    if not group.trajectories:
        raise InvalidMessage("trajectories", "is empty")
    seen: set[int] = set()
    for i, traj in enumerate(group.trajectories):
        try:
            validate_trajectory(traj)
        except InvalidMessage as exc:
            raise InvalidMessage(f"trajectories[{i}].{exc.field}", exc.problem) from None
        if traj.group_id != group.group_id:
            raise InvalidMessage(f"trajectories[{i}].group_id",
                                 f"{traj.group_id!r} is not the group's {group.group_id!r}")
        first = group.trajectories[0]
        for name in ("run_id", "environment"):  # one task's samples: the reward publishes by the first's
            if getattr(traj, name) != getattr(first, name):
                raise InvalidMessage(f"trajectories[{i}].{name}", f"{getattr(traj, name)!r} is not the group's "
                                                                  f"{getattr(first, name)!r}")
        if traj.sample_index in seen:
            raise InvalidMessage(f"trajectories[{i}].sample_index", f"{traj.sample_index} is in the group twice")
        seen.add(traj.sample_index)


def _validate_demonstration(traj: bus_pb2.Trajectory) -> None:
    """A demonstration is one response of one prompt, imitated: no policy sampled it."""
    if not traj.prompt_token_ids:
        raise InvalidMessage("prompt_token_ids", "a demonstration needs its prompt as token ids")
    if not traj.response_token_ids:
        raise InvalidMessage("response_token_ids", "a demonstration needs a response")
    if traj.behaviour_logprobs:
        raise InvalidMessage("behaviour_logprobs", "a demonstration has none (no policy sampled it)")
    if traj.version_spans:
        raise InvalidMessage("version_spans", "a demonstration has none (no policy sampled it)")
    if traj.group_size != 1:
        raise InvalidMessage("group_size", f"a demonstration is a group of 1, not {traj.group_size}")
    if traj.turns:
        raise InvalidMessage("turns", "a demonstration is single-turn")


def _validate_turns(traj: bus_pb2.Trajectory) -> None:
    """Turns cover the response in order; tool tokens are never trained on."""
    if not traj.turns:
        return
    position = 0
    for i, turn in enumerate(traj.turns):
        if turn.start != position or turn.end < turn.start or turn.end > len(traj.response_token_ids):
            raise InvalidMessage(f"turns[{i}]", f"[{turn.start}, {turn.end}) does not continue at {position}")
        if turn.role != bus_pb2.Turn.ROLE_MODEL and any(traj.loss_mask[turn.start:turn.end]):
            raise InvalidMessage(f"turns[{i}]", "only the model's tokens may have loss_mask true")
        if turn.role not in (bus_pb2.Turn.ROLE_MODEL, bus_pb2.Turn.ROLE_TOOL, bus_pb2.Turn.ROLE_ENVIRONMENT):
            raise InvalidMessage(f"turns[{i}].role", "is unspecified")
        position = turn.end
    if position != len(traj.response_token_ids):
        raise InvalidMessage("turns", f"cover {position} of {len(traj.response_token_ids)} response tokens")


_VERIFIER = bus_pb2.BuiltinVerifier


def validate_scorer(scorer: bus_pb2.Scorer) -> None:
    """A scorer the reward service can run as it stands (a message without one is valid: it is
    unscorable, which the reward service dead-letters as such)."""
    kind = scorer.WhichOneof("kind")
    if kind is None:
        fields = ", ".join(f.name for f in scorer.DESCRIPTOR.oneofs_by_name["kind"].fields)
        raise InvalidMessage("scorer", f"names no scorer (one of {fields})")
    if kind == "builtin":
        _validate_verifier(scorer)
        return
    if kind == "environment_reward":
        return
    if kind == "reward_model":
        _validate_reward_model(scorer.reward_model)
        return
    if kind == "judge":
        problem = judge_problem(scorer.judge)
        if problem is not None:
            raise InvalidMessage(f"scorer.judge.{problem[0]}", problem[1])
        return
    seconds = getattr(scorer, kind).timeout_seconds
    if not math.isfinite(seconds) or seconds < 0:
        raise InvalidMessage(f"scorer.{kind}.timeout_seconds", f"{seconds} is not a number of seconds (0: the default)")
    if kind == "reward_code" and not scorer.reward_code.source:
        raise InvalidMessage("scorer.reward_code.source", "is empty")


def reward_model_problem(spec: bus_pb2.RewardModelScorer) -> tuple[str, str] | None:
    """(field below the scorer, what is wrong) of a reward model scorer, None when it is well formed."""
    if not spec.model:
        return "model", "is empty: name the reward model (one the reward service reaches)"
    if spec.normalization not in bus_pb2.RewardModelScorer.Normalization.values():
        return "normalization", f"{spec.normalization} is not a normalization"
    for name in ("scale", "shift"):
        if not math.isfinite(getattr(spec, name)):
            return name, "is not a finite number"
    if not math.isfinite(spec.timeout_seconds) or spec.timeout_seconds < 0:
        return "timeout_seconds", f"{spec.timeout_seconds} is not a number of seconds (0: the default)"
    return None


MAX_JUDGE_TOKENS = 4096
_JUDGE = bus_pb2.JudgeScorer


def judge_problem(spec: bus_pb2.JudgeScorer) -> tuple[str, str] | None:
    """(field below the scorer, what is wrong) of a judge scorer, None when it is well formed."""
    if not spec.judge:
        return "judge", "is empty: name the judge (one the reward service reaches)"
    if "{response}" not in spec.template:
        return "template", "must hold {response} (and may hold {prompt} and {answer})"
    if spec.verdict not in _JUDGE.Verdict.values():
        return "verdict", f"{spec.verdict} is not a verdict"
    if spec.verdict == _JUDGE.VERDICT_LABEL and not spec.labels:
        return "labels", "a label verdict needs labels (label -> reward)"
    bad = sorted(label for label, value in spec.labels.items() if not label.strip() or not math.isfinite(value))
    if bad:
        return "labels", f"{bad[:3]}: a label is a word with a finite reward"
    if not (math.isfinite(spec.min_score) and math.isfinite(spec.max_score)):
        return "max_score", "min_score and max_score must be finite numbers"
    if spec.max_tokens > MAX_JUDGE_TOKENS:
        return "max_tokens", f"at most {MAX_JUDGE_TOKENS}"
    if not math.isfinite(spec.timeout_seconds) or spec.timeout_seconds < 0:
        return "timeout_seconds", f"{spec.timeout_seconds} is not a number of seconds (0: the default)"
    return None


def _validate_reward_model(spec: bus_pb2.RewardModelScorer) -> None:
    problem = reward_model_problem(spec)
    if problem is not None:
        raise InvalidMessage(f"scorer.reward_model.{problem[0]}", problem[1])


def _validate_verifier(scorer: bus_pb2.Scorer) -> None:
    verifier = scorer.builtin
    if verifier.kind == _VERIFIER.KIND_UNSPECIFIED or verifier.kind not in _VERIFIER.Kind.values():
        raise InvalidMessage("scorer.builtin.kind", f"{verifier.kind} is not a built-in verifier")
    if not math.isfinite(verifier.format_weight):
        raise InvalidMessage("scorer.builtin.format_weight", "is not a finite number")
    if verifier.kind == _VERIFIER.KIND_REGEX and not verifier.pattern:
        raise InvalidMessage("scorer.builtin.pattern", "a regex verifier needs a pattern")
    if verifier.pattern:  # the regex verifier's, or the answer's format (exact_answer)
        try:
            re.compile(verifier.pattern)
        except re.error as exc:
            raise InvalidMessage("scorer.builtin.pattern", f"not a valid regex: {exc}") from exc
    if verifier.kind == _VERIFIER.KIND_REGEX:
        return
    if not scorer.answer:
        raise InvalidMessage("scorer.answer", "is empty: the verifier compares against it")
    if verifier.kind == _VERIFIER.KIND_NUMERIC_TOLERANCE:
        if not (math.isfinite(verifier.tolerance) and verifier.tolerance >= 0):
            raise InvalidMessage("scorer.builtin.tolerance", "must be a finite number >= 0")
        try:
            float(scorer.answer)
        except ValueError:
            raise InvalidMessage("scorer.answer", f"{scorer.answer[:32]!r} is not a number") from None


def validate_sandbox_session(job: bus_pb2.SandboxJob) -> None:
    """A session is a job with a channel subject and a step limit (sandbox/session.py)."""
    validate_sandbox_job(job)
    if not job.session.channel_subject:
        raise InvalidMessage("session.channel_subject", "is empty")
    step = job.session.step_seconds
    if not math.isfinite(step) or step < 0:
        raise InvalidMessage("session.step_seconds", f"{step} is not a number of seconds (0: the default)")
    command = list(job.command)
    if job.session.prepared and (len(command) < 3 or command[1] != "-I" or command[2] not in job.files):
        raise InvalidMessage("session.prepared", "needs the command `PYTHON -I SCRIPT ARGS...`, SCRIPT one of the "
                                                 "job's files (the forkserver imports it)")


def validate_sandbox_job(job: bus_pb2.SandboxJob) -> None:
    if not job.job_id:
        raise InvalidMessage("job_id", "is empty")
    if not job.command:
        raise InvalidMessage("command", "is empty")
    for path in job.files:
        if path.startswith("/") or ".." in path.split("/"):
            raise InvalidMessage("files", f"path {path!r} leaves the scratch directory")
    for name in ("wall_seconds", "cpu_seconds"):
        value = getattr(job.limits, name)
        if not math.isfinite(value) or value < 0:
            raise InvalidMessage(f"limits.{name}", f"{value} is not a number of seconds (0: the default)")
