"""What `policyloop env` and `policyloop run` do: build environments from JSONL task files and
talk to a gateway's LoopService (the same API any gRPC client uses)."""

from __future__ import annotations

import json
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc

from policyloop.contracts.v1 import bus_pb2, loop_pb2, loop_pb2_grpc
from policyloop.envs.driven import Driver, set_driver
from policyloop.scorers.kinds import SCORERS
from policyloop.scorers.reward_model import normalization_value


class TaskFileError(ValueError):
    """A JSONL task file that cannot become tasks: names the line and the field."""


TASK_FIELDS = frozenset({"prompt", "answer", "prompt_token_ids", "metadata", "demonstration",
                         "demonstration_token_ids"})


def read_tasks(path: Path) -> list[loop_pb2.TaskSpec]:
    """One task per line: {"prompt": str, "answer"?: str, "prompt_token_ids"?: [int], "metadata"?: {str: str}}
    (for unit tests, metadata carries `tests` and `solution_prefix`); a supervised environment's
    tasks add "demonstration" (text) or "demonstration_token_ids"."""
    tasks = []
    for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as exc:
            raise TaskFileError(f"{path}:{number}: not JSON ({exc})") from None
        if not isinstance(row, dict) or not isinstance(row.get("prompt", ""), str):
            raise TaskFileError(f"{path}:{number}: prompt: expected an object with a string prompt")
        metadata = row.get("metadata", {})
        if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
            raise TaskFileError(f"{path}:{number}: metadata: expected an object of strings")
        unknown = set(row) - TASK_FIELDS
        if unknown:
            raise TaskFileError(f"{path}:{number}: {sorted(unknown)[0]}: unknown field")
        for key in ("prompt_token_ids", "demonstration_token_ids"):
            ids = row.get(key, [])
            if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
                raise TaskFileError(f"{path}:{number}: {key}: expected a list of token ids")
        if not isinstance(row.get("demonstration", ""), str):
            raise TaskFileError(f"{path}:{number}: demonstration: expected a string")
        tasks.append(loop_pb2.TaskSpec(prompt_text=row.get("prompt", ""), answer=str(row.get("answer", "")),
                                       prompt_token_ids=row.get("prompt_token_ids", []), metadata=metadata,
                                       demonstration_text=row.get("demonstration", ""),
                                       demonstration_token_ids=row.get("demonstration_token_ids", [])))
    return tasks


def read_program(path: Path, entry: str, *, step_seconds: float = 0.0, episode_seconds: float = 0.0,
                 requirements: list[str] | None = None, wheels: list[Path] | None = None
                 ) -> bus_pb2.EnvironmentProgram:
    """An environment program from a module (`desk.py`), a package directory (its files, under the
    package's name) or a pure-Python wheel (its files, less its .dist-info); its dependencies as
    requirement specifiers and wheel files, which the sandbox installs."""
    return bus_pb2.EnvironmentProgram(files=read_package(path, "--program"), entry=entry, step_seconds=step_seconds,
                                      episode_seconds=episode_seconds, requirements=requirements or [],
                                      wheels={Path(w).name: Path(w).read_bytes() for w in wheels or []})


def read_verifiers(environment_id: str, source: Path | None = None, *, arguments_json: str = "",
                   step_seconds: float = 0.0, episode_seconds: float = 0.0, requirements: list[str] | None = None,
                   wheels: list[Path] | None = None) -> bus_pb2.VerifiersEnvironment:
    """A verifiers environment: its id, its source when it is not installed from a wheel or a
    requirement (a module, a package directory or a pure-Python wheel, as for programs)."""
    return bus_pb2.VerifiersEnvironment(
        environment_id=environment_id, arguments_json=arguments_json,
        files=read_package(source, "--env-source") if source is not None else {}, step_seconds=step_seconds,
        episode_seconds=episode_seconds, requirements=requirements or [],
        wheels={Path(w).name: Path(w).read_bytes() for w in wheels or []})


def read_package(path: Path, flag: str) -> dict[str, bytes]:
    """A package's files by path: a module's, a directory's (under its name), or a pure-Python
    wheel's (less its .dist-info)."""
    path = Path(path)
    files: dict[str, bytes] = {}
    if path.suffix == ".whl":
        try:
            with zipfile.ZipFile(path) as wheel:
                files = {n: wheel.read(n) for n in wheel.namelist()
                         if not n.endswith("/") and ".dist-info/" not in n and ".data/" not in n}
        except zipfile.BadZipFile as exc:
            raise ValueError(f"{flag} {path}: not a wheel ({exc})") from exc
    elif path.is_dir():
        files = {str(f.relative_to(path.parent)): f.read_bytes() for f in sorted(path.rglob("*"))
                 if f.is_file() and "__pycache__" not in f.parts}
    else:
        files = {path.name: path.read_bytes()}
    return files


def build_environment(name: str, version: str, tasks: list[loop_pb2.TaskSpec], scorer: str, *,
                      pattern: str = "", tolerance: float = 0.0, code: str = "", timeout_s: float = 10.0,
                      group_size: int = 8, max_new_tokens: int = 32, temperature: float = 1.0,
                      max_turns: int = 0, tools: list[str] | None = None, supervised: bool = False,
                      driver: Driver | None = None, reward_model: str = "",
                      normalization: str = "none", judge: loop_pb2.JudgeScorer | None = None) -> loop_pb2.Environment:
    """An Environment; the gateway validates it (and names what is wrong). With a `driver` (a
    program, an OpenEnv server, a verifiers environment) the scorer is the rewards it gives
    (environment_reward)."""
    env = loop_pb2.Environment(name=name, version=version, tasks=tasks, group_size=group_size, supervised=supervised,
                               sampling=bus_pb2.SamplingParams(max_new_tokens=max_new_tokens,
                                                               temperature=temperature),
                               max_turns=max_turns, tools=tools or [])
    if driver is not None:
        set_driver(env, driver)
        scorer = "environment_reward"
    if scorer == "environment_reward":
        env.environment_reward.CopyFrom(loop_pb2.EnvironmentRewardScorer())
    elif scorer in SCORERS and SCORERS[scorer].builtin is not None:
        env.builtin.CopyFrom(loop_pb2.BuiltinVerifier(kind=SCORERS[scorer].builtin, pattern=pattern,  # type: ignore[arg-type]
                                                      tolerance=tolerance))
    elif scorer == "unit_tests":
        env.unit_tests.CopyFrom(loop_pb2.UnitTestScorer(test_code=code, timeout_seconds=timeout_s))
    elif scorer == "reward_code":
        env.reward_code.CopyFrom(loop_pb2.RewardCodeScorer(source=code, timeout_seconds=timeout_s))
    elif scorer == "reward_model":
        env.reward_model.CopyFrom(loop_pb2.RewardModelScorer(
            model=reward_model, normalization=normalization_value(normalization)))
    elif scorer == "judge":
        env.judge.CopyFrom(judge or loop_pb2.JudgeScorer())
    else:
        raise ValueError(f"scorer must be one of {', '.join(SCORERS)}, got {scorer!r}")
    return env


def parse_mix(values: list[str]) -> list[loop_pb2.EnvironmentMix]:
    """["name@v1=0.7", "other@v2"] → mixes (weight 1 when not given)."""
    mixes = []
    for value in values:
        env, _, weight = value.partition("=")
        try:
            mixes.append(loop_pb2.EnvironmentMix(environment=env, weight=float(weight) if weight else 1.0))
        except ValueError:
            raise ValueError(f"--env {value!r}: the weight after '=' must be a number") from None
    return mixes


def gateway_address(gateway: str | None, run_dir: Path) -> str:
    """--gateway, or the gateway of the `policyloop up` cluster in run_dir."""
    if gateway:
        return gateway
    from policyloop.cluster.local import ClusterInfo

    info = ClusterInfo.load(run_dir)
    return f"127.0.0.1:{info.processes['gateway-0']['grpc']}"


UPLOAD_MESSAGE_BYTES = 1024 * 1024


def upload_messages(env: loop_pb2.Environment, message_bytes: int) -> Iterator[loop_pb2.UploadEnvironmentRequest]:
    """The environment without its tasks, then its tasks and then its eval tasks in order, as many
    per message as fit in about `message_bytes` (at least one)."""
    header = loop_pb2.Environment()
    header.CopyFrom(env)
    del header.tasks[:]
    del header.eval_tasks[:]
    yield loop_pb2.UploadEnvironmentRequest(environment=header)
    for field in ("tasks", "eval_tasks"):
        chunk: list[loop_pb2.TaskSpec] = []
        size = 0
        for task in getattr(env, field):
            task_bytes = task.ByteSize() + 8  # the field's tag and length
            if chunk and size + task_bytes > message_bytes:
                yield loop_pb2.UploadEnvironmentRequest(**{field: chunk})
                chunk, size = [], 0
            chunk.append(task)
            size += task_bytes
        if chunk:
            yield loop_pb2.UploadEnvironmentRequest(**{field: chunk})


class LoopClient:
    """A blocking LoopService client with the optional bearer token on every call."""

    def __init__(self, address: str, token: str = "", timeout_s: float = 30.0) -> None:
        self.channel = grpc.insecure_channel(address)
        self.stub = loop_pb2_grpc.LoopServiceStub(self.channel)
        self.metadata = [("authorization", f"Bearer {token}")] if token else []
        self.timeout_s = timeout_s

    def submit(self, env: loop_pb2.Environment, message_bytes: int = UPLOAD_MESSAGE_BYTES
               ) -> loop_pb2.SubmitEnvironmentResponse:
        """SubmitEnvironment, or UploadEnvironment in messages of about `message_bytes` when the
        environment is larger (gRPC caps one message at 4 MiB by default)."""
        if env.ByteSize() <= message_bytes:
            return self.stub.SubmitEnvironment(loop_pb2.SubmitEnvironmentRequest(environment=env),
                                               timeout=self.timeout_s, metadata=self.metadata)
        return self.stub.UploadEnvironment(upload_messages(env, message_bytes), timeout=self.timeout_s,
                                           metadata=self.metadata)

    def start(self, request: loop_pb2.StartRunRequest) -> loop_pb2.Run:
        return self.stub.StartRun(request, timeout=self.timeout_s, metadata=self.metadata)

    def stop(self, run_id: str) -> loop_pb2.Run:
        return self.stub.StopRun(loop_pb2.StopRunRequest(run_id=run_id), timeout=self.timeout_s,
                                 metadata=self.metadata)

    def get(self, run_id: str) -> loop_pb2.Run:
        return self.stub.GetRun(loop_pb2.GetRunRequest(run_id=run_id), timeout=self.timeout_s,
                                metadata=self.metadata)

    def watch(self, run_id: str) -> Iterator[loop_pb2.Run]:
        return self.stub.WatchRun(loop_pb2.WatchRunRequest(run_id=run_id), metadata=self.metadata)

    def promote(self, run_id: str, version: int, reason: str = "", *, force: bool = False) -> loop_pb2.Promotion:
        return self.stub.PromoteVersion(loop_pb2.PromoteVersionRequest(run_id=run_id, version=version, reason=reason,
                                                                       force=force),
                                        timeout=self.timeout_s, metadata=self.metadata)

    def rollback(self, run_id: str, version: int = 0, reason: str = "") -> loop_pb2.Promotion:
        return self.stub.RollbackVersion(loop_pb2.RollbackVersionRequest(run_id=run_id, version=version,
                                                                         reason=reason),
                                         timeout=self.timeout_s, metadata=self.metadata)

    def list_versions(self, run_id: str) -> loop_pb2.ListRunVersionsResponse:
        return self.stub.ListVersions(loop_pb2.ListRunVersionsRequest(run_id=run_id), timeout=self.timeout_s,
                                      metadata=self.metadata)

    def close(self) -> None:
        self.channel.close()


def progress_line(run: loop_pb2.Run) -> str:
    """One line of a run's progress, for `policyloop run watch`."""
    p = run.progress
    envs = "  ".join(f"{name} {e.last_step_reward:.3f} ({e.trained_samples})"
                     for name, e in sorted(p.environments.items()))
    lags = ",".join(f"{k}:{v}" for k, v in sorted(p.lag_histogram.items()))
    return (f"{loop_pb2.RunState.Name(run.state).removeprefix('RUN_STATE_').lower():8} v{run.policy_version} "
            f"step {p.learner_step}  tasks {run.tasks_enqueued}/{run.tasks_total}  reward {envs or '-'}  "
            f"lag {{{lags}}}  {p.generated_tokens_per_second:.0f} gen tok/s  "
            f"{p.trained_tokens_per_second:.0f} trained tok/s  dropped {p.dropped_samples}  "
            f"tasks trained {p.tasks_trained} dropped {p.tasks_dropped} dead-lettered {p.tasks_dead_lettered} "
            f"in flight {p.tasks_in_flight}")


def version_line(row: loop_pb2.RunVersion) -> str:
    """One line of a run's version, for `policyloop versions list`."""
    evaluated = "not evaluated"
    if row.HasField("eval"):
        e = row.eval
        evaluated = (f"pass {e.pass_rate:.1%} [{e.pass_rate_low:.1%}, {e.pass_rate_high:.1%}]"
                     + ("  REGRESSED" if e.regressed else ""))
    marks = ("  SERVING" if row.serving else "") + (f"  promoted #{','.join(map(str, row.promotions))}"
                                                    if row.promotions else "")
    return f"v{row.version:<6} step {row.step:<6} {'kept' if row.kept else 'gone'}  {evaluated}{marks}"


def train_and_print(gateway: str, env: loop_pb2.Environment, num_tasks: int) -> None:
    """What the examples do: train_and_report against `gateway`, a line per learner step, then the
    summary as one JSON line."""
    client = LoopClient(gateway)
    try:
        summary = train_and_report(client, env, num_tasks,
                                   lambda step, reward: print(f"step {step:4d}  reward {reward:+.3f}", flush=True))
    finally:
        client.close()
    print(json.dumps(summary))


def train_and_report(client: LoopClient, env: loop_pb2.Environment, num_tasks: int,
                     on_step: Callable[[int, float], None] | None = None) -> dict[str, object]:
    """Submits `env`, trains a run of `num_tasks` groups on it until it ends, and reports the
    environment's mean reward per learner step (to `on_step` as it comes) and a summary: its mean
    over the first and the last quarter of the steps."""
    submitted = client.submit(env)
    run = client.start(loop_pb2.StartRunRequest(
        num_tasks=num_tasks, environments=[loop_pb2.EnvironmentMix(environment=submitted.environment, weight=1)]))
    rewards: dict[int, float] = {}  # learner step -> the environment's mean reward over its samples
    state = run.state
    for update in client.watch(run.run_id):
        state, step = update.state, update.progress.learner_step
        progress = update.progress.environments.get(submitted.environment)
        if progress is not None and step and step not in rewards:
            rewards[step] = progress.last_step_reward
            if on_step is not None:
                on_step(step, rewards[step])
    steps = sorted(rewards)
    quarter = max(1, len(steps) // 4)
    return {"run": run.run_id, "environment": submitted.environment, "state": loop_pb2.RunState.Name(state),
            "steps": len(steps),
            "reward_first_quarter": round(sum(rewards[s] for s in steps[:quarter]) / quarter, 4) if steps else None,
            "reward_last_quarter": round(sum(rewards[s] for s in steps[-quarter:]) / quarter, 4) if steps else None}
