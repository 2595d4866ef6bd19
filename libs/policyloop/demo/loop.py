"""`policyloop demo` (what `make demo` runs): a real RL run on this machine.

It bootstraps the base model if it is not cached, starts the local cluster (NATS, Redis, the
six services), measures held-out accuracy through the rollout replica's engine (greedy, the
same SGLang client the rollout uses), submits the arithmetic environment's train split
through the gateway's gRPC API and starts a run, shows live progress for a fixed budget —
learner step, mean reward, held-out accuracy at intervals, version lag, generated tokens/s —
measures held-out accuracy again, stops everything, and writes `summary.json` and a plot.
With a tracker (`--tracker tensorboard|wandb|mlflow`), the learner logs its steps to it and the
demo its held-out evaluations beside them, at the version each evaluation measured.

With `tools`, the environment is multi-turn: the same problems after the `<tools>` prompt token,
up to three model turns with the python tool between them (each call a sandbox job). Held-out
episodes run greedily through the same episode code and sandbox, and report how often the
policy called the tool besides whether its final answer was right.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import grpc
from rich.console import Console
from rich.markup import escape

from policyloop.bus import Bus
from policyloop.cluster.local import LocalCluster, ManagedProcess, service_of
from policyloop.cluster.status import ClusterStatus, cluster_status
from policyloop.contracts.v1 import bus_pb2, loop_pb2, loop_pb2_grpc, status_pb2
from policyloop.demo.runs import AdapterEvaluator, RunEvaluation, RunResult, run_versions, start_lora_runs
from policyloop.engines.partial import Completion, generate_resumable
from policyloop.engines.protocol import GenerateRequest, GenerateResult, SamplingParams
from policyloop.engines.sglang_client import SGLangClient
from policyloop.envs import arithmetic
from policyloop.envs.episode import run_episodes
from policyloop.envs.tool_episodes import ToolEpisode, from_hf, sandbox_tools
from policyloop.envs.tools import PYTHON, TOOLS_PROMPT_TOKEN, tool_formats
from policyloop.learner.settings import LearnerSettings, TrackerSettings
from policyloop.learner.tracking import NullTracker, Tracker, TrackerUnavailable, mlflow_tracking_uri, open_tracker
from policyloop.rl.losses import KINDS, PolicyLoss
from policyloop.rl.settings import LoraSpec
from policyloop.state import Heartbeat, HeartbeatRegistry, VersionRegistry, connect_redis
from policyloop.telemetry.dashboard import grafana_dir


@dataclass
class DemoConfig:
    run_dir: Path = Path("runs/demo")
    out: Path | None = None              # where summary.json and the plot go (default: runs/<run id>)
    model_path: Path | None = None       # default: the bootstrap model (built and cached if needed)
    budget_s: float = 420.0              # wall time of the RL phase
    max_steps: int = 0                   # 0: no step limit, the budget decides
    eval_problems: int = 600
    eval_interval_s: float = 60.0        # tools and LoRA runs: the demo measures every this many seconds
    eval_every_versions: int = 100       # otherwise the evaluator: every this many versions, and the run's ends
    group_size: int = 8
    groups_per_step: int = 32
    lr: float = 1e-4
    temperature: float = 1.0
    max_new_tokens: int = 8
    seed: int = 0
    start_timeout_s: float = 180.0
    # The objective (the learner's loss settings) and the staleness bound.
    loss: PolicyLoss = field(default_factory=KINDS["ppo"])
    max_lag: int = 1
    weight_update_mode: str = "in_place"  # how versions reach requests in flight (rollout setting)
    tools: bool = False                  # the multi-turn environment (python tool in the sandbox)
    prometheus: bool | None = None       # Prometheus beside the cluster (None: when it is installed)
    tracker: str = "none"                # experiment tracker of the learner's steps and the evaluations
    runs: int = 1                        # with lora_rank: LoRA runs trained at once
    lora_rank: int = 0                   # 0: the full model, one run; else each run a LoRA adapter of this rank


@dataclass
class Progress:
    t: float
    step: int
    version: int
    mean_reward: float
    generated_tokens: int
    tokens_per_s: float


@dataclass
class Evaluation:
    t: float
    version: int
    accuracy: float
    tool_use: float = 0.0                # tools: share of episodes with a tool call that ran


@dataclass
class DemoResult:
    run_id: str
    accuracy_before: float
    accuracy_after: float
    steps: int
    wall_seconds: float
    eval_problems: int
    version_lag_histogram: dict[str, int]
    generated_tokens: int
    # Weight sync, from the learner: versions pushed, bytes of the full weights they amount to,
    # bytes actually pushed (deltas after the first keyframe) and the ratio of the two.
    weight_sync: dict[str, float] = field(default_factory=dict)
    # The learner's last-step statistics and its dropped samples by reason.
    learner_stats: dict[str, float] = field(default_factory=dict)
    dropped: dict[str, int] = field(default_factory=dict)
    resubmitted: int = 0                 # samples resumed after an update aborted them (mode abort)
    tool_use_before: float = 0.0         # tools: share of held-out episodes with a tool call that ran
    tool_use_after: float = 0.0
    progress: list[Progress] = field(default_factory=list)
    evaluations: list[Evaluation] = field(default_factory=list)
    tracker_run: str = ""                # the run's name in the tracker, when there is one
    runs: list[RunResult] = field(default_factory=list)  # LoRA runs: each run's own figures


TOOL_MAX_TURNS = 3          # model turns of a tools episode: call, call, answer at most
TOOL_MAX_NEW_TOKENS = 24    # model tokens over all turns (a call is 7, an answer 3)
TOOL_MAX_TOOL_TOKENS = 12   # the tiny model's context is 64 tokens: results are cut to fit


def arithmetic_environment(group_size: int, max_new_tokens: int, temperature: float, tools: bool = False
                           ) -> loop_pb2.Environment:
    config = arithmetic.ArithmeticConfig()
    problems, _heldout = arithmetic.split(config)
    prefix = TOOLS_PROMPT_TOKEN if tools else ""
    env = loop_pb2.Environment(
        name="arithmetic-tools" if tools else "arithmetic", version="v1",
        tasks=[loop_pb2.TaskSpec(prompt_text=prefix + p.prompt, answer=p.answer) for p in problems],
        # The answer's format is an integer: the format term rewards the form before the answer.
        builtin=loop_pb2.BuiltinVerifier(kind=loop_pb2.BuiltinVerifier.KIND_EXACT_ANSWER,
                                         pattern=arithmetic.ANSWER_RE.pattern, format_weight=arithmetic.FORMAT_WEIGHT),
        group_size=group_size,
        sampling=bus_pb2.SamplingParams(max_new_tokens=TOOL_MAX_NEW_TOKENS if tools else max_new_tokens,
                                        temperature=temperature),
    )
    if tools:
        env.max_turns = TOOL_MAX_TURNS
        env.tools.append(PYTHON)
    return env


@dataclass(frozen=True)
class Evaluated:
    accuracy: float
    version: int        # the oldest version that answered
    tool_use: float     # share of episodes with a tool call that ran (tools only)


async def evaluate(client: SGLangClient, tokenizer, problems: list[arithmetic.Problem],  # type: ignore[no-untyped-def]
                   tools_bus: Bus | None = None, lora_path: str | None = None) -> Evaluated:
    """Greedy held-out accuracy of what the engine serves now. With `tools_bus`, each problem is a
    tools episode whose calls run in the cluster's sandbox, judged on the last model turn."""
    eos = tokenizer.eos_token_id
    episode_tokenizer = from_hf(tokenizer)

    async def one(i: int, problem: arithmetic.Problem) -> tuple[GenerateResult, str, bool]:
        prompt = (TOOLS_PROMPT_TOKEN if tools_bus else "") + problem.prompt
        rid = f"eval-{i}" if lora_path is None else f"eval-{lora_path}-{i}"
        request = GenerateRequest(
            input_ids=tokenizer(prompt, add_special_tokens=False).input_ids, rid=rid, return_logprob=False,
            lora_path=lora_path,
            sampling_params=SamplingParams(max_new_tokens=TOOL_MAX_NEW_TOKENS if tools_bus else 8, temperature=0.0,
                                           stop_token_ids=(eos,)))
        if tools_bus is None:
            result = await client.generate(request)
            return result, episode_tokenizer.decode([t for t in result.output_ids if t != eos]), False

        async def generate_batch(requests: list[GenerateRequest]) -> list[Completion]:
            return [await generate_resumable(client, r) for r in requests]

        run_tool = sandbox_tools(tools_bus, job_id=f"eval:{i}", run_id="demo-eval", timeout_s=10.0,
                                 reply_timeout_s=120.0, max_chars=2000)
        tools = ToolEpisode(run_tool=run_tool, tokenizer=episode_tokenizer, formats=tool_formats([PYTHON]),
                            max_tool_tokens=TOOL_MAX_TOOL_TOKENS)
        [episode] = await run_episodes([request], [tools], generate_batch=generate_batch,
                                       decode=episode_tokenizer.decode, max_turns=TOOL_MAX_TURNS)
        last = [t for t in episode.turns if t.role == bus_pb2.Turn.ROLE_MODEL][-1]
        ran = any(t.role == bus_pb2.Turn.ROLE_TOOL and t.status == "ok" for t in episode.turns)
        return episode.result, last.text, ran

    answered = await asyncio.gather(*(one(i, p) for i, p in enumerate(problems)))
    accuracy = arithmetic.accuracy([text for _, text, _ in answered], [p.answer for p in problems],
                                   [r.finish_reason == "stop" for r, _, _ in answered])
    return Evaluated(accuracy, min(int(r.weight_version) for r, _, _ in answered),
                     sum(ran for _, _, ran in answered) / len(problems))


def weight_sync_summary(pushed: status_pb2.WeightPushTotals) -> dict[str, float]:
    """The learner's push totals as delta vs full bytes."""
    if not pushed.versions_pushed:
        return {}
    full, sent = pushed.full_bytes, pushed.pushed_bytes
    return {"versions": pushed.versions_pushed, "keyframes": pushed.keyframes, "full_bytes": full,
            "delta_bytes": pushed.delta_bytes, "sent_bytes": sent,
            "full_over_sent": round(full / sent, 2) if sent else 0.0,
            "last_changed_fraction": round(pushed.last_changed_fraction, 4)}


async def start_arithmetic_run(stub: loop_pb2_grpc.LoopServiceStub, group_size: int, max_new_tokens: int,
                               temperature: float, seed: int, tools: bool = False,
                               eval_problems: Sequence[arithmetic.Problem] = ()
                               ) -> tuple[loop_pb2.SubmitEnvironmentResponse, loop_pb2.Run]:
    """Submits the arithmetic environment's train split through the gateway (with `eval_problems`
    as its eval split, which the cluster's evaluator scores) and starts a run."""
    env = arithmetic_environment(group_size, max_new_tokens, temperature, tools)
    if eval_problems:
        env.version = "v1-evals"
        env.eval_tasks.extend(loop_pb2.TaskSpec(prompt_text=p.prompt, answer=p.answer) for p in eval_problems)
    reply = await stub.SubmitEnvironment(loop_pb2.SubmitEnvironmentRequest(environment=env), timeout=30)
    run = await stub.StartRun(loop_pb2.StartRunRequest(
        environments=[loop_pb2.EnvironmentMix(environment=reply.environment, weight=1.0)],
        num_tasks=1_000_000, seed=seed, model="policy",
    ), timeout=30)
    return reply, run


@contextmanager
def loop_cluster(config: DemoConfig, root: Path) -> Iterator[LocalCluster]:
    """A fresh local cluster in `root` with the demo's loop settings and no Prometheus (the perf/
    harnesses), stopped on leaving."""
    env = {**loop_env(config), "POLICYLOOP_WEIGHTS_DIR": str(root / "rollout-weights")}
    cluster = LocalCluster(root, extra_env=env, fresh=True, prometheus=False)
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()


@asynccontextmanager
async def arithmetic_run(cluster: LocalCluster, config: DemoConfig
                         ) -> AsyncIterator[tuple[loop_pb2_grpc.LoopServiceStub, loop_pb2.Run]]:
    """The demo's run on a started local cluster, through its gateway (the perf/ harnesses);
    stopped on leaving."""
    gateway = cluster.process("gateway-0").ports["grpc"]
    async with grpc.aio.insecure_channel(f"127.0.0.1:{gateway}") as channel:
        stub = loop_pb2_grpc.LoopServiceStub(channel)
        _, run = await start_arithmetic_run(stub, config.group_size, config.max_new_tokens, config.temperature,
                                            config.seed)
        try:
            yield stub, run
        finally:
            await stub.StopRun(loop_pb2.StopRunRequest(run_id=run.run_id), timeout=30)


async def _heartbeats(registry: HeartbeatRegistry) -> dict[str, Heartbeat]:
    """The newest heartbeat of each service (an empty one for a service not up)."""
    beats = {b.service: b for b in await registry.alive()}
    return defaultdict(Heartbeat, beats)


async def evaluation_of(stub: loop_pb2_grpc.LoopServiceStub, run_id: str, version: Callable[[], Awaitable[int]],
                        timeout_s: float = 300.0) -> loop_pb2.VersionEval:
    """The evaluator's result for the run's `version()` (asked again at each look), once it is in
    GetRun."""
    deadline = time.monotonic() + timeout_s
    while True:
        wanted = await version()
        run = await stub.GetRun(loop_pb2.GetRunRequest(run_id=run_id), timeout=30)
        found = next((e for e in run.evals if e.version == wanted), None)
        if found is not None:
            return found
        if time.monotonic() > deadline:
            raise RuntimeError(f"the evaluator did not score version {wanted} of run {run_id} in {timeout_s:.0f} s "
                               f"(it has {sorted(e.version for e in run.evals)})")
        await asyncio.sleep(0.5)


async def last_evaluation(stub: loop_pb2_grpc.LoopServiceStub, heartbeats: HeartbeatRegistry,
                          run_id: str) -> loop_pb2.VersionEval:
    """The evaluator's result for the run's last version: the learner's newest, once no newer one
    comes (after a stop, it still trains the samples generated before it)."""
    async def newest() -> int:
        return (await _heartbeats(heartbeats))["learner"].policy_version

    return await evaluation_of(stub, run_id, newest)


def record_final_figures(result: DemoResult, beats: dict[str, Heartbeat]) -> None:
    """The run's totals from the learner's and the replica's statuses."""
    learner, rollout = beats["learner"].learner, beats["rollout"].rollout
    result.steps = learner.step
    result.version_lag_histogram = {str(k): v for k, v in sorted(learner.lag_histogram.items())}
    result.generated_tokens = rollout.generated_tokens
    result.resubmitted = rollout.resubmitted
    result.weight_sync = weight_sync_summary(learner.weights)
    result.learner_stats = {name: round(value, 6) for name, value in sorted(learner.last_step.statistics.items())}
    result.dropped = {f.name: v for f, v in learner.dropped.ListFields()}


async def wait_for_published(heartbeats: HeartbeatRegistry, timeout_s: float) -> dict[str, Heartbeat]:
    """The heartbeats once the learner's last counted step has its version pushed (a step counts
    when it is recorded; with overlap_publication its version is pushed while the next computes)."""
    deadline = time.monotonic() + timeout_s
    beats = await _heartbeats(heartbeats)
    while (beats["learner"].learner.weights.versions_pushed < beats["learner"].learner.step
           and time.monotonic() < deadline):
        await asyncio.sleep(0.5)
        beats = await _heartbeats(heartbeats)
    return beats


async def wait_for_last_version(heartbeats: HeartbeatRegistry, timeout_s: float) -> None:
    """The engine loads the last published version shortly after the learner's last step."""
    deadline = time.monotonic() + timeout_s
    beats = await _heartbeats(heartbeats)
    while beats["rollout"].policy_version < beats["learner"].policy_version and time.monotonic() < deadline:
        await asyncio.sleep(0.5)
        beats = await _heartbeats(heartbeats)


async def wait_healthy(cluster: LocalCluster, timeout_s: float) -> ClusterStatus:
    deadline = time.monotonic() + timeout_s
    while True:
        status = await cluster_status(cluster.nats_url, cluster.redis_url, cluster.namespace)
        if status.all_healthy or time.monotonic() > deadline:
            return status
        await asyncio.sleep(0.5)


class ClusterNotHealthy(RuntimeError):
    """The local cluster did not come up: which services, and what their logs end with."""


async def require_healthy(cluster: LocalCluster, timeout_s: float) -> ClusterStatus:
    """wait_healthy, raising ClusterNotHealthy (unhealthy_report) when the cluster is not up."""
    status = await wait_healthy(cluster, timeout_s)
    if not status.all_healthy:
        raise ClusterNotHealthy(unhealthy_report(cluster.processes, status, timeout_s))
    return status


def unhealthy_report(processes: Sequence[ManagedProcess], status: ClusterStatus, timeout_s: float,
                     log_lines: int = 12) -> str:
    """What is missing or unhealthy, and for each of those processes whether it still runs and
    the end of its log (the run directory of a harness is gone once it fails)."""
    unhealthy = [i.instance for i in status.instances if not i.healthy]
    lines = [f"the cluster is not healthy after {timeout_s:.0f} s: missing {status.missing}, unhealthy {unhealthy}"]
    for managed in processes:
        if service_of(managed.name) not in status.missing and managed.name not in unhealthy:
            continue
        code = None if managed.proc is None else managed.proc.poll()
        tail = managed.log_path.read_text(errors="replace").splitlines()[-log_lines:] \
            if managed.log_path.exists() else []
        lines.append(f"--- {managed.name} ({'running' if code is None else f'exited {code}'}), "
                     f"{managed.log_path.name} ends:")
        lines.extend(tail)
    return "\n".join(lines)


@dataclass
class HeldOut:
    """The run's held-out accuracy as the demo reports it: the cluster's evaluator's results (the
    full model's run), or the demo's own greedy pass on the rollout's engine (tools episodes, which
    the evaluator does not run, and LoRA runs), each recorded in the result and the tracker."""

    config: DemoConfig
    result: DemoResult
    tracker: Tracker
    console: Console
    client: SGLangClient          # the rollout replica's engine (the demo's own measurements)
    tokenizer: Any
    problems: list[arithmetic.Problem]
    tools_bus: Bus | None
    seen: set[int] = field(default_factory=set)  # versions the evaluator's results were taken for

    @property
    def by_evaluator(self) -> bool:
        return not self.config.tools and not self.config.lora_rank

    async def measure(self, t: float) -> Evaluation:
        """The demo's own measurement of what the engine serves now."""
        measured = await evaluate(self.client, self.tokenizer, self.problems, self.tools_bus)
        evaluation = Evaluation(round(t, 1), measured.version, measured.accuracy, measured.tool_use)
        self._record(evaluation)
        return evaluation

    def scored(self, e: loop_pb2.VersionEval, t: float) -> Evaluation:
        """The evaluator's result for a version, seen at `t`."""
        self.seen.add(e.version)
        evaluation = Evaluation(round(t, 1), e.version, e.pass_rate)
        self._record(evaluation)
        return evaluation

    def _record(self, evaluation: Evaluation) -> None:
        self.result.evaluations.append(evaluation)
        # At the version measured: the learner's step of that number made it.
        self.tracker.log_evaluation(evaluation.version, {"heldout_accuracy": evaluation.accuracy} |
                                    ({"heldout_tool_use": evaluation.tool_use} if self.config.tools else {}))

    async def scored_meanwhile(self, stub: loop_pb2_grpc.LoopServiceStub, run_id: str, t: float) -> str:
        """The evaluator's results not yet seen, for the progress line."""
        run = await stub.GetRun(loop_pb2.GetRunRequest(run_id=run_id), timeout=30)
        return "".join(f"  held-out {self.described(self.scored(e, t))} (v{e.version})"
                       for e in sorted(run.evals, key=lambda e: e.version) if e.version not in self.seen)

    def described(self, e: Evaluation) -> str:
        return f"{e.accuracy:.1%}" + (f", tool used in {e.tool_use:.0%}" if self.config.tools else "")

    def report(self, when: str, e: Evaluation) -> None:
        """`when`: before or after (RL)."""
        if when == "before":
            self.result.accuracy_before, self.result.tool_use_before = e.accuracy, e.tool_use
        else:
            self.result.accuracy_after, self.result.tool_use_after = e.accuracy, e.tool_use
        size = f"{len(self.problems)} problems, " if when == "before" else ""
        by = " by the evaluator" if self.by_evaluator else ""
        self.console.print(f"held-out accuracy {when} RL: [bold]{self.described(e)}[/bold] "
                           f"({size}version {e.version}{by})")


def progress_line(config: DemoConfig, beats: dict[str, Heartbeat], t: float, rate: float,
                  per_run: dict[str, int] | None) -> tuple[Progress, str]:
    """One progress point and its console line: the learner's step (LoRA runs: each run's version)."""
    tokens = beats["rollout"].rollout.generated_tokens
    if per_run is not None:
        progress = Progress(round(t, 1), min(per_run.values()), min(per_run.values()), 0.0, tokens, round(rate, 1))
        return progress, f"[{t:6.1f}s] steps by run {per_run}  {rate:7.0f} tok/s"
    learner = beats["learner"]
    progress = Progress(round(t, 1), learner.learner.step, learner.policy_version,
                        learner.learner.last_step.mean_reward, tokens, round(rate, 1))
    lag = dict(sorted(learner.learner.lag_histogram.items()))
    return progress, (f"[{t:6.1f}s] step {progress.step:4d}  reward {progress.mean_reward:.3f}  "
                      f"lag {lag}  {rate:7.0f} tok/s")


async def _train(config: DemoConfig, console: Console, heartbeats: HeartbeatRegistry, held: HeldOut,
                 stub: loop_pb2_grpc.LoopServiceStub, started_runs: list[loop_pb2.Run],
                 run_versions_of: VersionRegistry | None,
                 adapter_held_out: Callable[[RunResult, float], Awaitable[RunEvaluation | None]]) -> None:
    """Trains for the budget (or the steps), printing progress and held-out accuracy as it comes,
    then stops the runs; the result gets the progress and the wall time."""
    result = held.result
    started = time.monotonic()
    next_eval = config.eval_interval_s
    last_tokens, last_t = 0, 0.0
    while True:
        await asyncio.sleep(2.0)
        t = time.monotonic() - started
        beats = await _heartbeats(heartbeats)
        tokens = beats["rollout"].rollout.generated_tokens
        rate = (tokens - last_tokens) / max(1e-6, t - last_t)
        last_tokens, last_t = tokens, t
        per_run = await run_versions(run_versions_of, result.runs) if run_versions_of is not None else None
        progress, line = progress_line(config, beats, t, rate, per_run)
        result.progress.append(progress)
        if held.by_evaluator:  # what the evaluator scored meanwhile (every eval_every_versions)
            line += await held.scored_meanwhile(stub, started_runs[0].run_id, t)
        elif t >= next_eval:
            if config.lora_rank:
                for run_result in result.runs:
                    measured_run = await adapter_held_out(run_result, time.monotonic() - started)
                    if measured_run is not None:
                        line += f"  {run_result.run_id} {measured_run.accuracy:.1%} (v{measured_run.version})"
            else:
                evaluation = await held.measure(time.monotonic() - started)
                line += f"  held-out {held.described(evaluation)} (v{evaluation.version})"
            next_eval += config.eval_interval_s
        console.print(line)
        if t >= config.budget_s or (config.max_steps and progress.step >= config.max_steps):
            break
    for started_run in started_runs:
        await stub.StopRun(loop_pb2.StopRunRequest(run_id=started_run.run_id), timeout=30)
    result.wall_seconds = round(time.monotonic() - started, 1)


async def _start_full_model_run(stub: loop_pb2_grpc.LoopServiceStub, config: DemoConfig, held: HeldOut
                                ) -> tuple[loop_pb2.SubmitEnvironmentResponse, list[loop_pb2.Run]]:
    """The full model's run; measured by the evaluator, its held-out problems go as the eval split,
    and its baseline (the version it started from) is reported as before."""
    reply, run = await start_arithmetic_run(stub, config.group_size, config.max_new_tokens, config.temperature,
                                            config.seed, config.tools, held.problems if held.by_evaluator else ())
    if held.by_evaluator:
        baseline = await evaluation_of(stub, run.run_id, partial(_version, run.start_version))
        held.report("before", held.scored(baseline, 0.0))
    return reply, [run]


async def _drive(cluster: LocalCluster, config: DemoConfig, console: Console, tracker: Tracker) -> DemoResult:
    from policyloop.models.tokenizer import load_tokenizer

    await require_healthy(cluster, config.start_timeout_s)
    console.print("[green]all six services are healthy[/green]")
    redis_client = await connect_redis(cluster.redis_url)  # one connection for all the polling
    heartbeats = HeartbeatRegistry(redis_client, cluster.namespace)
    engine_url = (await _heartbeats(heartbeats))["rollout"].rollout.engine_url
    heldout = arithmetic.heldout_problems(arithmetic.ArithmeticConfig(), config.eval_problems, seed=config.seed)
    client = SGLangClient(engine_url, timeout_s=120)
    # Tools episodes in the evaluation run their calls in the cluster's sandbox, over the bus.
    tools_bus = await Bus.connect(cluster.nats_url, name="demo-eval") if config.tools else None
    result = DemoResult("", 0.0, 0.0, 0, 0.0, len(heldout), {}, 0)
    held = HeldOut(config, result, tracker, console, client, load_tokenizer(config.model_path),
                   heldout, tools_bus)
    evaluator: AdapterEvaluator | None = None

    async def adapter_held_out(run: RunResult, t: float) -> RunEvaluation | None:
        assert evaluator is not None
        loaded = await evaluator.load(run.run_id)
        if loaded is None:
            return None
        name, version = loaded
        try:
            measured = await evaluate(client, held.tokenizer, heldout, lora_path=name)
        finally:
            await evaluator.unload(name)
        evaluation = RunEvaluation(round(t, 1), version, measured.accuracy)
        run.evaluations.append(evaluation)
        return evaluation

    try:
        if not held.by_evaluator:
            held.report("before", await held.measure(0.0))
        gateway = cluster.process("gateway-0").ports["grpc"]
        async with grpc.aio.insecure_channel(f"127.0.0.1:{gateway}") as channel:
            stub = loop_pb2_grpc.LoopServiceStub(channel)
            if config.lora_rank:
                env = arithmetic_environment(config.group_size, config.max_new_tokens, config.temperature)
                reply = await stub.SubmitEnvironment(loop_pb2.SubmitEnvironmentRequest(environment=env), timeout=30)
                started_runs = await start_lora_runs(stub, reply.environment, config.runs, config.lora_rank,
                                                     config.seed)
                result.runs = [RunResult(r.run_id, accuracy_before=result.accuracy_before) for r in started_runs]
                publisher = f"127.0.0.1:{cluster.process('publisher-0').ports['grpc']}"
                evaluator = AdapterEvaluator(client, publisher, LoraSpec.from_proto(started_runs[0].lora))
            else:
                reply, started_runs = await _start_full_model_run(stub, config, held)
            result.run_id = "+".join(r.run_id for r in started_runs)
            console.print(f"run {result.run_id}: {reply.num_tasks} train problems, groups of {config.group_size}, "
                          f"{config.groups_per_step} groups per step, lr {config.lr}"
                          + (f", LoRA rank {config.lora_rank}" if config.lora_rank else ""))

            run_versions_of = VersionRegistry(redis_client, cluster.namespace) if config.lora_rank else None
            await _train(config, console, heartbeats, held, stub, started_runs, run_versions_of, adapter_held_out)
        record_final_figures(result, await wait_for_published(heartbeats, timeout_s=30))
        if config.lora_rank:
            assert evaluator is not None
            await _finish_lora_runs(result, adapter_held_out, evaluator, console)
        elif held.by_evaluator:  # the run's last version, which the evaluator scores once the run has stopped
            async with grpc.aio.insecure_channel(f"127.0.0.1:{gateway}") as channel:
                scored = await last_evaluation(loop_pb2_grpc.LoopServiceStub(channel), heartbeats, result.run_id)
            held.report("after", next((e for e in result.evaluations if e.version == scored.version), None)
                        or held.scored(scored, result.wall_seconds))
        else:
            await wait_for_last_version(heartbeats, timeout_s=30)
            held.report("after", await held.measure(result.wall_seconds))
    finally:
        if evaluator is not None:
            await evaluator.close()
        await client.close()
        if tools_bus is not None:
            await tools_bus.close()
        await redis_client.aclose()
    return result


async def _version(version: int) -> int:
    return version


async def _finish_lora_runs(result: DemoResult, adapter_held_out: Callable[[RunResult, float],
                                                                          Awaitable[RunEvaluation | None]],
                            evaluator: AdapterEvaluator, console: Console) -> None:
    """Each LoRA run's final figures: its newest adapter on the held-out problems, its versions
    and the bytes of one of them; the demo's before/after are the runs' means."""
    for run in result.runs:
        after = await adapter_held_out(run, result.wall_seconds)
        run.accuracy_after = run.accuracy_before if after is None else after.accuracy
        run.steps = 0 if after is None else after.version
        run.adapter_bytes_per_version, run.adapter_raw_bytes = await evaluator.bytes_per_version(run.run_id)
        console.print(f"run {run.run_id}: held-out {run.accuracy_before:.1%} → [bold]{run.accuracy_after:.1%}"
                      f"[/bold] in {run.steps} steps; {run.adapter_bytes_per_version / 1e6:.2f} MB per adapter "
                      f"version (delta; {run.adapter_raw_bytes / 1e6:.2f} MB raw)")
    result.steps = sum(run.steps for run in result.runs)
    result.accuracy_after = sum(run.accuracy_after for run in result.runs) / len(result.runs)


def write_plot(result: DemoResult, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    if result.runs:  # LoRA runs: each run's adapter on the held-out problems, from the base's accuracy
        for run in result.runs:
            points = [(0.0, run.accuracy_before)] + [(e.t, e.accuracy) for e in run.evaluations]
            ax.plot([t for t, _ in points], [a for _, a in points], "o-",
                    label=f"{run.run_id}: held-out accuracy ({run.steps} steps)")
    else:
        trained = [p for p in result.progress if p.step > 0]  # before the first step there is no reward yet
        ax.plot([p.t for p in trained], [p.mean_reward for p in trained], label="mean reward (train)")
        ax.plot([e.t for e in result.evaluations], [e.accuracy for e in result.evaluations], "o-",
                label="held-out accuracy")
    if any(e.tool_use for e in result.evaluations):
        ax.plot([e.t for e in result.evaluations], [e.tool_use for e in result.evaluations], "s--",
                label="held-out episodes that ran the tool")
    ax.set_xlabel("seconds of RL")
    ax.set_ylim(0, 1.15)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title(f"policyloop demo: {result.accuracy_before:.0%} → {result.accuracy_after:.0%} held-out "
                 f"in {result.steps} steps")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_ledger(url: str, started: float, path: Path, console: Console) -> None:
    from policyloop.cluster.ledger_plot import write_ledger_plot

    try:
        panels = write_ledger_plot(url, started, time.time(), path)
    except (OSError, RuntimeError, ValueError) as exc:  # the run's figures are written regardless
        console.print(f"[yellow]no ledger plot: {exc}[/yellow]")
        return
    console.print(f"wrote {path} (the ledger over the run, {panels} panels with data)")


def loop_env(config: DemoConfig) -> dict[str, str]:
    """The services' environment for the demo's loop: model, batch, optimizer, objective,
    staleness bound and how versions reach requests in flight (perf/ harnesses run the same)."""
    return {
        "POLICYLOOP_MODEL_PATH": str(config.model_path),
        "POLICYLOOP_GROUPS_PER_STEP": str(config.groups_per_step),
        "POLICYLOOP_OPTIMIZER__LR": str(config.lr),
        **{f"POLICYLOOP_LOSS__{name.upper()}": str(value) for name, value in config.loss.model_dump().items()},
        "POLICYLOOP_MAX_LAG": str(config.max_lag),
        "POLICYLOOP_WEIGHT_UPDATE_MODE": config.weight_update_mode,
        **({"POLICYLOOP_LORA_RUNS": "true", "POLICYLOOP_FULL_MODEL": "false"} if config.lora_rank else {}),
    }


def demo_tracker_settings(config: DemoConfig) -> TrackerSettings:
    """The learner's tracker settings (POLICYLOOP_TRACKER__* apply, e.g. the wandb project or the
    MLflow URI) with the demo's kind, its directory in the run directory, and a run name of its
    own for each demo, so that demos sit side by side in the tracker."""
    return LearnerSettings().tracker.model_copy(update={
        "kind": config.tracker, "dir": config.run_dir.resolve() / "tracking",
        "run_name": f"{config.run_dir.name}-{time.strftime('%Y%m%d-%H%M%S')}"})


def where_to_look(settings: TrackerSettings) -> str:
    if settings.kind == "tensorboard":
        return f"tensorboard --logdir {settings.dir / 'tensorboard'}"
    if settings.kind == "wandb":
        return f"wandb project {settings.wandb_project!r} (offline: wandb sync {settings.dir / 'wandb'}/offline-run-*)"
    store = mlflow_tracking_uri(settings)
    return f"MLflow experiment {settings.mlflow_experiment!r} at {store} (the full mlflow package's UI: " \
           f"mlflow ui --backend-store-uri {store})"


def run_demo(config: DemoConfig, *, console: Console, print_status: Callable[[ClusterStatus], None]) -> int:
    # The demo's tracker opens first: a missing extra is refused before anything starts.
    tracking = demo_tracker_settings(config)
    try:
        tracker = open_tracker(tracking, run_name=tracking.run_name, role="evaluation")
    except TrackerUnavailable as exc:
        console.print(f"[red]{escape(str(exc))}[/red]")
        return 2
    try:
        return _run_demo(config, tracking, tracker, console=console, print_status=print_status)
    finally:
        tracker.close()


def _run_demo(config: DemoConfig, tracking: TrackerSettings, tracker: Tracker, *, console: Console,
              print_status: Callable[[ClusterStatus], None]) -> int:
    from policyloop.models.bootstrap import TOOLS_BOOTSTRAP, BootstrapConfig, bootstrap

    if config.model_path is None:
        console.print("base model: bootstrapping (cached after the first run) …")
        config.model_path = bootstrap(TOOLS_BOOTSTRAP if config.tools else BootstrapConfig())
    console.print(f"base model: {config.model_path}")
    env = {
        **loop_env(config),
        "POLICYLOOP_WEIGHTS_DIR": str(config.run_dir.resolve() / "rollout-weights"),
        "POLICYLOOP_MAX_TOOL_TOKENS": str(TOOL_MAX_TOOL_TOKENS),
        "POLICYLOOP_TRACKER__KIND": tracking.kind,
        "POLICYLOOP_TRACKER__DIR": str(tracking.dir),
        "POLICYLOOP_TRACKER__RUN_NAME": tracking.run_name,
        # The evaluator scores the run's eval split (the held-out problems): all of them, every
        # eval_every_versions versions and at the run's ends.
        "POLICYLOOP_EVERY_VERSIONS": str(config.eval_every_versions),
        "POLICYLOOP_MAX_EVAL_TASKS": str(config.eval_problems),
    }
    cluster = LocalCluster(config.run_dir, extra_env=env, fresh=True, prometheus=config.prometheus)
    console.print(f"starting the local cluster in {config.run_dir} …")
    try:  # the cluster is stopped however the demo ends, even while it starts
        info = cluster.start()
        where = f"; Prometheus at {info.prometheus_url} (queries: docs/metrics.md)" if info.prometheus_url else ""
        console.print(f"watch the ledger live: [bold]policyloop top --run-dir {config.run_dir}[/bold]{where}")
        if info.prometheus_url:
            dashboard = grafana_dir().joinpath("dashboards", "policyloop.json")
            console.print(f"Grafana dashboard: import {dashboard} with a Prometheus datasource at "
                          f"{info.prometheus_url} (docs/metrics.md, Dashboard)")
        started = time.time()
        result = asyncio.run(_drive(cluster, config, console, tracker))
        print_status(asyncio.run(cluster_status(cluster.nats_url, cluster.redis_url, cluster.namespace)))
        out = config.out or Path("runs") / result.run_id
        out.mkdir(parents=True, exist_ok=True)
        if info.prometheus_url:  # while Prometheus still runs
            _plot_ledger(info.prometheus_url, started, out / "ledger.png", console)
    finally:
        console.print("stopping the cluster …")
        cluster.stop()
    if not isinstance(tracker, NullTracker):
        result.tracker_run = tracking.run_name
    summary = asdict(result) | {"config": {k: str(v) for k, v in asdict(config).items()}}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    write_plot(result, out / "reward_accuracy.png")
    gain = result.accuracy_after - result.accuracy_before
    console.print(f"[bold]summary[/bold]: held-out {result.accuracy_before:.1%} → {result.accuracy_after:.1%} "
                  f"({gain:+.1%}) in {result.steps} steps, {result.wall_seconds:.0f}s, "
                  f"{result.generated_tokens} generated tokens; lag {result.version_lag_histogram}; "
                  f"dropped {result.dropped or 'none'}")
    if config.tools:
        console.print(f"tool use (held-out episodes whose python call ran): {result.tool_use_before:.0%} → "
                      f"{result.tool_use_after:.0%}")
    if result.weight_sync:
        sync = result.weight_sync
        console.print(f"weight sync: {sync['versions']} versions, {sync['sent_bytes'] / 1e6:.1f} MB sent "
                      f"({sync['keyframes']} keyframe(s) + deltas) for {sync['full_bytes'] / 1e6:.1f} MB of full "
                      f"weights: {sync['full_over_sent']}x less")
    console.print(f"wrote {out / 'summary.json'} and {out / 'reward_accuracy.png'}")
    if result.tracker_run:
        console.print(f"tracker: run {result.tracker_run} (learner steps and held-out evaluations): "
                      f"{where_to_look(tracking)}")
    if result.runs:
        return 0 if all(run.accuracy_after > run.accuracy_before for run in result.runs) else 1
    return 0 if gain > 0 else 1
