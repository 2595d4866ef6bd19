"""Validation of LoopService requests. Every error names the offending field, so the gateway
can answer INVALID_ARGUMENT with a message a user can act on."""

from __future__ import annotations

import math
import re

from policyloop.contracts.v1 import loop_pb2
from policyloop.envs.tools import TOOL_FORMATS

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_\-]{0,63}$")
VERSION_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,31}$")
MAX_TASKS_PER_ENVIRONMENT = 1_000_000
MAX_GROUP_SIZE = 1024
MAX_TURNS = 16
MAX_CODE_TIMEOUT_S = 600.0  # a code scorer's job; the sandbox caps it again by its own ceiling


class InvalidField(ValueError):
    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field = field


def environment_key(name: str, version: str) -> str:
    return f"{name}@{version}"


def validate_environment(env: loop_pb2.Environment) -> None:
    if not NAME_RE.match(env.name):
        raise InvalidField("environment.name", f"{env.name!r} must match {NAME_RE.pattern}")
    if not VERSION_RE.match(env.version):
        raise InvalidField("environment.version", f"{env.version!r} must match {VERSION_RE.pattern}")
    if not env.tasks:
        raise InvalidField("environment.tasks", "an environment needs at least one task")
    if len(env.tasks) > MAX_TASKS_PER_ENVIRONMENT:
        raise InvalidField("environment.tasks", f"at most {MAX_TASKS_PER_ENVIRONMENT} tasks")
    for i, task in enumerate(env.tasks):
        if not task.prompt_text and not task.prompt_token_ids:
            raise InvalidField(f"environment.tasks[{i}].prompt_text", "the task has no prompt")
        if any(t < 0 for t in task.prompt_token_ids):
            raise InvalidField(f"environment.tasks[{i}].prompt_token_ids", "token ids must not be negative")
    scorer = env.WhichOneof("scorer")
    if scorer is None:
        raise InvalidField("environment.scorer", "choose builtin, unit_tests or reward_code")
    if scorer == "builtin":
        verifier = env.builtin
        if verifier.kind == loop_pb2.BuiltinVerifier.KIND_UNSPECIFIED:
            raise InvalidField("environment.builtin.kind", "is unspecified")
        if verifier.kind == loop_pb2.BuiltinVerifier.KIND_NUMERIC_TOLERANCE and not (
            math.isfinite(verifier.tolerance) and verifier.tolerance >= 0
        ):
            raise InvalidField("environment.builtin.tolerance", "must be a finite number >= 0")
        if verifier.kind == loop_pb2.BuiltinVerifier.KIND_REGEX and not verifier.pattern:
            raise InvalidField("environment.builtin.pattern", "a regex verifier needs a pattern")
        if verifier.pattern:
            try:
                re.compile(verifier.pattern)
            except re.error as exc:
                raise InvalidField("environment.builtin.pattern", f"not a valid regex: {exc}") from exc
        if verifier.kind != loop_pb2.BuiltinVerifier.KIND_REGEX:
            for i, task in enumerate(env.tasks):
                if not task.answer:
                    raise InvalidField(f"environment.tasks[{i}].answer", "the verifier needs an answer")
    elif scorer == "unit_tests":
        _check_unit_tests(env)
        _check_timeout("environment.unit_tests.timeout_seconds", env.unit_tests.timeout_seconds)
    elif scorer == "reward_code":
        if not env.reward_code.source:
            raise InvalidField("environment.reward_code.source", "is empty")
        _check_timeout("environment.reward_code.timeout_seconds", env.reward_code.timeout_seconds)
    if env.group_size > MAX_GROUP_SIZE:
        raise InvalidField("environment.group_size", f"at most {MAX_GROUP_SIZE}")
    sampling = env.sampling
    if sampling.temperature < 0 or not math.isfinite(sampling.temperature):
        raise InvalidField("environment.sampling.temperature", "must be a finite number >= 0")
    if not 0 <= sampling.top_p <= 1:
        raise InvalidField("environment.sampling.top_p", "must be within [0, 1] (0: engine default)")
    _validate_turns(env)


def _check_unit_tests(env: loop_pb2.Environment) -> None:
    """Every task must have tests to run: top-level `def test_*` functions in the shared test_code
    or its own metadata.tests (tests may come with each task), in Python that parses."""
    from policyloop.envs.code import test_functions

    def tests_in(source: str, field: str) -> list[str]:
        try:
            return test_functions(source)
        except SyntaxError as exc:
            raise InvalidField(field, f"does not parse: {exc.msg} (line {exc.lineno})") from exc

    shared = tests_in(env.unit_tests.test_code, "environment.unit_tests.test_code")
    for i, task in enumerate(env.tasks):
        own = tests_in(task.metadata.get("tests", ""), f"environment.tasks[{i}].metadata.tests")
        if not shared and not own:
            raise InvalidField(f"environment.tasks[{i}].metadata.tests",
                               "no top-level `def test_*` here nor in environment.unit_tests.test_code: "
                               "no tests to run")


def _check_timeout(field: str, seconds: float) -> None:
    if not math.isfinite(seconds) or not 0 <= seconds <= MAX_CODE_TIMEOUT_S:
        raise InvalidField(field, f"must be a number of seconds in [0, {MAX_CODE_TIMEOUT_S:g}] (0: the default)")


def _validate_turns(env: loop_pb2.Environment) -> None:
    if env.max_turns > MAX_TURNS:
        raise InvalidField("environment.max_turns", f"at most {MAX_TURNS}")
    for i, tool in enumerate(env.tools):
        if tool not in TOOL_FORMATS:
            raise InvalidField(f"environment.tools[{i}]", f"{tool!r} is not a tool; known: {sorted(TOOL_FORMATS)}")
    if len(set(env.tools)) != len(env.tools):
        raise InvalidField("environment.tools", "lists a tool twice")
    if env.tools and env.max_turns < 2:
        raise InvalidField("environment.max_turns", "tools need at least 2 turns (a call and the answer after it)")
    if env.max_turns > 1 and not env.tools:
        raise InvalidField("environment.tools", f"max_turns {env.max_turns} needs a tool to run between turns")
    if env.tools and env.sampling.ignore_eos:
        raise InvalidField("environment.sampling.ignore_eos", "cannot be combined with tools: a tool call ends at "
                                                              "its closing token, which ignore_eos would not stop at")


def validate_start_run(request: loop_pb2.StartRunRequest) -> None:
    if request.run_id and not NAME_RE.match(request.run_id):
        raise InvalidField("run_id", f"{request.run_id!r} must match {NAME_RE.pattern}")
    if not request.environments:
        raise InvalidField("environments", "a run needs at least one environment")
    seen = set()
    for i, mix in enumerate(request.environments):
        name, _, version = mix.environment.partition("@")
        if not NAME_RE.match(name) or not VERSION_RE.match(version):
            raise InvalidField(f"environments[{i}].environment", f"{mix.environment!r} is not name@version")
        if mix.environment in seen:
            raise InvalidField(f"environments[{i}].environment", f"{mix.environment} is listed twice")
        seen.add(mix.environment)
        if not (math.isfinite(mix.weight) and mix.weight > 0):
            raise InvalidField(f"environments[{i}].weight", "must be a finite number > 0")
    if request.max_lag < -1:
        raise InvalidField("max_lag", "must be -1 (unbounded) or >= 0")


# The learner settings a run may name in StartRunRequest.loss (the objective the cluster's
# learner was started with; see services/learner).
RUN_LOSS_SETTINGS = ("loss", "normalization", "loss_constant", "advantages", "clip_low", "clip_high",
                     "gspo_clip_low", "gspo_clip_high", "off_policy", "tis_cap", "kl_coef", "kl_estimator")


class FailedPrecondition(InvalidField):
    """The request is well formed, but the cluster does not do what it asks."""


def check_run_against_learner(request: loop_pb2.StartRunRequest, learner: dict | None) -> None:
    """Refuses a run whose model, max_lag or loss settings differ from what the running learner
    does (`learner`: the `config` its heartbeat advertises; None: no learner is up yet, so only
    the names are checked). One learner serves the cluster: settings it would silently ignore
    are an error, not a wish."""
    for key in sorted(request.loss):
        if key not in RUN_LOSS_SETTINGS:
            raise InvalidField(f"loss[{key}]", f"not a learner loss setting (one of {', '.join(RUN_LOSS_SETTINGS)})")
    if learner is None:
        return
    if request.model and request.model != learner.get("model"):
        raise FailedPrecondition("model", f"the cluster's learner trains {learner.get('model')!r}, "
                                          f"not {request.model!r}")
    if request.HasField("max_lag") and request.max_lag != learner.get("max_lag"):
        raise FailedPrecondition("max_lag", f"the cluster runs with max_lag {learner.get('max_lag')}, not "
                                            f"{request.max_lag} (start the learner and rollout with --max-lag)")
    objective = learner.get("loss", {})
    for key, wanted in sorted(request.loss.items()):
        running = objective.get(key)
        if not _same_setting(running, wanted):
            raise FailedPrecondition(f"loss[{key}]", f"the cluster's learner runs {key}={running}, not {wanted} "
                                                     f"(start it with --{key.replace('_', '-')} {wanted})")


def _same_setting(running: object, wanted: str) -> bool:
    if isinstance(running, bool) or not isinstance(running, int | float):
        return str(running) == wanted
    try:
        return math.isclose(float(wanted), float(running), rel_tol=1e-9, abs_tol=0.0)
    except ValueError:
        return False
