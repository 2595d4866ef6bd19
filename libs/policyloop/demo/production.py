"""`policyloop demo --production`: the whole production loop on this machine.

1. Train: the arithmetic environment, with its held-out problems as the eval split, trains the
   policy; the evaluator scores every k-th version as it appears and promotes, by rule, each
   version that did not regress; the serving replica of the run follows the promotions.
2. Serve: a scripted client sends problems to the serving replica's OpenAI-compatible endpoint
   and gives feedback on every answer (reward 1 when right; reward 0 and the right answer as a
   correction when wrong). Every exchange is a trace with the engine's exact tokens.
3. Learn from usage: the traces become training data. First SFT: a supervised environment of
   the served prompts, each with its recorded outcome (a rewarded response as the engine's exact
   tokens, or the correction) as the demonstration, which a run trains on by cross-entropy for a
   few passes' worth through the same services. Then RL: the same prompts as an environment whose
   verifier judges new samples against those outcomes (a share held out as its eval split), on
   which a further run trains, evaluated the same way.

It writes `summary.json` (the eval results per version of both runs, the promotions, the
traffic) and `production.png` (pass rate per version with its interval, promotions marked).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TypeVar

import aiohttp
import grpc
from rich.console import Console

from policyloop.bus import Bus
from policyloop.cluster.local import LocalCluster
from policyloop.contracts.v1 import loop_pb2, loop_pb2_grpc
from policyloop.demo.loop import DemoConfig, arithmetic_environment, loop_env, require_healthy
from policyloop.envs import arithmetic
from policyloop.serving.traces import environment_from_traces, read_exchanges

TRAIN_RUN, SFT_RUN, TRACES_RUN = "production", "sft-on-traces", "from-traces"


@dataclass
class ProductionConfig:
    loop: DemoConfig = field(default_factory=DemoConfig)  # the loop's settings; loop.budget_s: phase 1
    traffic: int = 96               # requests the scripted client sends to the serving endpoint
    traces_budget_s: float = 150.0  # seconds of the second run, on the traces' environment
    eval_tasks: int = 200           # held-out problems in the arithmetic environment's eval split
    every_versions: int = 20        # the evaluator scores versions that are multiples of this
    sft_epochs: int = 2             # the SFT run trains this many times as many demonstrations as the
                                    # traces gave, drawn at random as a run draws its tasks
    sft_timeout_s: float = 300.0    # the most the SFT run may take


@dataclass
class EvalPoint:
    run_id: str
    version: int
    t: float                        # seconds since the run started, when the result was seen
    pass_rate: float
    low: float
    high: float
    regressed: bool


@dataclass
class PromotionPoint:
    version: int
    sequence: int
    t: float
    reason: str


@dataclass
class ProductionResult:
    evals: list[EvalPoint] = field(default_factory=list)
    promotions: list[PromotionPoint] = field(default_factory=list)
    served_version: int = 0         # the version that answered the traffic
    traffic: int = 0
    traffic_correct: int = 0
    feedback: int = 0
    traces_tasks: int = 0           # the traces' environment: train tasks and eval split
    traces_eval_tasks: int = 0
    sft_demonstrations: int = 0     # the SFT run: demonstrations trained
    sft_versions: tuple[int, int] = (0, 0)  # the policy version before and after it
    train_seconds: float = 0.0
    sft_seconds: float = 0.0
    traces_seconds: float = 0.0

    def first_and_last(self, run_id: str) -> tuple[EvalPoint | None, EvalPoint | None]:
        points = [e for e in self.evals if e.run_id == run_id]
        return (points[0], points[-1]) if points else (None, None)


def production_env(config: ProductionConfig) -> dict[str, str]:
    return {"POLICYLOOP_EVERY_VERSIONS": str(config.every_versions), "POLICYLOOP_PROMOTE": "rule",
            "POLICYLOOP_MAX_EVAL_TASKS": str(config.eval_tasks)}


async def follow(stub: loop_pb2_grpc.LoopServiceStub, run_id: str, budget_s: float, result: ProductionResult,
                 console: Console) -> float:
    """Watches the run for `budget_s`: every new eval result and promotion is recorded and shown.
    Returns the seconds it ran."""
    started = time.monotonic()
    seen: set[int] = set()
    promoted = 0
    while time.monotonic() - started < budget_s:
        await asyncio.sleep(2.0)
        run = await stub.GetRun(loop_pb2.GetRunRequest(run_id=run_id), timeout=30)
        t = time.monotonic() - started
        for e in run.evals:
            if e.version not in seen:
                seen.add(e.version)
                result.evals.append(EvalPoint(run_id, e.version, round(t, 1), e.pass_rate, e.pass_rate_low,
                                              e.pass_rate_high, e.regressed))
                console.print(f"[{t:6.1f}s] {run_id} v{e.version}: eval pass rate {e.pass_rate:.1%} "
                              f"[{e.pass_rate_low:.1%}, {e.pass_rate_high:.1%}]"
                              + (" [red]regressed[/red]" if e.regressed else "") + f" ({e.seconds:.1f}s)")
        if run.HasField("promotion") and run.promotion.sequence > promoted and run_id == TRAIN_RUN:
            promoted = run.promotion.sequence
            result.promotions.append(PromotionPoint(run.promotion.version, promoted, round(t, 1),
                                                    run.promotion.reason))
            console.print(f"[{t:6.1f}s] [green]promoted v{run.promotion.version}[/green] ({run.promotion.reason})")
    return round(time.monotonic() - started, 1)


async def send_traffic(openai_url: str, model: str, problems: list[arithmetic.Problem], result: ProductionResult,
                       ) -> None:
    """The scripted client: a completion per problem, then feedback on each answer."""
    async with aiohttp.ClientSession() as http:
        async def one(problem: arithmetic.Problem) -> None:
            async with http.post(f"{openai_url}/completions", json={
                    "model": model, "prompt": problem.prompt, "max_tokens": 8, "temperature": 0}) as answer:
                answer.raise_for_status()
                body = await answer.json()
            text = body["choices"][0]["text"]
            right = arithmetic.score(text, body["choices"][0]["finish_reason"] == "stop", problem.answer).reward > 1
            result.traffic += 1
            result.traffic_correct += right
            result.served_version = int(body["system_fingerprint"].removeprefix("weights-"))
            feedback = {"id": body["id"], "reward": 1.0} if right else \
                {"id": body["id"], "reward": 0.0, "correction": problem.answer}
            async with http.post(f"{openai_url}/feedback", json=feedback) as answer:
                answer.raise_for_status()
                result.feedback += 1

        gate = asyncio.Semaphore(16)

        async def gated(problem: arithmetic.Problem) -> None:
            async with gate:
                await one(problem)

        await asyncio.gather(*(gated(p) for p in problems))


@dataclass
class SupervisedRun:
    """A finished SFT run: what it trained, the policy versions before and after, its seconds."""
    demonstrations: int
    versions: tuple[int, int]
    seconds: float


async def train_demonstrations(stub: loop_pb2_grpc.LoopServiceStub, env: loop_pb2.Environment, run_id: str, *,
                               epochs: int, seed: int, timeout_s: float,
                               announce: Callable[[str, int], None]) -> SupervisedRun:
    """A run of a supervised environment, `epochs` times as many demonstrations as it holds (drawn
    at random), followed until the learner has trained them all, then stopped. `announce(name,
    wanted)` is told the environment's name and how many it trains before the wait."""
    reply = await stub.SubmitEnvironment(loop_pb2.SubmitEnvironmentRequest(environment=env), timeout=60)
    run = await stub.StartRun(loop_pb2.StartRunRequest(
        run_id=run_id, environments=[loop_pb2.EnvironmentMix(environment=reply.environment, weight=1.0)],
        num_tasks=epochs * len(env.tasks), seed=seed, model="policy"), timeout=30)
    wanted = run.tasks_total  # the gateway rounds it up to a multiple of the learner's batch: all are trained
    before = run.policy_version
    announce(reply.environment, wanted)
    started = time.monotonic()
    while run.progress.trained_samples < wanted:
        if time.monotonic() - started > timeout_s:
            raise RuntimeError(f"run {run_id} trained {run.progress.trained_samples} of {wanted} demonstrations "
                               f"in {timeout_s:.0f} s")
        await asyncio.sleep(1.0)
        run = await stub.GetRun(loop_pb2.GetRunRequest(run_id=run_id), timeout=30)
    await stub.StopRun(loop_pb2.StopRunRequest(run_id=run_id), timeout=30)
    return SupervisedRun(int(run.progress.trained_samples), (before, run.policy_version),
                         round(time.monotonic() - started, 1))


async def supervised_run(stub: loop_pb2_grpc.LoopServiceStub, env: loop_pb2.Environment, config: ProductionConfig,
                         result: ProductionResult, console: Console) -> None:
    """SFT on the traces, `sft_epochs` passes' worth."""
    def announce(name: str, wanted: int) -> None:
        console.print(f"3. SFT on usage: {name} ({len(env.tasks)} demonstrations: rewarded answers as the "
                      f"engine's tokens, corrections as text); run {SFT_RUN} trains {wanted} of them (drawn at "
                      f"random) by cross-entropy")

    done = await train_demonstrations(stub, env, SFT_RUN, epochs=config.sft_epochs, seed=config.loop.seed,
                                      timeout_s=config.sft_timeout_s, announce=announce)
    result.sft_seconds, result.sft_demonstrations, result.sft_versions = done.seconds, done.demonstrations, \
        done.versions
    console.print(f"   {done.demonstrations} demonstrations trained in {done.seconds} s "
                  f"(v{done.versions[0]} → v{done.versions[1]})")


async def drive(cluster: LocalCluster, config: ProductionConfig, console: Console) -> ProductionResult:
    loop = config.loop
    await require_healthy(cluster, loop.start_timeout_s)
    console.print("[green]the services are healthy[/green] (with the evaluator and a serving replica)")
    result = ProductionResult()
    gateway = cluster.process("gateway-0").ports["grpc"]
    openai_url = f"http://127.0.0.1:{cluster.process('serving-0').ports['openai']}/v1"
    async with grpc.aio.insecure_channel(f"127.0.0.1:{gateway}") as channel:
        stub = loop_pb2_grpc.LoopServiceStub(channel)
        env = arithmetic_environment(loop.group_size, loop.max_new_tokens, loop.temperature)
        env.version = "v1-evals"
        heldout = arithmetic.heldout_problems(arithmetic.ArithmeticConfig(), config.eval_tasks, seed=loop.seed)
        env.eval_tasks.extend(loop_pb2.TaskSpec(prompt_text=p.prompt, answer=p.answer) for p in heldout)
        reply = await stub.SubmitEnvironment(loop_pb2.SubmitEnvironmentRequest(environment=env), timeout=60)
        await stub.StartRun(loop_pb2.StartRunRequest(
            run_id=TRAIN_RUN, environments=[loop_pb2.EnvironmentMix(environment=reply.environment, weight=1.0)],
            num_tasks=1_000_000, seed=loop.seed, model="policy"), timeout=30)
        console.print(f"1. train: run {TRAIN_RUN} on {reply.environment} ({reply.num_tasks} problems, "
                      f"{len(env.eval_tasks)} held out as its eval split); evaluated every {config.every_versions} "
                      f"versions, promoted by rule, served at {openai_url}")
        result.train_seconds = await follow(stub, TRAIN_RUN, loop.budget_s, result, console)
        await stub.StopRun(loop_pb2.StopRunRequest(run_id=TRAIN_RUN), timeout=30)

        problems = arithmetic.train_problems(arithmetic.ArithmeticConfig(), config.traffic, seed=loop.seed + 1)
        await send_traffic(openai_url, TRAIN_RUN, problems, result)
        console.print(f"2. serve: {result.traffic} requests answered by v{result.served_version}, "
                      f"{result.traffic_correct} right; feedback on each (a correction for the wrong ones)")

        bus = await Bus.connect(cluster.nats_url, name="demo-production")
        try:
            exchanges = await read_exchanges(bus, TRAIN_RUN)
            traces_env = environment_from_traces(exchanges, "served-arithmetic", "v1",
                                                 eval_fraction=0.25, group_size=loop.group_size,
                                                 temperature=loop.temperature, max_new_tokens=loop.max_new_tokens)
            sft_env = environment_from_traces(exchanges, "served-arithmetic-sft", "v1", eval_fraction=0.25,
                                              max_new_tokens=loop.max_new_tokens, supervised=True)
        finally:
            await bus.close()
        result.traces_tasks, result.traces_eval_tasks = len(traces_env.tasks), len(traces_env.eval_tasks)
        await supervised_run(stub, sft_env, config, result, console)
        reply = await stub.SubmitEnvironment(loop_pb2.SubmitEnvironmentRequest(environment=traces_env), timeout=60)
        await stub.StartRun(loop_pb2.StartRunRequest(
            run_id=TRACES_RUN, environments=[loop_pb2.EnvironmentMix(environment=reply.environment, weight=1.0)],
            num_tasks=1_000_000, seed=loop.seed, model="policy"), timeout=30)
        console.print(f"4. RL on usage: {reply.environment} from the traces ({result.traces_tasks} prompts, "
                      f"{result.traces_eval_tasks} held out); run {TRACES_RUN} trains on it")
        result.traces_seconds = await follow(stub, TRACES_RUN, config.traces_budget_s, result, console)
        await stub.StopRun(loop_pb2.StopRunRequest(run_id=TRACES_RUN), timeout=30)
    return result


def write_plot(result: ProductionResult, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, run_id, title in ((axes[0], TRAIN_RUN, "arithmetic: eval split (held-out problems)"),
                              (axes[1], TRACES_RUN, "from traces: eval split (held-out served prompts)")):
        points = [e for e in result.evals if e.run_id == run_id]
        if points:
            ax.errorbar([e.version for e in points], [e.pass_rate for e in points],
                        yerr=[[e.pass_rate - e.low for e in points], [e.high - e.pass_rate for e in points]],
                        fmt="o-", capsize=3, label="pass rate (95% interval)")
            flagged = [e for e in points if e.regressed]
            if flagged:
                ax.plot([e.version for e in flagged], [e.pass_rate for e in flagged], "rx", markersize=10,
                        label="regressed")
        if run_id == TRAIN_RUN:
            for i, p in enumerate(result.promotions):
                ax.axvline(p.version, color="green", alpha=0.3, label="promoted" if i == 0 else None)
        ax.set_xlabel("policy version")
        ax.set_ylabel("pass rate")
        ax.set_ylim(0, 1)
        ax.set_title(title)
        ax.legend(loc="upper left")
    fig.suptitle(f"policyloop demo --production: {len(result.promotions)} promotions; traffic "
                 f"{result.traffic_correct}/{result.traffic} right on v{result.served_version}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


_R = TypeVar("_R")


def on_serving_cluster(loop: DemoConfig, extra_env: dict[str, str], serving_run: str,
                       drive: Callable[[LocalCluster], Awaitable[_R]], *, console: Console, what: str) -> _R:
    """Runs `drive` on a fresh local cluster of the demo's loop with a serving replica that follows
    `serving_run`'s promotions; the cluster is stopped however it ends, even while it starts."""
    env = {**loop_env(loop), **extra_env, "POLICYLOOP_WEIGHTS_DIR": str(loop.run_dir.resolve() / "rollout-weights")}
    cluster = LocalCluster(loop.run_dir, extra_env=env, fresh=True, prometheus=loop.prometheus,
                           serving_run=serving_run)
    console.print(f"starting the local cluster in {loop.run_dir} (with {what}) …")
    try:
        cluster.start()
        return asyncio.run(drive(cluster))
    finally:
        console.print("stopping the cluster …")
        cluster.stop()


def run_production_demo(config: ProductionConfig, *, console: Console) -> int:
    from policyloop.models.bootstrap import bootstrap

    loop = config.loop
    if loop.model_path is None:
        console.print("base model: bootstrapping (cached after the first run) …")
        loop.model_path = bootstrap()
    result = on_serving_cluster(loop, production_env(config), TRAIN_RUN,
                                lambda cluster: drive(cluster, config, console), console=console,
                                what="the evaluator and a serving replica")
    out = loop.out or Path("runs") / "demo-production"
    out.mkdir(parents=True, exist_ok=True)
    summary = asdict(result) | {"config": {"budget_s": loop.budget_s, "traces_budget_s": config.traces_budget_s,
                                           "traffic": config.traffic, "eval_tasks": config.eval_tasks,
                                           "every_versions": config.every_versions,
                                           "sft_epochs": config.sft_epochs,
                                           "groups_per_step": loop.groups_per_step, "lr": loop.lr}}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    write_plot(result, out / "production.png")
    first, last = result.first_and_last(TRAIN_RUN)
    traces_first, traces_last = result.first_and_last(TRACES_RUN)
    console.print("[bold]summary[/bold]:")
    if first and last:
        console.print(f"  {TRAIN_RUN}: eval pass rate {first.pass_rate:.1%} (v{first.version}) → "
                      f"{last.pass_rate:.1%} (v{last.version}); {len(result.promotions)} versions promoted, the last "
                      f"v{result.promotions[-1].version if result.promotions else 0}")
    console.print(f"  traffic: {result.traffic_correct}/{result.traffic} right on v{result.served_version}, "
                  f"{result.feedback} feedback")
    console.print(f"  {SFT_RUN}: {result.sft_demonstrations} demonstrations in {result.sft_seconds} s "
                  f"(v{result.sft_versions[0]} → v{result.sft_versions[1]})")
    if traces_first and traces_last:
        console.print(f"  {TRACES_RUN}: {result.traces_tasks} prompts from the traces; eval pass rate "
                      f"{traces_first.pass_rate:.1%} (v{traces_first.version}) → {traces_last.pass_rate:.1%} "
                      f"(v{traces_last.version})")
    console.print(f"wrote {out / 'summary.json'} and {out / 'production.png'}")
    complete = bool(result.promotions) and result.traffic == result.feedback == config.traffic \
        and result.traces_tasks > 0 and result.sft_demonstrations > 0 and traces_last is not None
    return 0 if complete else 1
