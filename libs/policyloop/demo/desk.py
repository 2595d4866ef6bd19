"""`policyloop demo --agent-env`: the tool-using chat model trained on a stateful environment.

1. Submit the tally desk (policyloop/envs/programs/tally_desk.py) as an environment program: a
   customer asks for a sum, the desk's calculator books each calculation in its ledger, and the
   desk rewards the right total (1), a calculation booked right (0.2) and penalises a double entry
   (-0.5). Each episode runs the desk in a sandbox session of its own.
2. RL: a run samples episodes of the desk (up to three model turns, the desk answering between
   them), scored by the rewards it gave, and the learner trains on them.
3. Evaluate: the cluster's evaluator scores the held-out split (desk episodes of seeds never
   trained on, greedy, in sessions) at the run's start, every few versions and at its end.

It writes `summary.json` (the desk's reward by step, the evaluations with their 95% intervals)
and `agent_env.png`.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import grpc
from rich.console import Console

from policyloop.cluster.client import build_environment, read_program
from policyloop.cluster.local import LocalCluster
from policyloop.contracts.v1 import loop_pb2, loop_pb2_grpc
from policyloop.demo.loop import DemoConfig, loop_env, require_healthy
from policyloop.envs.programs import TALLY_DESK, TALLY_DESK_ENTRY

ENV_RUN = "agent-env"
HELDOUT_SEEDS = 1_000_000  # eval seeds start here; training seeds stay below
TRAIN_SEEDS = 4096         # training tasks: the desk's seeds 0..TRAIN_SEEDS-1
DONE = (loop_pb2.RUN_STATE_FINISHED, loop_pb2.RUN_STATE_FAILED, loop_pb2.RUN_STATE_STOPPED)


@dataclass
class EnvDemoConfig:
    loop: DemoConfig = field(default_factory=lambda: DemoConfig(
        run_dir=Path("runs/demo-agent-env"), groups_per_step=16, max_steps=30, budget_s=1200.0, lr=3e-4,
        max_new_tokens=96, eval_every_versions=10, eval_problems=64))
    max_turns: int = 3
    final_eval_timeout_s: float = 300.0  # the most the end version's evaluation may take once the run ends


@dataclass
class EvalPoint:
    version: int
    pass_rate: float
    low: float
    high: float
    mean_reward: float


@dataclass
class EnvDemoResult:
    environment: str = ""
    rewards: list[tuple[int, float]] = field(default_factory=list)  # (learner step, the desk's mean reward)
    evals: list[EvalPoint] = field(default_factory=list)
    steps: int = 0
    state: str = ""
    seconds: float = 0.0

    def reward_quarters(self) -> tuple[float, float]:
        """The mean reward of the first and of the last quarter of the steps seen."""
        values = [r for _, r in self.rewards]
        quarter = max(1, len(values) // 4)
        return (sum(values[:quarter]) / quarter, sum(values[-quarter:]) / quarter) if values else (0.0, 0.0)


def desk_environment(config: EnvDemoConfig) -> loop_pb2.Environment:
    loop = config.loop
    env = build_environment(
        "tally-desk", "v1", [loop_pb2.TaskSpec(metadata={"seed": str(s)}) for s in range(TRAIN_SEEDS)],
        "environment_reward", group_size=loop.group_size, max_new_tokens=loop.max_new_tokens,
        temperature=loop.temperature, max_turns=config.max_turns, driver=read_program(TALLY_DESK, TALLY_DESK_ENTRY))
    env.eval_tasks.extend(loop_pb2.TaskSpec(metadata={"seed": str(HELDOUT_SEEDS + i)})
                          for i in range(loop.eval_problems))
    return env


async def follow(stub: loop_pb2_grpc.LoopServiceStub, result: EnvDemoResult, config: EnvDemoConfig,
                 console: Console) -> None:
    """Polls the run until it ends (or the budget does) and its end version is evaluated."""
    started, ended_at = time.monotonic(), None
    while True:
        run = await stub.GetRun(loop_pb2.GetRunRequest(run_id=ENV_RUN), timeout=30)
        t = time.monotonic() - started
        step = run.progress.learner_step
        env = run.progress.environments.get(result.environment)
        if env is not None and step and all(s != step for s, _ in result.rewards):
            result.rewards.append((step, env.last_step_reward))
            console.print(f"[{t:6.1f}s] step {step:3d}: the desk's mean reward {env.last_step_reward:+.3f}")
        for e in run.evals:
            if all(p.version != e.version for p in result.evals):
                [score] = e.environments or [loop_pb2.EnvironmentScore()]
                result.evals.append(EvalPoint(e.version, e.pass_rate, e.pass_rate_low, e.pass_rate_high,
                                              score.mean_reward))
                console.print(f"[{t:6.1f}s] v{e.version}: held-out pass rate {e.pass_rate:.1%} "
                              f"[{e.pass_rate_low:.1%}, {e.pass_rate_high:.1%}], mean reward {score.mean_reward:+.3f}")
        if run.state not in DONE and t > config.loop.budget_s:
            await stub.StopRun(loop_pb2.StopRunRequest(run_id=ENV_RUN), timeout=30)
        if run.state in DONE:
            ended_at = ended_at or time.monotonic()
            waited = time.monotonic() - ended_at
            if any(p.version >= run.policy_version for p in result.evals) or waited > config.final_eval_timeout_s:
                result.state, result.steps = loop_pb2.RunState.Name(run.state), step
                result.seconds = round(time.monotonic() - started, 1)
                return
        await asyncio.sleep(2.0)


async def drive(cluster: LocalCluster, config: EnvDemoConfig, console: Console) -> EnvDemoResult:
    loop = config.loop
    await require_healthy(cluster, loop.start_timeout_s)
    console.print("[green]the services are healthy[/green]")
    result = EnvDemoResult()
    env = desk_environment(config)
    gateway = cluster.process("gateway-0").ports["grpc"]
    async with grpc.aio.insecure_channel(f"127.0.0.1:{gateway}") as channel:
        stub = loop_pb2_grpc.LoopServiceStub(channel)
        submitted = await stub.SubmitEnvironment(loop_pb2.SubmitEnvironmentRequest(environment=env), timeout=60)
        result.environment = submitted.environment
        console.print(f"1. submitted {submitted.environment}: the tally desk, each episode in a sandbox session; "
                      f"{len(env.eval_tasks)} held-out episodes for the evaluator")
        tasks = loop.max_steps * loop.groups_per_step
        await stub.StartRun(loop_pb2.StartRunRequest(
            run_id=ENV_RUN, num_tasks=tasks, seed=loop.seed,
            environments=[loop_pb2.EnvironmentMix(environment=submitted.environment, weight=1)]), timeout=60)
        console.print(f"2. RL: run {ENV_RUN}, {loop.max_steps} steps of {loop.groups_per_step} groups of "
                      f"{loop.group_size} episodes (up to {config.max_turns} model turns each)")
        await follow(stub, result, config, console)
    return result


def write_plot(result: EnvDemoResult, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    left.plot([s for s, _ in result.rewards], [r for _, r in result.rewards], marker=".")
    left.set_xlabel("learner step")
    left.set_ylabel("the desk's mean reward (training episodes)")
    versions = [p.version for p in result.evals]
    rates = [p.pass_rate for p in result.evals]
    right.errorbar(versions, rates, yerr=[[r - p.low for r, p in zip(rates, result.evals, strict=True)],
                                          [p.high - r for r, p in zip(rates, result.evals, strict=True)]],
                   marker="o", capsize=4)
    right.set_ylim(0, 1)
    right.set_xlabel("policy version")
    right.set_ylabel("held-out pass rate (greedy episodes, 95% interval)")
    fig.suptitle("policyloop demo --agent-env: the chat model on the tally desk")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_env_demo(config: EnvDemoConfig, *, console: Console) -> int:
    from policyloop.models.bootstrap import bootstrap
    from policyloop.models.chat import CHAT_BOOTSTRAP

    loop = config.loop
    if loop.model_path is None:
        console.print("base model: the chat bootstrap model (built and cached after the first run) …")
        loop.model_path = bootstrap(CHAT_BOOTSTRAP)
    env = {**loop_env(loop), "POLICYLOOP_WEIGHTS_DIR": str(loop.run_dir.resolve() / "rollout-weights"),
           "POLICYLOOP_EVERY_VERSIONS": str(loop.eval_every_versions),
           "POLICYLOOP_MAX_EVAL_TASKS": str(loop.eval_problems)}
    cluster = LocalCluster(loop.run_dir, extra_env=env, fresh=True, prometheus=loop.prometheus)
    console.print(f"starting the local cluster in {loop.run_dir} …")
    try:
        cluster.start()
        result = asyncio.run(drive(cluster, config, console))
    finally:
        console.print("stopping the cluster …")
        cluster.stop()
    out = loop.out or Path("runs") / "demo-agent-env"
    out.mkdir(parents=True, exist_ok=True)
    first, last = result.reward_quarters()
    summary = asdict(result) | {"reward_first_quarter": round(first, 4), "reward_last_quarter": round(last, 4),
                                "config": {"steps": loop.max_steps, "groups_per_step": loop.groups_per_step,
                                           "group_size": loop.group_size, "lr": loop.lr,
                                           "max_turns": config.max_turns, "eval_tasks": loop.eval_problems,
                                           "model_path": str(loop.model_path)}}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    write_plot(result, out / "agent_env.png")
    console.print(f"[bold]summary[/bold]: {result.steps} steps in {result.seconds} s ({result.state}); the desk's "
                  f"mean reward {first:+.3f} (first quarter) → {last:+.3f} (last quarter)")
    if result.evals:
        a, b = result.evals[0], result.evals[-1]
        console.print(f"  held-out pass rate v{a.version} {a.pass_rate:.1%} → v{b.version} {b.pass_rate:.1%}")
    console.print(f"wrote {out / 'summary.json'} and {out / 'agent_env.png'}")
    return 0 if result.state == "RUN_STATE_FINISHED" and len(result.evals) >= 2 else 1
