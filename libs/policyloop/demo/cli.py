"""The demo's commands: `policyloop demo` (a real RL run on the local cluster, or the production,
agent and environment demos) and `policyloop evaluate` (an engine's held-out arithmetic accuracy).
They join the `policyloop` command through the `policyloop.commands` entry point (register)."""

from __future__ import annotations

import asyncio
import json
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from policyloop.learner.settings import TRACKER_KINDS, TrackerSettings
from policyloop.rl.settings import OptimizerSettings
from policyloop.runtime.settings import ServiceSettings

if TYPE_CHECKING:
    from policyloop.rl.losses import PolicyLoss

from policyloop.cli.cluster import print_status
from policyloop.cli.common import console, field_default, field_help, loss_options
from policyloop.cli.models import model_dir


def register(app: typer.Typer) -> None:
    """Adds the demo's commands to the `policyloop` command."""
    app.command()(evaluate)
    app.command()(demo)


def evaluate(
    engine_url: Annotated[str | None, typer.Option(
        help="An SGLang-protocol engine (default: the embedded engine of the rollout replica on this host, "
             "found through its heartbeat in Redis).")] = None,
    model_path: Annotated[str, typer.Option(
        envvar="POLICYLOOP_MODEL_PATH", help="The policy's tokenizer: a model directory or a Hugging Face model id.")
                          ] = "model",
    problems: Annotated[int, typer.Option(help="Held-out arithmetic problems.")] = 200,
    seed: Annotated[int, typer.Option()] = 0,
    redis_url: Annotated[str, typer.Option(envvar="POLICYLOOP_REDIS_URL")] = "redis://127.0.0.1:6379/0",
    namespace: Annotated[str, typer.Option(envvar="POLICYLOOP_NAMESPACE")] = "default",
) -> None:
    """Greedy held-out arithmetic accuracy of what an engine serves now; prints JSON."""
    import socket

    from policyloop.demo.loop import evaluate as evaluate_engine
    from policyloop.engines.sglang_client import SGLangClient
    from policyloop.envs import arithmetic
    from policyloop.models.tokenizer import load_tokenizer
    from policyloop.state import HeartbeatRegistry, connect_redis

    async def find_engine() -> str:
        client = await connect_redis(redis_url)
        try:
            beats = [b for b in await HeartbeatRegistry(client, namespace).alive() if b.service == "rollout"]
        finally:
            await client.aclose()
        here = [b for b in beats if b.instance.startswith(socket.gethostname())]
        if not (here or beats):
            raise typer.BadParameter("no rollout replica is alive to ask for its engine", param_hint="--engine-url")
        return (here or beats)[0].rollout.engine_url

    async def run() -> dict[str, object]:
        url = engine_url or await find_engine()
        tokenizer = load_tokenizer(model_dir(model_path))
        heldout = arithmetic.heldout_problems(arithmetic.ArithmeticConfig(), problems, seed=seed)
        client = SGLangClient(url, timeout_s=120)
        try:
            measured = await evaluate_engine(client, tokenizer, heldout)
        finally:
            await client.close()
        return {"engine": url, "problems": len(heldout), "accuracy": measured.accuracy, "version": measured.version}

    print(json.dumps(asyncio.run(run()), indent=2))


@loss_options(into="objective")
def demo(
    objective: dict[str, Any],
    run_dir: Annotated[Path, typer.Option(help="Where the demo cluster keeps its data.")] = Path("runs/demo"),
    out: Annotated[Path | None, typer.Option(help="Where summary.json and the plot go (default: runs/<run>).")] = None,
    budget_s: Annotated[float, typer.Option(help="Seconds of RL after the first evaluation.")] = 420.0,
    steps: Annotated[int, typer.Option(help="Stop after this many learner steps (0: the budget decides).")] = 0,
    model_path: Annotated[str | None, typer.Option(
        help="Base model: a directory, or a Hugging Face model id (org/name[@revision]) fetched into the Hugging "
             "Face cache first (default: bootstrap).")] = None,
    eval_problems: Annotated[int, typer.Option(help="Held-out problems per evaluation.")] = 600,
    eval_interval_s: Annotated[float, typer.Option(
        help="--tools and LoRA runs: seconds between the demo's own held-out evaluations.")] = 60.0,
    eval_every_versions: Annotated[int, typer.Option(
        help="The full model's run: the cluster's evaluator scores the held-out problems every this many versions "
             "(and the versions the run starts and ends at).")] = 100,
    groups_per_step: Annotated[int, typer.Option(help=field_help(ServiceSettings, "groups_per_step"))]
    = field_default(ServiceSettings, "groups_per_step"),
    group_size: Annotated[int, typer.Option(help="Samples per prompt.")] = 8,
    lr: Annotated[float, typer.Option(help=field_help(OptimizerSettings, "lr"))]
    = field_default(OptimizerSettings, "lr"),
    # On the demo's task a rank-16 adapter learns fastest near 3e-4 (one process, 120 s: 16% -> 44%;
    # 29% at 1e-3, and collapse at 3e-3).
    lora_lr: Annotated[float, typer.Option(help="With --lora-rank: the adapters' learning rate (for --lr).")]
    = 3e-4,
    runs: Annotated[int, typer.Option(help="With --lora-rank: LoRA runs of the task trained at once.")] = 1,
    lora_rank: Annotated[int, typer.Option(
        help="Train LoRA runs of this rank over the frozen base, --runs of them at once (0: the full model).")] = 0,
    max_lag: Annotated[int, typer.Option(help=field_help(ServiceSettings, "max_lag"))]
    = field_default(ServiceSettings, "max_lag"),
    weight_update_mode: Annotated[str, typer.Option(
        help="How new versions reach requests in flight: in_place, retract, or abort (partial rollouts).")]
        = "in_place",
    tools: Annotated[bool, typer.Option(
        help="Multi-turn: the policy may call a python tool (run in the sandbox) before it answers.")] = False,
    prometheus: Annotated[bool | None, typer.Option(
        "--prometheus/--no-prometheus",
        help="Run Prometheus beside the demo's cluster (default: when it is installed).")] = None,
    tracker: Annotated[str, typer.Option(
        help=field_help(TrackerSettings, "kind") + " The learner's steps and the demo's held-out evaluations go "
             "to it, under RUN_DIR/tracking (other tracker settings: POLICYLOOP_TRACKER__*, docs/trackers.md).")]
        = field_default(TrackerSettings, "kind"),
    production: Annotated[bool, typer.Option(
        "--production", help="The whole production loop (docs/evaluation.md): train with the evaluator scoring "
                             "versions and promoting by rule to a serving replica, send it scripted traffic with "
                             "feedback, turn the traces into an environment and train a second run on it.")] = False,
    traffic: Annotated[int | None, typer.Option(
        help="--production: requests the scripted client sends; --agent: agent sessions (default: each demo's own)."
    )] = None,
    traces_budget_s: Annotated[float, typer.Option(help="--production: seconds of the run on the traces.")] = 150.0,
    every_versions: Annotated[int, typer.Option(help="--production: the evaluator scores every this many versions.")]
    = 20,
    agent: Annotated[bool, typer.Option(
        "--agent", help="The chat model served as an OpenAI Agents SDK agent with a calculator tool: held-out "
                        "questions measured through the endpoint, scripted agent traffic with feedback, SFT on the "
                        "rewarded sessions, the promoted version measured again (docs/serving.md).")] = False,
    sessions_per_step: Annotated[int | None, typer.Option(
        help="--agent: rewarded sessions per SFT step, for --groups-per-step (default: the demo's own).")] = None,
    agent_env: Annotated[bool, typer.Option("--agent-env", help="The chat model trained by RL on the tally desk, a "
                                            "stateful environment program (docs/environments.md).")] = False,
) -> None:
    """A real RL run: bootstrap the base model if needed, start the local cluster, train on the
    arithmetic environment for a fixed budget with live progress, and report held-out accuracy
    before and after (summary.json and a plot). --tools: the multi-turn environment.
    --production: evaluation, promotion, serving and traces, end to end."""
    from policyloop.demo.loop import DemoConfig

    loss = _demo_objective(objective, weight_update_mode, tracker, runs, lora_rank, tools)
    if lora_rank:
        lr = lora_lr
    config = DemoConfig(run_dir=run_dir, out=out, model_path=model_dir(model_path) if model_path else None,
                        budget_s=budget_s, max_steps=steps,
                        eval_problems=eval_problems, eval_interval_s=eval_interval_s,
                        eval_every_versions=eval_every_versions,
                        groups_per_step=groups_per_step, group_size=group_size, lr=lr, loss=loss,
                        max_lag=max_lag, weight_update_mode=weight_update_mode, tools=tools,
                        prometheus=prometheus, tracker=tracker, runs=runs, lora_rank=lora_rank)
    signal.signal(signal.SIGTERM, _interrupt)  # a demo told to stop stops its cluster on the way out, as on Ctrl-C
    sys.exit(_chosen_demo(config, production=production, agent=agent, agent_env=agent_env, traffic=traffic,
                          traces_budget_s=traces_budget_s, every_versions=every_versions,
                          sessions_per_step=sessions_per_step))


def _chosen_demo(config, *, production: bool, agent: bool, agent_env: bool,  # type: ignore[no-untyped-def]
                 traffic: int | None, traces_budget_s: float, every_versions: int, sessions_per_step: int | None
                 ) -> int:
    """The demo the flags name: the RL run, --production, --agent or --agent-env (one of them)."""
    from policyloop.demo.loop import run_demo

    if production + agent + agent_env > 1:
        console.print("[red]--production, --agent and --agent-env are demos of their own: choose one[/red]")
        raise typer.Exit(2)
    if production:
        return _production_demo(config, traffic, traces_budget_s, every_versions)
    if agent:
        return _agent_demo(config, traffic, sessions_per_step)
    if agent_env:
        return _env_demo(config)
    return run_demo(config, console=console, print_status=print_status)


def _demo_objective(objective: dict[str, object], weight_update_mode: str, tracker: str, runs: int, lora_rank: int,
                    tools: bool) -> PolicyLoss:
    """The demo's objective, once its flags are checked together (exit 2 naming what is wrong)."""
    from policyloop.engines.protocol import PAUSE_MODES

    if weight_update_mode not in PAUSE_MODES:
        console.print(f"[red]--weight-update-mode must be one of {', '.join(PAUSE_MODES)}[/red]")
        raise typer.Exit(2)
    if tracker not in TRACKER_KINDS:
        console.print(f"[red]--tracker must be one of {', '.join(TRACKER_KINDS)}[/red]")
        raise typer.Exit(2)
    from pydantic import ValidationError

    from policyloop.rl.losses import loss_settings

    try:
        loss = loss_settings(**objective)
    except ValidationError as exc:
        problems = "; ".join(f"--{'-'.join(str(p) for p in e['loc'][1:]).replace('_', '-') or 'loss'}: {e['msg']}"
                             for e in exc.errors())
        console.print(f"[red]{problems}[/red]")
        raise typer.Exit(2) from exc
    if runs < 1 or lora_rank < 0 or (runs > 1 and not lora_rank) or (lora_rank and (tools or tracker != "none")):
        console.print("[red]--runs N needs --lora-rank; LoRA runs go without --tools and --tracker[/red]")
        raise typer.Exit(2)
    return loss


def _interrupt(*_: object) -> None:
    """The first SIGTERM interrupts; later ones are ignored, so that they cannot cut short the
    cluster's stop that the first one began."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise KeyboardInterrupt


def _production_demo(config, traffic: int | None, traces_budget_s: float, every_versions: int) -> int:  # type: ignore[no-untyped-def]
    """`demo --production` on the demo's loop settings (its own run directory by default)."""
    from policyloop.demo.production import ProductionConfig, run_production_demo

    if config.lora_rank or config.tools or config.tracker != "none":
        console.print("[red]--production trains the full model, without --tools or --tracker[/red]")
        raise typer.Exit(2)
    if config.run_dir == Path("runs/demo"):
        config.run_dir = Path("runs/demo-production")
    production = ProductionConfig(loop=config, traces_budget_s=traces_budget_s, every_versions=every_versions)
    production.traffic = production.traffic if traffic is None else traffic
    return run_production_demo(production, console=console)


def _agent_demo(config, traffic: int | None, sessions_per_step: int | None) -> int:  # type: ignore[no-untyped-def]
    """`demo --agent`: the chat model, its own run directory by default."""
    from policyloop.demo.agent import AgentDemoConfig, run_agent_demo

    agent = AgentDemoConfig()
    agent.traffic = agent.traffic if traffic is None else traffic
    config.groups_per_step = agent.loop.groups_per_step if sessions_per_step is None else sessions_per_step
    agent.loop = config
    if config.lora_rank or config.tools or config.tracker != "none" or agent.traffic < 1:
        console.print("[red]--agent trains the full model, without --tools or --tracker, on --traffic >= 1[/red]")
        raise typer.Exit(2)
    if config.run_dir == Path("runs/demo"):
        config.run_dir = Path("runs/demo-agent")
    return run_agent_demo(agent, console=console)


def _env_demo(config) -> int:  # type: ignore[no-untyped-def]
    """`demo --agent-env`: the demo's own loop settings; the flags give the model, the run directory,
    the output, Prometheus and the run's length."""
    from policyloop.demo.desk import EnvDemoConfig, run_env_demo

    demo = EnvDemoConfig()
    if config.lora_rank or config.tools or config.tracker != "none":
        console.print("[red]--agent-env trains the full model, without --tools or --tracker[/red]")
        raise typer.Exit(2)
    demo.loop.model_path, demo.loop.out, demo.loop.prometheus = config.model_path, config.out, config.prometheus
    if config.run_dir != Path("runs/demo"):
        demo.loop.run_dir = config.run_dir
    demo.loop.max_steps = config.max_steps or demo.loop.max_steps
    return run_env_demo(demo, console=console)
