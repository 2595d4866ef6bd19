"""`policyloop env` and `policyloop run`: environments and runs through a gateway's LoopService."""

from __future__ import annotations

import asyncio
import json
import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from policyloop.scorers.judge import verdict_kinds
from policyloop.scorers.kinds import SCORER_KINDS
from policyloop.scorers.reward_model import normalizations

if TYPE_CHECKING:
    pass

from policyloop.cli.common import DEFAULT_RUN_DIR, app, console

# -- environments and runs through the gateway's LoopService ----------------------------------

env_app = typer.Typer(no_args_is_help=True, help="Environments on a running cluster (LoopService).")
run_app = typer.Typer(no_args_is_help=True, help="Runs on a running cluster (LoopService).")
app.add_typer(env_app, name="env")
app.add_typer(run_app, name="run")

GatewayOption = Annotated[str | None, typer.Option(
    help="host:port of a gateway (default: the `policyloop up` cluster in --run-dir).")]
RunDirOption = Annotated[Path, typer.Option(help="Run directory of `policyloop up` (finds its gateway).")]
TokenOption = Annotated[str, typer.Option(envvar="POLICYLOOP_TOKEN", help="Bearer token, if the gateway wants one.")]


def loop_client(gateway: str | None, run_dir: Path, token: str):  # type: ignore[no-untyped-def]
    from policyloop.cluster.client import LoopClient, gateway_address
    from policyloop.cluster.local import ClusterError

    try:
        return LoopClient(gateway_address(gateway, run_dir), token)
    except ClusterError as exc:
        console.print(f"[red]{exc}[/red] (or give --gateway host:port)")
        raise typer.Exit(2) from exc


def with_gateway(gateway: str | None, run_dir: Path, token: str, call):  # type: ignore[no-untyped-def]
    """`call(client)` on a LoopService client; a refused call prints the gateway's status and
    reason and exits 1."""
    import grpc

    client = loop_client(gateway, run_dir, token)
    try:
        return call(client)
    except KeyboardInterrupt:
        return None
    except grpc.RpcError as exc:
        console.print(f"[red]{exc.code().name}[/red]: {exc.details()}")  # type: ignore[attr-defined]
        raise typer.Exit(1) from exc
    finally:
        client.close()


def _judge(name: str, model: str, template: Path | None, verdict: str, labels: list[str], json_field: str,
           score_range: str, max_tokens: int, timeout_s: float) -> Any:
    """The judge scorer the flags describe; ValueError naming the flag that is wrong."""
    from policyloop.scorers.judge import judge_spec

    values = {}
    for entry in labels:
        label, sep, reward = entry.rpartition("=")
        try:
            value = float(reward)
        except ValueError:
            value = math.nan
        if not sep or not math.isfinite(value):
            raise ValueError(f"--label {entry!r}: LABEL=REWARD, the reward a number")
        values[label] = value
    low, high = 0.0, 0.0
    if score_range:
        try:
            low, high = (float(v) for v in score_range.split(","))
        except ValueError:
            raise ValueError(f"--score-range {score_range!r}: MIN,MAX") from None
    return judge_spec(name, template.read_text() if template else "", model=model, verdict_kind=verdict,
                      labels=values, json_field=json_field, min_score=low, max_score=high, max_tokens=max_tokens,
                      timeout_s=timeout_s)


# The scorer kinds' table (scorers.kinds) is the help's list.
ScorerOption = Annotated[str, typer.Option(help="; ".join(f"{kind.name}: {kind.rewards}" for kind in SCORER_KINDS) +
                                           " (with --program, --openenv or --verifiers: environment_reward).")]
PatternOption = Annotated[str, typer.Option(help="regex: the pattern a completion must match; exact_answer: the "
                                                 "answer's format, a completion must match it whole to earn the "
                                                 "format term.")]


# The model scorers' flags (reward_model, judge).
RewardModelOption = Annotated[str, typer.Option(help="reward_model: the reward model's name (one the reward service's "
                                                     "reward_models.engines names).")]
NormalizationOption = Annotated[str, typer.Option(help="reward_model: how its score becomes the reward (" +
                                                       ", ".join(normalizations()) + ").")]
JudgeOption = Annotated[str, typer.Option(help="judge: the judge's name (one the reward service's judges.endpoints "
                                               "names).")]
JudgeModelOption = Annotated[str, typer.Option(help="judge: the model to ask (default: the endpoint's).")]
JudgeTemplateOption = Annotated[Path | None, typer.Option(
    help="judge: a file holding the judge's prompt, with {response} and optionally {prompt} and {answer}.")]
VerdictOption = Annotated[str, typer.Option(help="judge: how its reply is read (" + ", ".join(verdict_kinds()) +
                                                 ").")]
LabelOption = Annotated[list[str] | None, typer.Option(
    help="judge: LABEL=REWARD, once per label (label verdicts; a JSON verdict's string values).")]
JsonFieldOption = Annotated[str, typer.Option(help="judge: the JSON verdict's field (default: score).")]
ScoreRangeOption = Annotated[str, typer.Option(
    help="judge: MIN,MAX of a number verdict, mapped onto [0, 1] (default: the number itself).")]
JudgeMaxTokensOption = Annotated[int, typer.Option(help="judge: the reply's token budget (0: 64).")]

# What drives an environment's episodes: a program, a verifiers environment, an OpenEnv server.
ProgramOption = Annotated[Path | None, typer.Option(
    help="An environment program (reset/step, see docs/environments.md): a module, a package directory or a "
         "pure-Python wheel, run in a sandbox session per episode; its tasks are what reset is given.")]
EntryOption = Annotated[str, typer.Option(help="--program: its class, as module:Class.")]
StepTimeoutOption = Annotated[float, typer.Option(
    help="--program, --verifiers: most seconds of one exchange (0: 10; verifiers, its loading included: 60).")]
EpisodeTimeoutOption = Annotated[float, typer.Option(
    help="--program, --verifiers: most seconds of an episode (0: 60; verifiers: 300).")]
RequirementOption = Annotated[list[str] | None, typer.Option(
    help="--program, --verifiers: a dependency, as a pip requirement (e.g. sortedcontainers==2.4.0), once per "
         "requirement; the sandbox installs wheels only.")]
WheelOption = Annotated[list[Path] | None, typer.Option(
    help="--program, --verifiers: a wheel file it depends on, once per wheel.")]
VerifiersOption = Annotated[str, typer.Option(
    help="A verifiers environment's id (vf.load_environment), run unchanged in a sandbox session per episode "
         "and scored by its rubric; installed here too, its dataset and eval dataset are the tasks.")]
EnvSourceOption = Annotated[Path | None, typer.Option(
    help="--verifiers: the environment's module, package directory or wheel, when no --wheel or "
         "--requirement installs it.")]
EnvArgsOption = Annotated[str, typer.Option(help="--verifiers: load_environment's keyword arguments, a JSON object.")]
TaskCountOption = Annotated[int, typer.Option(help="--verifiers: the first N dataset rows (0: all).")]
EvalCountOption = Annotated[int, typer.Option(help="--verifiers: the first N eval dataset rows (0: all).")]
OpenenvOption = Annotated[str, typer.Option(
    help="An OpenEnv environment server's URL: each episode a session of its own, scored by the rewards it gives.")]
ActionFieldOption = Annotated[str, typer.Option(help="--openenv: the action's text field (default: message).")]
ObservationFieldOption = Annotated[str, typer.Option(
    help="--openenv: the observation's field the model is shown (default: all of it, as JSON).")]


@env_app.command("submit")
def env_submit(
    name: Annotated[str, typer.Option(help="Environment name.")],
    tasks: Annotated[Path | None, typer.Argument(
        help="JSONL, one task per line: {prompt, answer?, prompt_token_ids?, metadata?} (unit tests: metadata.tests, "
             "metadata.solution_prefix; --supervised: demonstration or demonstration_token_ids). With --verifiers: "
             "omit it, the environment's dataset is the tasks.")] = None,
    version: Annotated[str, typer.Option(help="Environment version (name@version is its key).")] = "v1",
    scorer: ScorerOption = "exact_answer",
    pattern: PatternOption = "",
    tolerance: Annotated[float, typer.Option(help="numeric_tolerance: the allowed difference.")] = 0.0,
    reward_model: RewardModelOption = "",
    normalization: NormalizationOption = "none",
    judge: JudgeOption = "",
    judge_model: JudgeModelOption = "",
    judge_template: JudgeTemplateOption = None,
    verdict: VerdictOption = "number",
    label: LabelOption = None,
    json_field: JsonFieldOption = "",
    score_range: ScoreRangeOption = "",
    judge_max_tokens: JudgeMaxTokensOption = 0,
    code: Annotated[Path | None, typer.Option(help="unit_tests: shared test code; reward_code: the source "
                                                   "defining reward(prompt, completion, metadata).")] = None,
    timeout_s: Annotated[float, typer.Option(
        help="Time limit of one scoring: a code scorer's sandbox job, a judge's reply.")] = 10.0,
    group_size: Annotated[int, typer.Option(help="Samples per prompt.")] = 8,
    max_new_tokens: Annotated[int, typer.Option(help="Token budget of one sample.")] = 32,
    temperature: Annotated[float, typer.Option(help="Sampling temperature.")] = 1.0,
    max_turns: Annotated[int, typer.Option(help="Multi-turn: most model turns, with tool turns between them.")] = 0,
    tool: Annotated[list[str] | None, typer.Option(help="A tool the policy may call (python), once per tool.")]
    = None,
    eval_tasks: Annotated[Path | None, typer.Option(
        help="JSONL like TASKS: the held-out split the evaluator scores versions on (never trained on).")] = None,
    supervised: Annotated[bool, typer.Option(
        help="Supervised (SFT): every task gives a demonstration (text, or demonstration_token_ids) that runs "
             "train on by cross-entropy; nothing is sampled or scored, the scorer judges only --eval-tasks.")]
    = False,
    program: ProgramOption = None,
    entry: EntryOption = "",
    step_timeout_s: StepTimeoutOption = 0.0,
    episode_timeout_s: EpisodeTimeoutOption = 0.0,
    requirement: RequirementOption = None,
    wheel: WheelOption = None,
    verifiers: VerifiersOption = "",
    env_source: EnvSourceOption = None,
    env_args: EnvArgsOption = "",
    task_count: TaskCountOption = 0,
    eval_count: EvalCountOption = 0,
    openenv: OpenenvOption = "",
    action_field: ActionFieldOption = "",
    observation_field: ObservationFieldOption = "",
    gateway: GatewayOption = None, run_dir: RunDirOption = DEFAULT_RUN_DIR, token: TokenOption = "",
) -> None:
    """Submit an environment: tasks from a JSONL file (or a verifiers environment's datasets), the
    scorer from the flags (or the rewards of the program, OpenEnv server or verifiers environment
    that drives its episodes)."""
    from policyloop.cluster.client import TaskFileError, build_environment

    try:
        driver = _episode_driver(program, entry, openenv, action_field, observation_field, verifiers, env_source,
                                 env_args, step_timeout_s, episode_timeout_s, requirement or [], wheel or [])
        task_specs, held_out = _environment_tasks(tasks, eval_tasks, verifiers, env_source, env_args,
                                                  task_count, eval_count)
        env = build_environment(name, version, task_specs, scorer, pattern=pattern, tolerance=tolerance,
                                code=code.read_text() if code else "", timeout_s=timeout_s, group_size=group_size,
                                max_new_tokens=max_new_tokens, temperature=temperature, max_turns=max_turns,
                                tools=tool, supervised=supervised, driver=driver, reward_model=reward_model,
                                normalization=normalization,
                                judge=_judge(judge, judge_model, judge_template, verdict, label or [], json_field,
                                             score_range, judge_max_tokens, timeout_s) if scorer == "judge" else None)
        env.eval_tasks.extend(held_out)
    except (TaskFileError, ValueError, OSError) as exc:
        console.print(f"[red]{exc}[/red]")
        raise typer.Exit(2) from exc
    reply = with_gateway(gateway, run_dir, token, lambda client: client.submit(env))
    print(json.dumps({"environment": reply.environment, "tasks": reply.num_tasks, "group_size": reply.group_size,
                      "created": reply.created}))


def _episode_driver(program: Path | None, entry: str, openenv: str, action_field: str, observation_field: str,
                    verifiers: str, env_source: Path | None, env_args: str, step_s: float, episode_s: float,
                    requirements: list[str], wheels: list[Path]) -> Any:
    """The environment `env submit`'s flags name to drive the episodes (a program, an OpenEnv
    server, a verifiers environment), or None: the replica drives them."""
    from policyloop.cluster.client import read_program, read_verifiers
    from policyloop.contracts.v1 import bus_pb2

    if program is not None:
        return read_program(program, entry, step_seconds=step_s, episode_seconds=episode_s,
                            requirements=requirements, wheels=wheels)
    if openenv:
        return bus_pb2.OpenEnvServer(base_url=openenv, action_field=action_field, observation_field=observation_field)
    if verifiers:
        return read_verifiers(verifiers, env_source, arguments_json=env_args, step_seconds=step_s,
                              episode_seconds=episode_s, requirements=requirements, wheels=wheels)
    return None


def _environment_tasks(tasks: Path | None, eval_tasks: Path | None, verifiers: str, env_source: Path | None,
                       env_args: str, task_count: int, eval_count: int) -> tuple[list[Any], list[Any]]:
    """The tasks and held-out tasks `env submit` sends: the files', or a verifiers environment's
    datasets (read here, through verifiers, with the environment's source on the path)."""
    from policyloop.cluster.client import read_tasks

    if tasks is not None or not verifiers:
        if tasks is None:
            raise ValueError("TASKS: a JSONL file of tasks (only --verifiers reads them from its environment)")
        return read_tasks(tasks), read_tasks(eval_tasks) if eval_tasks is not None else []
    from policyloop.envs.verifiers_env import dataset_tasks

    if env_source is not None:
        sys.path.insert(0, str(Path(env_source).parent if Path(env_source).suffix != ".whl" else env_source))
    try:
        arguments = json.loads(env_args or "{}")
    except ValueError as exc:
        raise ValueError(f"--env-args: not JSON ({exc})") from exc
    train, held_out = dataset_tasks(verifiers, arguments, count=task_count or -1, eval_count=eval_count or -1)
    return train, held_out if eval_tasks is None else read_tasks(eval_tasks)


def served_exchanges(model: str, nats_url: str | None, run_dir: Path):  # type: ignore[no-untyped-def]
    """Every trace of the served `model`, with its feedback, from the NATS at nats_url (default:
    the `policyloop up` cluster's in run_dir)."""
    from policyloop.bus import Bus
    from policyloop.cluster.local import ClusterError, ClusterInfo
    from policyloop.serving.traces import read_exchanges

    if not nats_url:
        try:
            nats_url = ClusterInfo.load(run_dir).nats_url
        except ClusterError as exc:
            console.print(f"[red]{exc}[/red]")
            raise typer.Exit(2) from exc

    async def read():  # type: ignore[no-untyped-def]
        bus = await Bus.connect(nats_url, name=f"policyloop-traces-{model}")
        try:
            return await read_exchanges(bus, model)
        finally:
            await bus.close()

    return asyncio.run(read())


@env_app.command("from-traces")
def env_from_traces(
    model: Annotated[str, typer.Option(help="The served model's name whose traces to use (what callers pass).")],
    name: Annotated[str, typer.Option(help="Name of the environment to submit.")],
    version: Annotated[str, typer.Option(help="Its version.")] = "v1",
    min_reward: Annotated[float, typer.Option(
        help="A response becomes the reference answer when its newest feedback reward is at least this "
             "(a correction always does).")] = 1.0,
    eval_fraction: Annotated[float, typer.Option(help="Share of the prompts (by trace id) kept as the eval split.")]
    = 0.2,
    group_size: Annotated[int, typer.Option(help="Samples per prompt.")] = 8,
    temperature: Annotated[float, typer.Option(help="Sampling temperature.")] = 1.0,
    max_new_tokens: Annotated[int, typer.Option(help="Token budget of a sample (0: twice the longest reference).")]
    = 0,
    nats_url: Annotated[str | None, typer.Option(help="NATS of the cluster (default: the run directory's).")] = None,
    supervised: Annotated[bool, typer.Option(
        help="An SFT environment instead: each outcome is the demonstration to imitate (a rewarded response "
             "as the engine's exact token ids, a correction as text).")] = False,
    gateway: GatewayOption = None, run_dir: RunDirOption = DEFAULT_RUN_DIR, token: TokenOption = "",
) -> None:
    """Make the serving endpoint's traces an environment: each served prompt (its exact token ids)
    with its recorded outcome (a correction, or a response rewarded at least --min-reward) as the
    reference an exact-answer verifier judges new samples against (RL), or, with --supervised, as
    the demonstration a run trains on by cross-entropy (SFT); submitted to the gateway."""
    from policyloop.serving.traces import environment_from_traces

    env = environment_from_traces(served_exchanges(model, nats_url, run_dir), name, version, min_reward=min_reward,
                                  eval_fraction=eval_fraction, group_size=group_size, temperature=temperature,
                                  max_new_tokens=max_new_tokens, supervised=supervised)
    if not env.tasks:
        console.print(f"[red]no trace of {model} has an outcome to learn from[/red] (a correction, or a reward of "
                      f"at least {min_reward}); {len(env.eval_tasks)} went to the eval split")
        raise typer.Exit(1)
    reply = with_gateway(gateway, run_dir, token, lambda client: client.submit(env))
    print(json.dumps({"environment": reply.environment, "tasks": reply.num_tasks, "eval_tasks": len(env.eval_tasks),
                      "group_size": reply.group_size, "created": reply.created}))


@run_app.command("start")
def run_start(
    env: Annotated[list[str], typer.Option(help="name@version[=weight], once per environment of the mix.")],
    run_id: Annotated[str, typer.Option(help="Run id (default: the gateway makes one).")] = "",
    model: Annotated[str, typer.Option(help="Model the run trains (default: the cluster's learner's).")] = "",
    num_tasks: Annotated[int, typer.Option(help="Tasks to feed in total (0: as many as the environments hold).")]
    = 0,
    max_lag: Annotated[int | None, typer.Option(
        help="Most versions a trained sample may lag (-1: unbounded); must be the cluster's (default: it).")] = None,
    seed: Annotated[int, typer.Option(help="Seed of the task order.")] = 0,
    lora_rank: Annotated[int, typer.Option(
        help="Train the run as a LoRA adapter of this rank over the cluster's base (0: the full model).")] = 0,
    lora_alpha: Annotated[float, typer.Option(help="LoRA alpha (0: 2 x rank).")] = 0.0,
    lora_dropout: Annotated[float, typer.Option(help="LoRA dropout.")] = 0.0,
    lora_target_modules: Annotated[str, typer.Option(
        help="Comma-separated module names the adapter adapts (default: the attention and MLP projections).")] = "",
    gateway: GatewayOption = None, run_dir: RunDirOption = DEFAULT_RUN_DIR, token: TokenOption = "",
) -> None:
    """Start a run over a mix of submitted environments; prints the run."""
    from google.protobuf.json_format import MessageToDict

    from policyloop.cluster.client import parse_mix
    from policyloop.contracts.v1 import loop_pb2

    try:
        mixes = parse_mix(env)
    except ValueError as exc:
        console.print(f"[red]{exc}[/red]")
        raise typer.Exit(2) from exc
    request = loop_pb2.StartRunRequest(run_id=run_id, environments=mixes, model=model, num_tasks=num_tasks,
                                       max_lag=max_lag, seed=seed)  # None: unset, the cluster's
    if lora_rank or lora_alpha or lora_dropout or lora_target_modules:
        request.lora.CopyFrom(loop_pb2.LoraSpec(
            rank=lora_rank, alpha=lora_alpha, dropout=lora_dropout,
            target_modules=[m.strip() for m in lora_target_modules.split(",") if m.strip()]))
    run = with_gateway(gateway, run_dir, token, lambda client: client.start(request))
    print(json.dumps(MessageToDict(run)))


@run_app.command("watch")
def run_watch(
    run_id: Annotated[str, typer.Argument(help="The run to follow.")],
    gateway: GatewayOption = None, run_dir: RunDirOption = DEFAULT_RUN_DIR, token: TokenOption = "",
) -> None:
    """Follow a run's progress (step, reward by environment, lag, throughput) until it ends."""
    from policyloop.cluster.client import progress_line

    def follow(client) -> None:  # type: ignore[no-untyped-def]
        for run in client.watch(run_id):
            console.print(progress_line(run), highlight=False, soft_wrap=True)

    with_gateway(gateway, run_dir, token, follow)


@run_app.command("stop")
def run_stop(
    run_id: Annotated[str, typer.Argument(help="The run to stop.")],
    gateway: GatewayOption = None, run_dir: RunDirOption = DEFAULT_RUN_DIR, token: TokenOption = "",
) -> None:
    """Stop a run: no more of its tasks are fed."""
    from policyloop.cluster.client import progress_line

    run = with_gateway(gateway, run_dir, token, lambda client: client.stop(run_id))
    console.print(progress_line(run), highlight=False, soft_wrap=True)
