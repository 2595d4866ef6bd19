"""The `policyloop` command: serve one service, bring up a local cluster, show its status,
run the demo, and submit environments and drive runs through a gateway (`env`, `run`)."""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, TypeVar, get_args, get_origin

import typer
from pydantic import BaseModel
from rich.console import Console
from rich.table import Table

from policyloop.cluster.catalogue import SERVICE_NAMES, service_main
from policyloop.learner.settings import TRACKER_KINDS, TrackerSettings
from policyloop.rl.settings import OptimizerSettings
from policyloop.runtime.settings import ServiceSettings
from policyloop.scorers.kinds import SCORER_KINDS

if TYPE_CHECKING:
    from policyloop.rl.losses import PolicyLoss

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="policyloop: an RL post-training loop of independent services.")
# Tables stay readable when the output is a file or a CI log (rich assumes 80 columns there).
console = Console() if sys.stdout.isatty() else Console(width=160)

DEFAULT_RUN_DIR = Path("runs/local")
F = TypeVar("F", bound=Callable[..., Any])


def field_help(model: type[BaseModel], name: str) -> str:
    """A settings field's description, with its choices when it has a fixed set."""
    info = model.model_fields[name]
    choices = get_args(info.annotation) if get_origin(info.annotation) is Literal else ()
    return (info.description or "") + (f" One of: {', '.join(map(str, choices))}." if choices else "")


def field_default(model: type[BaseModel], name: str) -> Any:
    return model.model_fields[name].default


def loss_options(*, into: str) -> Callable[[F], F]:
    """Gives a command one option per setting of the loss registry's kinds (`--loss` for the kind,
    `--clip-low` ...: help and type from the first kind that has it) and passes those given to the
    command as one dict `into`, for the kind to validate: a setting added to a kind is a flag at
    once, and one left unset takes the chosen kind's default."""
    from policyloop.rl.losses import DEFAULT_KIND, LOSS_KINDS, parameters

    def decorate(command: F) -> F:
        signature = inspect.signature(command)
        own = [p for p in signature.parameters.values() if p.name != into]
        added = []
        for name, model in parameters().items():
            if name == "kind":
                option = typer.Option(help=f"The loss kind. One of: {', '.join(LOSS_KINDS)}.")
                added.append(inspect.Parameter("loss", inspect.Parameter.KEYWORD_ONLY, default=DEFAULT_KIND,
                                               annotation=Annotated[str, option]))
                continue
            info = model.model_fields[name]
            annotation = str if get_origin(info.annotation) is Literal else info.annotation
            first_kind = model.model_fields["kind"].default
            option = typer.Option(help=f"{field_help(model, name)} (default: the kind's; {first_kind}: {info.default})")
            added.append(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None,
                                           annotation=Annotated[annotation | None, option]))

        @functools.wraps(command)
        def wrapper(**kwargs: Any) -> Any:
            values = {"kind": kwargs.pop("loss")}
            for name in parameters():
                if name != "kind" and (value := kwargs.pop(name)) is not None:
                    values[name] = value
            return command(**kwargs, **{into: values})

        wrapper.__signature__ = signature.replace(parameters=[*own, *added])  # type: ignore[attr-defined]
        return wrapper  # type: ignore[return-value]

    return decorate


@app.command(
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
    add_help_option=False,
)
def serve(ctx: typer.Context, name: Annotated[str, typer.Argument(help=f"one of: {', '.join(SERVICE_NAMES)}")]) -> None:
    """Run one service. Settings come from POLICYLOOP_* variables or flags (--help lists them)."""
    if name not in SERVICE_NAMES:
        console.print(f"[red]unknown service {name!r}[/red]; one of: {', '.join(SERVICE_NAMES)}")
        raise typer.Exit(2)
    raise typer.Exit(service_main(name)(list(ctx.args)))


@app.command()
def probe(
    http_port: Annotated[int, typer.Option(envvar="POLICYLOOP_HTTP_PORT", help="The service's /healthz port.")] = 9100,
    grpc_port: Annotated[int, typer.Option(
        envvar="POLICYLOOP_GRPC_PORT", help="Also check the gRPC health protocol on this port (0: no gRPC).")] = 0,
    host: Annotated[str, typer.Option(help="Where the service listens, seen from the probe.")] = "127.0.0.1",
    timeout_s: Annotated[float, typer.Option(help="Deadline of each check.")] = 3.0,
) -> None:
    """Exit 0 when the service in this container is healthy (image HEALTHCHECK, probes)."""
    from policyloop.runtime.probe import probe_grpc, probe_http

    results = [probe_http(host, http_port, timeout_s)]
    if grpc_port:
        results.append(probe_grpc(host, grpc_port, timeout_s))
    for result in results:
        print(f"{'ok' if result.ok else 'FAIL'} {result.what} {result.detail}")
    raise typer.Exit(0 if all(r.ok for r in results) else 1)


@app.command("sandbox-check")
def sandbox_check(
    cgroups: Annotated[str, typer.Option(help="auto, required or off: as the sandbox service's setting.")] = "auto",
) -> None:
    """Run hostile jobs through the sandbox here (e.g. in its container) and show each is contained; exit 1 if not."""
    from policyloop.sandbox.selfcheck import SandboxUnavailable, self_check

    try:
        outcomes = asyncio.run(self_check(cgroups))
    except SandboxUnavailable as exc:
        print(json.dumps({"ok": False, "isolation": str(exc)}, indent=2))
        raise typer.Exit(1) from exc
    ok = all(outcome.ok for outcome in outcomes)
    print(json.dumps({"ok": ok, "probes": [asdict(outcome) for outcome in outcomes]}, indent=2))
    raise typer.Exit(0 if ok else 1)


@app.command()
def audit(
    nats_url: Annotated[str, typer.Option(envvar="POLICYLOOP_NATS_URL", help="The cluster's NATS (a list: a,b,c).")
                        ] = "nats://127.0.0.1:4222",
    settle_s: Annotated[float, typer.Option(
        help="First wait until ROLLOUTS is empty and LEDGER unchanged this long (0: audit at once).")] = 0.0,
    model: Annotated[str, typer.Option(help="Model whose trained steps are listed.")] = "policy",
) -> None:
    """Every generated trajectory's fate from the bus (lost, trained twice, steps…); prints JSON.
    On a live loop the figures are `provisional` (said with the reason): gaps may be work in flight."""
    from policyloop.bus import Bus
    from policyloop.ledger import audit_bus, trained_steps, wait_settled

    async def run() -> dict[str, object]:
        bus = await Bus.connect(nats_url, name="policyloop-audit", connect_timeout_s=30)
        try:
            settled = await wait_settled(bus, settle_s, timeout_s=max(60.0, settle_s * 10)) if settle_s else None
            report = await audit_bus(bus)
            if settled is False and not report.provisional:  # asked to wait for rest, and it never came
                report.provisional = True
                report.provisional_reason = (f"the loop did not settle (no {settle_s:g} s without movement): lost "
                                             "and trained_not_generated may count work in flight")
            steps = await trained_steps(bus, model)
            return {**report.as_dict(), "settled": settled, "newest_version": steps[-1].version if steps else 0}
        finally:
            await bus.close()

    print(json.dumps(asyncio.run(run()), indent=2))


@app.command()
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

    from policyloop.cluster.demo import evaluate as evaluate_engine
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


def _parse_replicas(values: list[str]) -> dict[str, int]:
    out = {}
    for value in values:
        name, _, count = value.partition("=")
        if name not in SERVICE_NAMES or not count.isdigit():
            raise typer.BadParameter(f"{value!r}: expected <service>=<count>, service one of {SERVICE_NAMES}")
        out[name] = int(count)
    return out


def _print_endpoints(info) -> None:  # type: ignore[no-untyped-def]
    table = Table(title=f"policyloop cluster in {info.run_dir}")
    table.add_column("process")
    table.add_column("listens on")
    table.add_row("nats", info.nats_url)
    table.add_row("redis", info.redis_url)
    if info.prometheus_url:
        table.add_row("prometheus", f"{info.prometheus_url} (every service's /metrics, alert rules)")
    for name, ports in sorted(info.processes.items()):
        if name in ("redis-server", "prometheus") or name.startswith("nats-"):  # nats-server, or nodes nats-0, …
            continue
        where = []
        if "grpc" in ports:
            where.append(f"gRPC 127.0.0.1:{ports['grpc']}")
        if "api" in ports:  # the tinker service: TINKER_BASE_URL
            where.append(f"Tinker API http://127.0.0.1:{ports['api']}")
        if "openai" in ports:  # a serving replica: the OpenAI-compatible endpoint
            where.append(f"OpenAI API http://127.0.0.1:{ports['openai']}/v1")
        where.append(f"http://127.0.0.1:{ports['http']}/metrics, /healthz")
        table.add_row(name, "; ".join(where))
    console.print(table)


@app.command()
def up(
    run_dir: Annotated[Path, typer.Option(help="Where logs, NATS/Redis data and weights go.")] = DEFAULT_RUN_DIR,
    nats_url: Annotated[str | None, typer.Option(
        help="Use this NATS instead of starting one (a cluster: its servers comma-separated, and "
             "POLICYLOOP_BUS__STREAM_REPLICAS set).")] = None,
    redis_url: Annotated[str | None, typer.Option(help="Use this Redis instead of starting one.")] = None,
    namespace: Annotated[str, typer.Option(help="Redis key namespace of this cluster.")] = "default",
    replicas: Annotated[list[str], typer.Option("--replicas", help="e.g. --replicas rollout=2")] = [],  # noqa: B006
    wait_s: Annotated[float, typer.Option(help="How long to wait for every service to be healthy.")] = 60.0,
    model_path: Annotated[str | None, typer.Option(
        help="Base policy: a directory, or a Hugging Face model id (org/name[@revision]) fetched into the Hugging "
             "Face cache first (default: bootstrap).")] = None,
    nats_nodes: Annotated[int, typer.Option(
        min=1, max=5, help="NATS servers to start: 1, or 3 for a JetStream cluster that survives losing one "
                           "(every stream kept on all three).")] = 1,
    prometheus: Annotated[bool | None, typer.Option(
        "--prometheus/--no-prometheus",
        help="Start Prometheus scraping every service (default: when it is installed).")] = None,
    tinker_learner: Annotated[bool, typer.Option(
        "--tinker-learner",
        help="Also start tinker-learner-0: the learner that trains the Tinker API's models (tinker=true), "
             "a second learner beside the RL one, which cannot serve Tinker too.")] = False,
    serving_run: Annotated[str, typer.Option(
        help="Also start serving-0: a serving replica of this run's promoted versions behind an "
             "OpenAI-compatible endpoint (docs/evaluation.md).")] = "",
) -> None:
    """Start nats-server, redis-server and every service as local processes; Ctrl-C stops all."""
    from policyloop.cluster.local import LocalCluster

    if nats_url and nats_nodes > 1:
        raise typer.BadParameter("--nats-nodes starts a NATS cluster; --nats-url uses one already running")
    if model_path is None:
        from policyloop.models.bootstrap import BootstrapConfig, bootstrap

        model_path = str(bootstrap(BootstrapConfig()))
    model_path = str(model_dir(model_path))  # a Hugging Face id: downloaded once, before any service starts
    cluster = LocalCluster(run_dir, nats_url=nats_url, redis_url=redis_url, namespace=namespace,
                           replicas=_parse_replicas(replicas), nats_nodes=nats_nodes, prometheus=prometheus,
                           extra_env={"POLICYLOOP_MODEL_PATH": str(Path(model_path).resolve())},
                           tinker_learner=tinker_learner, serving_run=serving_run)
    stopping = False

    def request_stop(*_: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, request_stop)
    signal.signal(signal.SIGTERM, request_stop)
    info = cluster.start()
    _print_endpoints(info)
    try:
        status = asyncio.run(_wait_healthy(info.nats_url, info.redis_url, namespace, wait_s, lambda: stopping))
        _print_status(status)
        if status.all_healthy:
            console.print("[green]all services healthy[/green] — Ctrl-C stops the cluster")
        else:
            console.print("[yellow]not every service is healthy yet; see the logs in "
                          f"{info.run_dir}/logs[/yellow]")
        while not stopping:
            for name in cluster.supervise():
                console.print(f"[yellow]{name} exited; restarted[/yellow]")
            time.sleep(0.5)
    finally:
        console.print("stopping the cluster…")
        cluster.stop()
        console.print("stopped")


async def _wait_healthy(nats_url: str, redis_url: str, namespace: str, wait_s: float,
                        give_up=lambda: False):  # type: ignore[no-untyped-def]
    from policyloop.cluster.status import cluster_status

    deadline = time.monotonic() + wait_s
    while True:
        status = await cluster_status(nats_url, redis_url, namespace)
        if status.all_healthy or time.monotonic() >= deadline or give_up():
            return status
        await asyncio.sleep(0.5)


def _print_status(status) -> None:  # type: ignore[no-untyped-def]
    table = Table(title="policyloop status")
    for col in ("service", "instance", "healthy", "policy version", "backlog (pending / unacked)", "notes"):
        table.add_column(col)
    for inst in status.instances:
        backlog = f"{inst.backlog.pending} / {inst.backlog.ack_pending}" if inst.backlog else "—"
        healthy = "[green]yes[/green]" if inst.healthy else f"[red]no[/red] {inst.reason}"
        table.add_row(inst.service, inst.instance, healthy, str(inst.policy_version), backlog, _notes(inst.heartbeat))
    for name in status.missing:
        table.add_row(name, "—", "[red]no instance[/red]", "—", "—", "")
    console.print(table)
    if status.replicated:
        streams = Table(title="streams (NATS cluster)")
        for col in ("stream", "replicas", "leader", "copies behind"):
            streams.add_column(col)
        for name, replicas in status.streams.items():
            streams.add_row(name, str(replicas.replicas), replicas.leader or "[red]electing[/red]",
                            ", ".join(replicas.behind) or "—")
        console.print(streams)


def _notes(beat) -> str:  # type: ignore[no-untyped-def]
    """Failing health checks, then the role's own scalar figures (its status message's top level)."""
    from google.protobuf import json_format

    failing = [f"{name}: {reason}" for name, reason in sorted(beat.checks.items()) if reason != "ok"]
    role = beat.WhichOneof("status")
    figures = json_format.MessageToDict(getattr(beat, role), preserving_proto_field_name=True) if role else {}
    return ", ".join(failing + [f"{k}={v}" for k, v in figures.items() if not isinstance(v, dict | list)])


@app.command()
def status(
    run_dir: Annotated[Path, typer.Option(help="Run directory of a `policyloop up`.")] = DEFAULT_RUN_DIR,
    nats_url: Annotated[str | None, typer.Option(help="Instead of the run directory's.")] = None,
    redis_url: Annotated[str | None, typer.Option(help="Instead of the run directory's.")] = None,
    namespace: Annotated[str | None, typer.Option(help="Redis key namespace.")] = None,
    wait_s: Annotated[float, typer.Option(help="Wait up to this long for every service to be healthy.")] = 0.0,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
) -> None:
    """List each service: healthy or not, its policy version and its backlog. Exit 1 unless all
    six are healthy."""
    from policyloop.cluster.local import ClusterError, ClusterInfo

    if not (nats_url and redis_url):
        try:
            info = ClusterInfo.load(run_dir)
        except ClusterError as exc:
            console.print(f"[red]{exc}[/red]")
            raise typer.Exit(2) from exc
        nats_url, redis_url = nats_url or info.nats_url, redis_url or info.redis_url
        namespace = namespace or info.namespace
    result = asyncio.run(_wait_healthy(nats_url, redis_url, namespace or "default", wait_s))
    if as_json:
        print(json.dumps({
            "all_healthy": result.all_healthy,
            "missing": result.missing,
            "instances": [asdict(i) for i in result.instances],
            "streams": {name: asdict(s) for name, s in result.streams.items()},
        }, indent=2, default=str))
    else:
        _print_status(result)
    raise typer.Exit(0 if result.all_healthy else 1)


@app.command()
def top(
    run_dir: Annotated[Path, typer.Option(help="Run directory of `policyloop up`.")] = DEFAULT_RUN_DIR,
    prometheus_url: Annotated[str | None, typer.Option(
        help="Read this Prometheus (default: the cluster's, when it runs one; else every service's /metrics).")]
    = None,
    interval_s: Annotated[float, typer.Option(min=0.2, help="Seconds between refreshes.")] = 2.0,
    window_s: Annotated[float, typer.Option(min=1, help="Rates and distributions over about this many seconds.")]
    = 15.0,
    iterations: Annotated[int, typer.Option(help="Stop after this many refreshes (0: until Ctrl-C).")] = 0,
) -> None:
    """The operational ledger of a running cluster, live: services, backlogs, tokens/s, version
    lag, KL and entropy, reward by environment, publish latency, drops and dead letters."""
    from rich.live import Live

    from policyloop.cluster.local import ClusterError, ClusterInfo, service_of
    from policyloop.cluster.scrape import MetricsEndpoint, Scrape, scrape_prometheus, scrape_services
    from policyloop.cluster.top import LedgerWindow, render

    try:
        info = ClusterInfo.load(run_dir)
    except ClusterError as exc:
        console.print(f"[red]{exc}[/red]")
        raise typer.Exit(2) from exc
    url = prometheus_url or info.prometheus_url
    endpoints = [MetricsEndpoint(name, service_of(name), f"http://127.0.0.1:{ports['http']}/metrics")
                 for name, ports in sorted(info.processes.items()) if "http" in ports]

    def scrape() -> Scrape:
        if url:
            try:
                return scrape_prometheus(url)
            except (OSError, RuntimeError, ValueError):
                pass  # Prometheus not answering: the services themselves
        return asyncio.run(scrape_services(endpoints))

    window = LedgerWindow(window_s)
    refreshes = 0
    with Live(console=console, auto_refresh=False) as live:
        try:
            while True:
                live.update(render(window.add(scrape())), refresh=True)
                refreshes += 1
                if iterations and refreshes >= iterations:
                    break
                time.sleep(interval_s)
        except KeyboardInterrupt:
            pass


@app.command()
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
    from policyloop.cluster.demo import DemoConfig

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
    from policyloop.cluster.demo import run_demo

    if production + agent + agent_env > 1:
        console.print("[red]--production, --agent and --agent-env are demos of their own: choose one[/red]")
        raise typer.Exit(2)
    if production:
        return _production_demo(config, traffic, traces_budget_s, every_versions)
    if agent:
        return _agent_demo(config, traffic, sessions_per_step)
    if agent_env:
        return _env_demo(config)
    return run_demo(config, console=console, print_status=_print_status)


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
    from policyloop.cluster.demo_production import ProductionConfig, run_production_demo

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
    from policyloop.cluster.demo_agent import AgentDemoConfig, run_agent_demo

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
    from policyloop.cluster.demo_env import EnvDemoConfig, run_env_demo

    demo = EnvDemoConfig()
    if config.lora_rank or config.tools or config.tracker != "none":
        console.print("[red]--agent-env trains the full model, without --tools or --tracker[/red]")
        raise typer.Exit(2)
    demo.loop.model_path, demo.loop.out, demo.loop.prometheus = config.model_path, config.out, config.prometheus
    if config.run_dir != Path("runs/demo"):
        demo.loop.run_dir = config.run_dir
    demo.loop.max_steps = config.max_steps or demo.loop.max_steps
    return run_env_demo(demo, console=console)


@app.command()
def bootstrap(
    out: Annotated[Path | None, typer.Option(
        help="Cache root: the model goes into OUT/<name>-<config hash>/ "
             "(default $POLICYLOOP_CACHE/models or ~/.cache/policyloop/models).")] = None,
    force: Annotated[bool, typer.Option(help="Rebuild even when a complete cached model exists.")] = False,
    tools: Annotated[bool, typer.Option(help="The multi-turn demo's model (it knows the python tool).")] = False,
    chat: Annotated[bool, typer.Option(
        help="The chat model: a BPE tokenizer, the Qwen2.5 chat template, and function tools it calls "
             "(<tool_call> blocks) after a warm-up on arithmetic questions.")] = False,
    link: Annotated[Path | None, typer.Option(
        help="Also point this path at the model (a relative symlink, replaced atomically): a fixed name "
             "such as /models/base for containers that mount the same volume.")] = None,
) -> None:
    """Build (or find cached) the small base model warmed up on arithmetic; prints JSON."""
    from policyloop.models.bootstrap import (
        TOOLS_BOOTSTRAP,
        BootstrapConfig,
        BootstrapError,
        BootstrapRecipe,
        bootstrap_dir,
        is_complete,
        read_record,
    )
    from policyloop.models.bootstrap import bootstrap as build_bootstrap

    if tools and chat:
        console.print("[red]--tools and --chat name different models: give one[/red]")
        raise typer.Exit(2)
    config: BootstrapRecipe
    if chat:
        from policyloop.models.chat import CHAT_BOOTSTRAP

        config = CHAT_BOOTSTRAP
    else:
        config = TOOLS_BOOTSTRAP if tools else BootstrapConfig()
    cached = is_complete(bootstrap_dir(config, out)) and not force
    try:
        path = build_bootstrap(config, out, force=force)
    except BootstrapError as exc:
        console.print(f"[red]bootstrap failed:[/red] {exc}")
        raise typer.Exit(1) from exc
    record = read_record(path)
    if link is not None:
        _replace_symlink(link, path)
    if chat:
        from policyloop.models.chat import summary

        printed = {"path": str(path.resolve()), **summary(record), "cached": cached}
    else:
        printed = {"path": str(path.resolve()), "heldout_accuracy": record["heldout_accuracy"],
                   "steps": record["steps"], "seconds": record["seconds"], "cached": cached}
    print(json.dumps(printed, indent=2))


def _replace_symlink(link: Path, target: Path) -> None:
    """`link` -> `target`, relative so that it resolves wherever the volume is mounted; a rename
    over the old link, so a reader sees one or the other."""
    link = link.absolute()
    if link.exists() and not link.is_symlink():
        raise typer.BadParameter(f"{link} exists and is not a symlink", param_hint="--link")
    link.parent.mkdir(parents=True, exist_ok=True)
    relative = os.path.relpath(target.resolve(), link.parent.resolve())
    tmp = link.with_name(f".{link.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(relative, target_is_directory=True)
    tmp.replace(link)


# -- base models: a directory, or a Hugging Face model id in the Hugging Face cache -------------

models_app = typer.Typer(no_args_is_help=True, help="Base models named by a Hugging Face model id (docs/deploy.md).")
app.add_typer(models_app, name="models")


def model_dir(name: str | Path, flag: str = "--model-path") -> Path:
    """The directory of the model a flag names (models.resolve: a directory, or a Hugging Face
    model id looked up in, or fetched into, the Hugging Face cache); a bad name is a usage error."""
    from policyloop.models.resolve import ModelNotFound, resolve_model

    try:
        return resolve_model(name, setting=flag)
    except ModelNotFound as exc:
        raise typer.BadParameter(str(exc).removeprefix(f"{flag}: "), param_hint=flag) from exc


@models_app.command("fetch")
def models_fetch(
    model: Annotated[str, typer.Argument(
        help="A Hugging Face model id: org/name, or org/name@revision (a branch, tag or commit).")],
    link: Annotated[Path | None, typer.Option(
        help="Also point this path at the model's snapshot (a relative symlink, replaced atomically): a fixed "
             "name such as /models/base for containers that mount the same volume.")] = None,
) -> None:
    """Download a Hugging Face model into the Hugging Face cache (HF_HOME), once for a cluster whose
    services share that cache; prints JSON. With HF_HUB_OFFLINE=1 it only checks the cache."""
    from policyloop.models.resolve import hub_model

    if hub_model(model) is None:
        raise typer.BadParameter(f"{model!r} is not a Hugging Face model id (org/name[@revision])",
                                 param_hint="MODEL")
    path = model_dir(model, "MODEL")
    if link is not None:
        _replace_symlink(link, path)
    print(json.dumps({"model": model, "path": str(path), "link": str(link) if link else None}, indent=2))


# -- environments and runs through the gateway's LoopService ----------------------------------

env_app = typer.Typer(no_args_is_help=True, help="Environments on a running cluster (LoopService).")
run_app = typer.Typer(no_args_is_help=True, help="Runs on a running cluster (LoopService).")
app.add_typer(env_app, name="env")
app.add_typer(run_app, name="run")

GatewayOption = Annotated[str | None, typer.Option(
    help="host:port of a gateway (default: the `policyloop up` cluster in --run-dir).")]
RunDirOption = Annotated[Path, typer.Option(help="Run directory of `policyloop up` (finds its gateway).")]
TokenOption = Annotated[str, typer.Option(envvar="POLICYLOOP_TOKEN", help="Bearer token, if the gateway wants one.")]


def _loop_client(gateway: str | None, run_dir: Path, token: str):  # type: ignore[no-untyped-def]
    from policyloop.cluster.client import LoopClient, gateway_address
    from policyloop.cluster.local import ClusterError

    try:
        return LoopClient(gateway_address(gateway, run_dir), token)
    except ClusterError as exc:
        console.print(f"[red]{exc}[/red] (or give --gateway host:port)")
        raise typer.Exit(2) from exc


def _with_gateway(gateway: str | None, run_dir: Path, token: str, call):  # type: ignore[no-untyped-def]
    """`call(client)` on a LoopService client; a refused call prints the gateway's status and
    reason and exits 1."""
    import grpc

    client = _loop_client(gateway, run_dir, token)
    try:
        return call(client)
    except KeyboardInterrupt:
        return None
    except grpc.RpcError as exc:
        console.print(f"[red]{exc.code().name}[/red]: {exc.details()}")  # type: ignore[attr-defined]
        raise typer.Exit(1) from exc
    finally:
        client.close()


@env_app.command("submit")
def env_submit(
    name: Annotated[str, typer.Option(help="Environment name.")],
    tasks: Annotated[Path | None, typer.Argument(
        help="JSONL, one task per line: {prompt, answer?, prompt_token_ids?, metadata?} (unit tests: metadata.tests, "
             "metadata.solution_prefix; --supervised: demonstration or demonstration_token_ids). With --verifiers: "
             "omit it, the environment's dataset is the tasks.")] = None,
    version: Annotated[str, typer.Option(help="Environment version (name@version is its key).")] = "v1",
    scorer: Annotated[str, typer.Option(help="; ".join(f"{kind.name}: {kind.rewards}" for kind in SCORER_KINDS) +
                                        " (with --program, --openenv or --verifiers: environment_reward).")]
    = "exact_answer",
    pattern: Annotated[str, typer.Option(help="regex: the pattern a completion must match; exact_answer: the answer's "
                                              "format, a completion must match it whole to earn the format term.")]
    = "",
    tolerance: Annotated[float, typer.Option(help="numeric_tolerance: the allowed difference.")] = 0.0,
    code: Annotated[Path | None, typer.Option(help="unit_tests: shared test code; reward_code: the source "
                                                   "defining reward(prompt, completion, metadata).")] = None,
    timeout_s: Annotated[float, typer.Option(help="Sandbox time limit of one scoring job.")] = 10.0,
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
    program: Annotated[Path | None, typer.Option(
        help="An environment program (reset/step, see docs/environments.md): a module, a package directory or a "
             "pure-Python wheel, run in a sandbox session per episode; its tasks are what reset is given.")] = None,
    entry: Annotated[str, typer.Option(help="--program: its class, as module:Class.")] = "",
    step_timeout_s: Annotated[float, typer.Option(
        help="--program, --verifiers: most seconds of one exchange (0: 10; verifiers, its loading included: 60).")]
    = 0.0,
    episode_timeout_s: Annotated[float, typer.Option(
        help="--program, --verifiers: most seconds of an episode (0: 60; verifiers: 300).")] = 0.0,
    requirement: Annotated[list[str] | None, typer.Option(
        help="--program, --verifiers: a dependency, as a pip requirement (e.g. sortedcontainers==2.4.0), once per "
             "requirement; the sandbox installs wheels only.")] = None,
    wheel: Annotated[list[Path] | None, typer.Option(
        help="--program, --verifiers: a wheel file it depends on, once per wheel.")] = None,
    verifiers: Annotated[str, typer.Option(
        help="A verifiers environment's id (vf.load_environment), run unchanged in a sandbox session per episode "
             "and scored by its rubric; installed here too, its dataset and eval dataset are the tasks.")] = "",
    env_source: Annotated[Path | None, typer.Option(
        help="--verifiers: the environment's module, package directory or wheel, when no --wheel or "
             "--requirement installs it.")] = None,
    env_args: Annotated[str, typer.Option(help="--verifiers: load_environment's keyword arguments, a JSON object.")]
    = "",
    task_count: Annotated[int, typer.Option(help="--verifiers: the first N dataset rows (0: all).")] = 0,
    eval_count: Annotated[int, typer.Option(help="--verifiers: the first N eval dataset rows (0: all).")] = 0,
    openenv: Annotated[str, typer.Option(help="An OpenEnv environment server's URL: each episode a session of its "
                                              "own, scored by the rewards it gives.")] = "",
    action_field: Annotated[str, typer.Option(help="--openenv: the action's text field (default: message).")] = "",
    observation_field: Annotated[str, typer.Option(
        help="--openenv: the observation's field the model is shown (default: all of it, as JSON).")] = "",
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
                                tools=tool, supervised=supervised, driver=driver)
        env.eval_tasks.extend(held_out)
    except (TaskFileError, ValueError, OSError) as exc:
        console.print(f"[red]{exc}[/red]")
        raise typer.Exit(2) from exc
    reply = _with_gateway(gateway, run_dir, token, lambda client: client.submit(env))
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


def _served_exchanges(model: str, nats_url: str | None, run_dir: Path):  # type: ignore[no-untyped-def]
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

    env = environment_from_traces(_served_exchanges(model, nats_url, run_dir), name, version, min_reward=min_reward,
                                  eval_fraction=eval_fraction, group_size=group_size, temperature=temperature,
                                  max_new_tokens=max_new_tokens, supervised=supervised)
    if not env.tasks:
        console.print(f"[red]no trace of {model} has an outcome to learn from[/red] (a correction, or a reward of "
                      f"at least {min_reward}); {len(env.eval_tasks)} went to the eval split")
        raise typer.Exit(1)
    reply = _with_gateway(gateway, run_dir, token, lambda client: client.submit(env))
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
    run = _with_gateway(gateway, run_dir, token, lambda client: client.start(request))
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

    _with_gateway(gateway, run_dir, token, follow)


@run_app.command("stop")
def run_stop(
    run_id: Annotated[str, typer.Argument(help="The run to stop.")],
    gateway: GatewayOption = None, run_dir: RunDirOption = DEFAULT_RUN_DIR, token: TokenOption = "",
) -> None:
    """Stop a run: no more of its tasks are fed."""
    from policyloop.cluster.client import progress_line

    run = _with_gateway(gateway, run_dir, token, lambda client: client.stop(run_id))
    console.print(progress_line(run), highlight=False, soft_wrap=True)


versions_app = typer.Typer(no_args_is_help=True, help="A run's versions: evaluations, promotion and rollback.")
app.add_typer(versions_app, name="versions")


@versions_app.command("list")
def versions_list(
    run_id: Annotated[str, typer.Argument(help="The run.")],
    gateway: GatewayOption = None, run_dir: RunDirOption = DEFAULT_RUN_DIR, token: TokenOption = "",
) -> None:
    """The run's versions the publisher holds, with their evaluations; the one served is marked."""
    from policyloop.cluster.client import version_line

    listed = _with_gateway(gateway, run_dir, token, lambda client: client.list_versions(run_id))
    for row in listed.versions:
        console.print(version_line(row), highlight=False)


@versions_app.command("promote")
def versions_promote(
    run_id: Annotated[str, typer.Argument(help="The run.")],
    version: Annotated[int, typer.Option(help="The version to serve (0: the newest that passed its evaluation).")]
    = 0,
    reason: Annotated[str, typer.Option(help="Why, for the record.")] = "",
    force: Annotated[bool, typer.Option(help="Promote a version the evaluator flagged as a regression.")] = False,
    gateway: GatewayOption = None, run_dir: RunDirOption = DEFAULT_RUN_DIR, token: TokenOption = "",
) -> None:
    """Serve a version of the run on its serving deployment."""
    from google.protobuf.json_format import MessageToDict

    promotion = _with_gateway(gateway, run_dir, token,
                              lambda client: client.promote(run_id, version, reason, force=force))
    print(json.dumps(MessageToDict(promotion)))


@versions_app.command("rollback")
def versions_rollback(
    run_id: Annotated[str, typer.Argument(help="The run.")],
    version: Annotated[int, typer.Option(help="The version to serve again (0: the one promoted before).")] = 0,
    reason: Annotated[str, typer.Option(help="Why, for the record.")] = "",
    gateway: GatewayOption = None, run_dir: RunDirOption = DEFAULT_RUN_DIR, token: TokenOption = "",
) -> None:
    """Serve an earlier version of the run again."""
    from google.protobuf.json_format import MessageToDict

    promotion = _with_gateway(gateway, run_dir, token, lambda client: client.rollback(run_id, version, reason))
    print(json.dumps(MessageToDict(promotion)))


traces_app = typer.Typer(no_args_is_help=True, help="Traces of the serving endpoint (TRACES, FEEDBACK).")
app.add_typer(traces_app, name="traces")


@traces_app.command("export")
def traces_export(
    model: Annotated[str, typer.Option(help="The served model's name (what callers pass as `model`).")],
    to: Annotated[Path, typer.Option(help="The JSON-lines file to write (one exchange per line; an agent session's "
                                          "exchanges as one multi-turn line, with its loss mask).")],
    min_reward: Annotated[float | None, typer.Option(
        help="Only exchanges whose newest feedback gave at least this reward.")] = None,
    run_dir: Annotated[Path, typer.Option(help="Run directory of a `policyloop up`.")] = DEFAULT_RUN_DIR,
    nats_url: Annotated[str | None, typer.Option(help="Instead of the run directory's.")] = None,
) -> None:
    """Write the model's traces, with their exact token ids, weights version and feedback, as
    training data (SFT); an agent session's turns as one token sequence, split where its client
    rewrote history."""
    from policyloop.serving.traces import export_sft

    count = export_sft(_served_exchanges(model, nats_url, run_dir), to, min_reward=min_reward)
    console.print(f"{count} records of {model} written to {to}")


if __name__ == "__main__":
    app()

