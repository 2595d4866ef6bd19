"""Validation of LoopService requests. Every error names the offending field, so the gateway
can answer INVALID_ARGUMENT with a message a user can act on."""

from __future__ import annotations

import ast
import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from policyloop.contracts.v1 import loop_pb2
from policyloop.envs.code import REWARD_FUNCTION, test_functions
from policyloop.envs.feeding import DEFAULT_MAX_NEW_TOKENS
from policyloop.envs.tools import TOOL_FORMATS

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_\-]{0,63}$")
VERSION_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,31}$")
MAX_TASKS_PER_ENVIRONMENT = 1_000_000
MAX_GROUP_SIZE = 1024
MAX_TURNS = 16
MAX_CODE_TIMEOUT_S = 600.0  # a code scorer's job; the sandbox caps it again by its own ceiling
# An environment is stored as one Redis value, and Redis refuses values over 512 MB.
MAX_ENVIRONMENT_BYTES = 256 * 1024 * 1024
# Without the model's tokenizer a text prompt is counted as at least one token per this many
# UTF-8 bytes. No token of a BPE, unigram or character vocabulary covers that much, so the bound
# refuses no prompt that fits, and still refuses one that is far too long. (A word-level
# vocabulary that maps a whole unknown word to one token could beat it.)
MAX_BYTES_PER_TOKEN = 256
# config.json keys that give a model's context length, in the order Hugging Face models use them.
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")
# What the parser raises besides SyntaxError: ValueError for null bytes (before 3.12),
# MemoryError and RecursionError for nesting deeper than its stack.
_PARSE_ERRORS = (SyntaxError, ValueError, MemoryError, RecursionError)


class InvalidField(ValueError):
    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field = field


def environment_key(name: str, version: str) -> str:
    return f"{name}@{version}"


@dataclass(frozen=True)
class ModelContext:
    """What the cluster's model can take, read from its Hugging Face directory: the context
    length, the vocabulary size and the tokenizer (None where `tokenizers` or tokenizer.json is
    missing: text is then counted by MAX_BYTES_PER_TOKEN)."""

    path: str
    context_tokens: int | None
    vocab_size: int | None
    tokenizer: Any | None = None

    @property
    def measure(self) -> str:
        return "the model's tokenizer" if self.tokenizer is not None else f"{MAX_BYTES_PER_TOKEN} bytes per token"

    def text_tokens(self, texts: Sequence[str], room: int) -> list[int]:
        """Each text's token count as the rollout will tokenize it (no special tokens), or a lower
        bound: exact where the tokenizer is loaded and the text may fit within `room`."""
        bounds = [-(-len(text.encode()) // MAX_BYTES_PER_TOKEN) for text in texts]
        if self.tokenizer is None:
            return bounds
        # Texts already too long by the byte bound are not tokenized (a 6 MB prompt costs nothing).
        maybe = [i for i, bound in enumerate(bounds) if bound <= room]
        for start in range(0, len(maybe), 4096):
            chunk = maybe[start:start + 4096]
            encoded = self.tokenizer.encode_batch([texts[i] for i in chunk], add_special_tokens=False)
            for i, encoding in zip(chunk, encoded, strict=True):
                bounds[i] = len(encoding.ids)
        return bounds


def load_model_context(path: Path) -> ModelContext:
    """Reads the context length and vocabulary from `path`/config.json and loads
    `path`/tokenizer.json with `tokenizers` where it can. Raises ValueError when config.json
    cannot be read."""
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"model_path: cannot read {path / 'config.json'}: {exc}") from exc
    if not isinstance(config, dict):
        raise ValueError(f"model_path: {path / 'config.json'} is not a JSON object")
    context = next((config[k] for k in CONTEXT_KEYS if isinstance(config.get(k), int) and config[k] > 0), None)
    vocab = config.get("vocab_size") if isinstance(config.get("vocab_size"), int) else None
    return ModelContext(str(path), context, vocab, _load_tokenizer(path / "tokenizer.json"))


def _load_tokenizer(path: Path) -> Any | None:
    try:
        from tokenizers import Tokenizer
    except ImportError:  # the light image may lack it: prompts are then bounded by bytes
        return None
    try:
        return Tokenizer.from_file(str(path))
    except Exception:  # noqa: BLE001 - a missing or foreign tokenizer file: the byte bound still holds
        return None


def validate_environment(env: loop_pb2.Environment, model: ModelContext | None = None) -> None:
    """Raises InvalidField for the first thing wrong with `env`. With `model`, prompts must fit
    its context together with the generation budget, and token ids its vocabulary."""
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
        _check_reward_code(env.reward_code.source)
        _check_timeout("environment.reward_code.timeout_seconds", env.reward_code.timeout_seconds)
    if env.group_size > MAX_GROUP_SIZE:
        raise InvalidField("environment.group_size", f"at most {MAX_GROUP_SIZE}")
    sampling = env.sampling
    if sampling.temperature < 0 or not math.isfinite(sampling.temperature):
        raise InvalidField("environment.sampling.temperature", "must be a finite number >= 0")
    if not 0 <= sampling.top_p <= 1:
        raise InvalidField("environment.sampling.top_p", "must be within [0, 1] (0: engine default)")
    _validate_turns(env)
    if model is not None:
        check_prompts_fit(env, model)


def check_prompts_fit(env: loop_pb2.Environment, model: ModelContext) -> None:
    """Every task's prompt plus the environment's max_new_tokens must fit the model's context (the
    engine refuses what does not, sample by sample), and token ids must be in its vocabulary.
    A task's token ids are what the rollout generates from when it has them, else its text."""
    for i, task in enumerate(env.tasks):
        top = max(task.prompt_token_ids, default=0)
        if model.vocab_size is not None and top >= model.vocab_size:
            raise InvalidField(f"environment.tasks[{i}].prompt_token_ids",
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
    texts = {i: task.prompt_text for i, task in enumerate(env.tasks) if not task.prompt_token_ids}
    counts = dict(zip(texts, model.text_tokens(list(texts.values()), room), strict=True))
    for i, task in enumerate(env.tasks):
        if task.prompt_token_ids:
            field, tokens = f"environment.tasks[{i}].prompt_token_ids", len(task.prompt_token_ids)
            size = f"{tokens} tokens"
        else:
            field, tokens = f"environment.tasks[{i}].prompt_text", counts[i]
            size = f"at least {tokens} tokens"
            if tokens == 0:
                raise InvalidField(field, "the model's tokenizer gives no tokens for it (give prompt_token_ids)")
        if tokens > room:
            raise InvalidField(field, f"the prompt is {size}; with {budget} new tokens (max_new_tokens) it cannot "
                                      f"fit the model's context of {context} tokens ({model.path})")


def _check_reward_code(source: str) -> None:
    """The harness runs the source and calls `reward(prompt, completion, metadata)`: code that does
    not parse, or binds no `reward` at the top level, or whose `def reward` cannot take those three
    arguments or is async, can never score a sample."""
    field = "environment.reward_code.source"
    if not source:
        raise InvalidField(field, "is empty")
    try:
        tree = ast.parse(source)
    except _PARSE_ERRORS as exc:
        raise _unparsable(field, exc) from exc
    if _binds_dynamically(tree, REWARD_FUNCTION):
        return
    bindings = _module_bindings(tree, REWARD_FUNCTION)
    if not bindings:
        raise InvalidField(field, f"defines no top-level `{REWARD_FUNCTION}`: the sandbox calls "
                                  f"{REWARD_FUNCTION}(prompt, completion, metadata)")
    for node in bindings:
        if isinstance(node, ast.AsyncFunctionDef):
            raise InvalidField(field, f"line {node.lineno}: `async def {REWARD_FUNCTION}` returns a coroutine, "
                                      "not a number; define it with `def`")
        if isinstance(node, ast.FunctionDef) and not node.decorator_list and not _takes_three(node.args):
            raise InvalidField(field, f"line {node.lineno}: `{REWARD_FUNCTION}` cannot be called as "
                                      f"{REWARD_FUNCTION}(prompt, completion, metadata)")


def _unparsable(field: str, exc: BaseException) -> InvalidField:
    if isinstance(exc, SyntaxError):
        where = f" (line {exc.lineno})" if exc.lineno else ""
        return InvalidField(field, f"does not parse: {exc.msg}{where}")
    return InvalidField(field, f"does not parse: {exc or 'nested too deeply'}")


def _binds_dynamically(tree: ast.Module, name: str) -> bool:
    """`global name` in a function or `from m import *` may bind it where the parse cannot see."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Global) and name in node.names:
            return True
        if isinstance(node, ast.ImportFrom) and any(alias.name == "*" for alias in node.names):
            return True
    return False


_NEW_SCOPES = (ast.Lambda, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)


def _module_bindings(tree: ast.Module, name: str) -> list[ast.AST]:
    """The nodes that bind `name` in the module's namespace (not inside a function or class)."""
    found: list[ast.AST] = []
    pending: list[ast.AST] = [tree]
    while pending:
        for child in ast.iter_child_nodes(pending.pop()):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                if child.name == name:
                    found.append(child)
            elif isinstance(child, ast.Name) and isinstance(child.ctx, ast.Store) and child.id == name:
                found.append(child)
            elif isinstance(child, ast.alias) and (child.asname or child.name.split(".")[0]) == name:
                found.append(child)
            elif not isinstance(child, _NEW_SCOPES):
                pending.append(child)
    return found


def _takes_three(args: ast.arguments) -> bool:
    """Whether a function with these parameters can be called with three positional arguments."""
    positional = len(args.posonlyargs) + len(args.args)
    required = positional - len(args.defaults)
    return (required <= 3 and (positional >= 3 or args.vararg is not None)
            and all(default is not None for default in args.kw_defaults))


def _check_unit_tests(env: loop_pb2.Environment) -> None:
    """Every task must have tests to run: top-level `def test_*` functions in the shared test_code
    or its own metadata.tests (tests may come with each task), in Python that parses."""

    def tests_in(source: str, field: str) -> list[str]:
        try:
            return test_functions(source)
        except _PARSE_ERRORS as exc:
            raise _unparsable(field, exc) from exc

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
