"""Validation of LoopService requests. Every error names the offending field (InvalidField,
FailedPrecondition), so the gateway can answer with a message a user can act on."""

from __future__ import annotations

import json
import math
import re
import urllib.parse
from collections.abc import Sequence

from pydantic import ValidationError

from policyloop.contracts.v1 import loop_pb2, status_pb2
from policyloop.contracts.validate import judge_problem, reward_model_problem
from policyloop.envs.driven import DRIVER_KINDS, driver_of
from policyloop.envs.spec import DEFAULT_GROUP_SIZE, DEFAULT_MAX_NEW_TOKENS
from policyloop.envs.tools import TOOL_FORMATS
from policyloop.gateway.code_checks import check_reward_code, check_unit_tests
from policyloop.gateway.demonstrations import (
    check_demonstrations_fit,
    tokenize_demonstrations,
    validate_demonstrations,
)
from policyloop.gateway.errors import FailedPrecondition, InvalidField
from policyloop.gateway.model_context import ModelContext
from policyloop.rl.losses import named_in, setting_problem
from policyloop.rl.settings import LoraSpec
from policyloop.scorers.kinds import field_choices

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_\-]{0,63}$")
VERSION_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,31}$")
MAX_TASKS_PER_ENVIRONMENT = 1_000_000
MAX_GROUP_SIZE = 1024
MAX_TURNS = 16
MAX_CODE_TIMEOUT_S = 600.0  # a code scorer's job; the sandbox caps it again by its own ceiling
# An environment is stored as one Redis value, and Redis refuses values over 512 MB.
MAX_ENVIRONMENT_BYTES = 256 * 1024 * 1024

_VERIFIER = loop_pb2.BuiltinVerifier


def environment_key(name: str, version: str) -> str:
    return f"{name}@{version}"


def validate_environment(env: loop_pb2.Environment, model: ModelContext | None = None) -> None:
    """Raises InvalidField for the first thing wrong with `env`. With `model`, prompts must fit
    its context together with the generation budget, and token ids its vocabulary."""
    if not NAME_RE.match(env.name):
        raise InvalidField("environment.name", f"{env.name!r} must match {NAME_RE.pattern}")
    if not VERSION_RE.match(env.version):
        raise InvalidField("environment.version", f"{env.version!r} must match {VERSION_RE.pattern}")
    _validate_tasks(env)
    validate_demonstrations(env)
    _validate_scorer(env)
    _validate_driver(env)
    if env.group_size > MAX_GROUP_SIZE:
        raise InvalidField("environment.group_size", f"at most {MAX_GROUP_SIZE} (0: the default, "
                                                     f"{DEFAULT_GROUP_SIZE}), got {env.group_size}")
    sampling = env.sampling
    if sampling.temperature < 0 or not math.isfinite(sampling.temperature):
        raise InvalidField("environment.sampling.temperature", "must be a finite number >= 0")
    if not 0 <= sampling.top_p <= 1:
        raise InvalidField("environment.sampling.top_p", "must be within [0, 1] (0: engine default)")
    if sampling.top_k < -1:
        raise InvalidField("environment.sampling.top_k", "must be -1 (no truncation), 0 (engine default) or >= 1")
    _validate_turns(env)
    if model is not None:
        check_prompts_fit(env, model)


def prepare_environment(env: loop_pb2.Environment, model: ModelContext | None = None) -> None:
    """What the gateway does to an environment before storing it: `validate_environment`, then a
    supervised environment's text made token ids (with `model`'s tokenizer) and checked to fit."""
    validate_environment(env, model)
    tokenize_demonstrations(env, model)
    if env.supervised and model is not None:
        check_demonstrations_fit(env, model)


def task_lists(env: loop_pb2.Environment) -> list[tuple[str, Sequence[loop_pb2.TaskSpec]]]:
    """The environment's tasks that are sampled, by field name: its training tasks (unless they are
    demonstrations) and its eval split."""
    if env.supervised:
        return [("eval_tasks", env.eval_tasks)]
    return [("tasks", env.tasks), ("eval_tasks", env.eval_tasks)]


def _validate_tasks(env: loop_pb2.Environment) -> None:
    if not env.tasks:
        raise InvalidField("environment.tasks", "an environment needs at least one task")
    for name, tasks in (("tasks", env.tasks), ("eval_tasks", env.eval_tasks)):
        if len(tasks) > MAX_TASKS_PER_ENVIRONMENT:
            raise InvalidField(f"environment.{name}", f"at most {MAX_TASKS_PER_ENVIRONMENT} tasks")
        for i, task in enumerate(tasks):
            # A program's prompt is what its reset answers: its task may be only metadata.
            if not task.prompt_text and not task.prompt_token_ids and driver_of(env) is None:
                raise InvalidField(f"environment.{name}[{i}].prompt_text", "the task has no prompt")
            if any(t < 0 for t in task.prompt_token_ids):
                raise InvalidField(f"environment.{name}[{i}].prompt_token_ids", "token ids must not be negative")


def _validate_scorer(env: loop_pb2.Environment) -> None:
    scorer = env.WhichOneof("scorer")
    if scorer is None and env.supervised and not env.eval_tasks:
        return  # demonstrations are imitated, never scored
    if scorer is None:
        raise InvalidField("environment.scorer", f"choose {field_choices()}")
    if (scorer == "environment_reward") != (driver_of(env) is not None):
        raise InvalidField("environment.environment_reward", "the rewards an environment that drives its episodes "
                                                            f"({', '.join(DRIVER_KINDS)}) gives score them, and only "
                                                            "those: give both or neither")
    if scorer == "builtin":
        _validate_verifier(env)
    elif scorer == "unit_tests":
        check_unit_tests(env)
        _check_timeout("environment.unit_tests.timeout_seconds", env.unit_tests.timeout_seconds)
    elif scorer == "reward_code":
        check_reward_code(env.reward_code.source)
        _check_timeout("environment.reward_code.timeout_seconds", env.reward_code.timeout_seconds)
    elif scorer in ("reward_model", "judge"):
        check = reward_model_problem if scorer == "reward_model" else judge_problem
        problem = check(getattr(env, scorer))  # type: ignore[operator]
        if problem is not None:
            raise InvalidField(f"environment.{scorer}.{problem[0]}", problem[1])


MAX_PROGRAM_BYTES = 512 * 1024  # it travels on each Task
_MODULE_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
_ENTRY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*$")


def _validate_driver(env: loop_pb2.Environment) -> None:
    """An environment that drives its episodes: one kind, well formed; it declares its own tools."""
    driver = driver_of(env)
    if driver is None:
        return
    if env.tools:
        raise InvalidField("environment.tools", "an environment that drives its episodes declares its own tools")
    if env.supervised:
        raise InvalidField("environment.supervised", "its episodes are sampled, not imitated")
    if isinstance(driver, loop_pb2.EnvironmentProgram):
        _validate_program(driver)
    elif isinstance(driver, loop_pb2.VerifiersEnvironment):
        _validate_verifiers(env, driver)
    else:
        _validate_openenv(driver)


def _validate_openenv(server: loop_pb2.OpenEnvServer) -> None:
    url = urllib.parse.urlsplit(server.base_url)
    if url.scheme not in ("http", "https", "ws", "wss") or not url.hostname:
        raise InvalidField("environment.openenv.base_url", f"{server.base_url!r} is not an http(s) or ws(s) URL")
    _check_timeout("environment.openenv.step_seconds", server.step_seconds)


def _validate_program(program: loop_pb2.EnvironmentProgram) -> None:
    field = "environment.program"
    if not _ENTRY_RE.match(program.entry):
        raise InvalidField(f"{field}.entry", f"{program.entry!r} is not 'module:Class'")
    module = program.entry.partition(":")[0].replace(".", "/")
    if f"{module}.py" not in program.files and f"{module}/__init__.py" not in program.files:
        raise InvalidField(f"{field}.files", f"no {module}.py or {module}/__init__.py for entry {program.entry!r}")
    _validate_package(field, program)
    _check_timeout(f"{field}.step_seconds", program.step_seconds)


def _validate_verifiers(env: loop_pb2.Environment, environment: loop_pb2.VerifiersEnvironment) -> None:
    field = "environment.verifiers"
    if not _MODULE_RE.match(environment.environment_id.replace("-", "_")):
        raise InvalidField(f"{field}.environment_id", f"{environment.environment_id!r} is not a module's name")
    try:
        arguments = json.loads(environment.arguments_json or "{}")
    except ValueError as exc:
        raise InvalidField(f"{field}.arguments_json", f"not JSON: {exc}") from exc
    if not isinstance(arguments, dict):
        raise InvalidField(f"{field}.arguments_json", "load_environment's keyword arguments: a JSON object")
    _validate_package(field, environment)
    _check_timeout(f"{field}.step_seconds", environment.step_seconds)
    for name, tasks in (("tasks", env.tasks), ("eval_tasks", env.eval_tasks)):
        for i, task in enumerate(tasks):
            try:
                row = json.loads(task.prompt_text)
            except ValueError:
                row = None
            if not isinstance(row, dict) or not isinstance(row.get("prompt"), list):
                raise InvalidField(f"environment.{name}[{i}].prompt_text", "a verifiers task is its dataset row: "
                                                                         "a JSON object with a 'prompt' list")


def _validate_package(field: str, package: loop_pb2.EnvironmentProgram | loop_pb2.VerifiersEnvironment) -> None:
    """The files, dependencies and limits a session is given (a program's, a verifiers environment's)."""
    for path in package.files:
        parts = path.split("/")
        if not path or path.startswith("/") or ".." in parts or "" in parts or "\0" in path:
            raise InvalidField(f"{field}.files", f"{path!r} is not a relative path inside the package")
    if sum(len(c) for c in [*package.files.values(), *package.wheels.values()]) > MAX_PROGRAM_BYTES:
        raise InvalidField(f"{field}.files", f"more than {MAX_PROGRAM_BYTES} bytes with its wheels")
    for i, requirement in enumerate(package.requirements):
        # A specifier only: pip options (an index, a file to read) are the sandbox's to set.
        if not requirement.strip() or requirement.lstrip().startswith("-") or "\n" in requirement:
            raise InvalidField(f"{field}.requirements[{i}]", f"{requirement!r} is not a requirement specifier")
    for name in package.wheels:
        if "/" in name or not name.endswith(".whl") or name.count("-") < 4:
            raise InvalidField(f"{field}.wheels", f"{name!r} is not a wheel's file name "
                                                  "(name-version-python-abi-platform.whl)")
    _check_timeout(f"{field}.episode_seconds", package.episode_seconds)


def _validate_verifier(env: loop_pb2.Environment) -> None:
    verifier = env.builtin
    if verifier.kind == _VERIFIER.KIND_UNSPECIFIED:
        raise InvalidField("environment.builtin.kind", "is unspecified")
    if verifier.kind == _VERIFIER.KIND_NUMERIC_TOLERANCE and not (
        math.isfinite(verifier.tolerance) and verifier.tolerance >= 0
    ):
        raise InvalidField("environment.builtin.tolerance", "must be a finite number >= 0")
    if verifier.kind == _VERIFIER.KIND_REGEX and not verifier.pattern:
        raise InvalidField("environment.builtin.pattern", "a regex verifier needs a pattern")
    if verifier.pattern:
        try:
            re.compile(verifier.pattern)
        except re.error as exc:
            raise InvalidField("environment.builtin.pattern", f"not a valid regex: {exc}") from exc
    if verifier.kind != _VERIFIER.KIND_REGEX:
        for name, tasks in task_lists(env):
            for i, task in enumerate(tasks):
                if not task.answer:
                    raise InvalidField(f"environment.{name}[{i}].answer", "the verifier needs an answer")


def check_prompts_fit(env: loop_pb2.Environment, model: ModelContext) -> None:
    """Every task's prompt plus the environment's max_new_tokens must fit the model's context (the
    engine refuses what does not, sample by sample), and token ids must be in its vocabulary.
    A task's token ids are what the rollout generates from when it has them, else its text. A
    program's prompts are what its reset answers: known only when an episode starts."""
    if driver_of(env) is not None:
        return
    for name, tasks in task_lists(env):
        _check_tasks_fit(name, tasks, env, model)


def _check_tasks_fit(name: str, tasks: Sequence[loop_pb2.TaskSpec], env: loop_pb2.Environment,
                     model: ModelContext) -> None:
    for i, task in enumerate(tasks):
        top = max(task.prompt_token_ids, default=0)
        if model.vocab_size is not None and top >= model.vocab_size:
            raise InvalidField(f"environment.{name}[{i}].prompt_token_ids",
                               f"token id {top} is outside the model's vocabulary of {model.vocab_size}")
    context = model.context_tokens
    if context is None:
        return
    budget = env.sampling.max_new_tokens or DEFAULT_MAX_NEW_TOKENS
    if budget >= context:
        raise InvalidField("environment.sampling.max_new_tokens",
                           f"{budget} new tokens leave no room for a prompt in the model's context of {context} "
                           f"tokens ({model.path})")
    room = context - budget
    texts = {i: task.prompt_text for i, task in enumerate(tasks) if not task.prompt_token_ids}
    counts = dict(zip(texts, model.text_tokens(list(texts.values()), room), strict=True))
    for i, task in enumerate(tasks):
        if task.prompt_token_ids:
            field, tokens = f"environment.{name}[{i}].prompt_token_ids", len(task.prompt_token_ids)
            size = f"{tokens} tokens"
        else:
            field, tokens = f"environment.{name}[{i}].prompt_text", counts[i]
            size = f"at least {tokens} tokens"
            if tokens == 0:
                raise InvalidField(field, "the model's tokenizer gives no tokens for it (give prompt_token_ids)")
        if tokens > room:
            raise InvalidField(field, f"the prompt is {size}; with {budget} new tokens (max_new_tokens) it cannot "
                                      f"fit the model's context of {context} tokens ({model.path})")


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
    if env.max_turns > 1 and not env.tools and driver_of(env) is None:
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
    if request.HasField("lora"):
        lora_spec(request.lora)


def lora_spec(spec: loop_pb2.LoraSpec) -> LoraSpec:
    """A run's LoRA spec with its defaults filled in; InvalidField naming lora.<field> otherwise."""
    try:
        return LoraSpec.from_proto(spec)
    except ValidationError as exc:
        error = exc.errors()[0]
        where = ".".join(str(part) for part in error["loc"] if not isinstance(part, int))
        raise InvalidField(f"lora.{where}" if where else "lora", error["msg"]) from None


def check_run_against_learner(request: loop_pb2.StartRunRequest, learner: status_pb2.LearnerStatus | None) -> None:
    """Refuses a run whose model, max_lag or loss settings differ from what the running learner
    does (`learner`: the status it advertises; None: no learner is up yet, so only the names are
    checked). One learner serves the cluster: settings it would silently ignore are an error,
    not a wish."""
    wanted = named_in(request.loss)
    for name, value in sorted(wanted.items(), key=lambda item: item[0] != "kind"):
        problem = setting_problem(name, value, wanted.get("kind"))
        if problem:
            raise InvalidField(f"loss.{name}", problem)
    if learner is None:
        return
    if request.HasField("lora") and not learner.lora_runs:
        raise FailedPrecondition("lora", "the cluster's learner trains no LoRA runs (start it with --lora-runs)")
    if not learner.full_model and not request.HasField("lora"):
        raise FailedPrecondition("lora", "the cluster's learner trains LoRA runs only: give the run a LoRA spec "
                                         "(--lora-rank)")
    if request.model and request.model != learner.loop.model:
        raise FailedPrecondition("model", f"the cluster's learner trains {learner.loop.model!r}, "
                                          f"not {request.model!r}")
    if request.HasField("max_lag") and request.max_lag != learner.loop.max_lag:
        raise FailedPrecondition("max_lag", f"the cluster runs with max_lag {learner.loop.max_lag}, not "
                                            f"{request.max_lag} (start the learner and rollout with --max-lag)")
    running = named_in(learner.loss)
    for name, value in sorted(wanted.items()):
        if name not in running:
            raise FailedPrecondition(f"loss.{name}", f"the cluster's learner runs the {running.get('kind')} loss, "
                                                     f"which has no {name}")
        if not _same_setting(running[name], value):
            raise FailedPrecondition(f"loss.{name}", f"the cluster's learner runs {name}={running[name]}, not {value} "
                                                     f"(start it with --loss.{name.replace('_', '-')} {value})")


def _same_setting(running: object, wanted: object) -> bool:
    if isinstance(running, float) and isinstance(wanted, float):
        return math.isclose(wanted, running, rel_tol=1e-9, abs_tol=0.0)
    return running == wanted
