"""`policyloop up`, `status` and `top`: the local cluster, and what a cluster's services report."""

from __future__ import annotations

import asyncio
import json
import signal
import time
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table

from policyloop.cluster.catalogue import SERVICE_NAMES

if TYPE_CHECKING:
    pass

from policyloop.cli.common import DEFAULT_RUN_DIR, app, console


def _parse_replicas(values: list[str]) -> dict[str, int]:
    out = {}
    for value in values:
        name, _, count = value.partition("=")
        if name not in SERVICE_NAMES or not count.isdigit():
            raise typer.BadParameter(f"{value!r}: expected <service>=<count>, service one of {SERVICE_NAMES}")
        out[name] = int(count)
    return out


def _print_endpoints(info) -> None:  # type: ignore[no-untyped-def]
    from policyloop.cluster.local import REWARD_MODEL, REWARD_MODEL_NAME, service_of

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
        if service_of(name) == REWARD_MODEL:  # an engine, not a service: no /healthz
            table.add_row(name, f"reward model {REWARD_MODEL_NAME}: http://127.0.0.1:{ports['http']}/classify, "
                                "/metrics, /health")
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
    tinker: Annotated[bool, typer.Option(
        "--tinker",
        help="The Tinker API trains and samples: the learner trains its models beside the loop's runs "
             "(tinker=true), and tinker-sampler-0, a rollout replica over the base model, samples for it.")] = False,
    serving_run: Annotated[str, typer.Option(
        help="Also start serving-0: a serving replica of this run's promoted versions behind an "
             "OpenAI-compatible endpoint (docs/evaluation.md).")] = "",
    reward_model: Annotated[bool, typer.Option(
        "--reward-model",
        help="Also start reward-model-0: an embedded engine serving the bootstrap reward model (built once, "
             "cached) as arith-rm on /classify, which reward and evaluator score with (the reward_model "
             "scorer).")] = False,
    relay_fanout: Annotated[int, typer.Option(
        min=0, help="Relayed fan-out: the publisher places the rollout replicas in a tree of this fan-out and "
                    "each fetches versions from its parent, serving its children (docs/weights.md; 0: every "
                    "replica fetches from the publisher).")] = 0,
) -> None:
    """Start nats-server, redis-server and every service as local processes; Ctrl-C stops all."""
    from policyloop.cluster.local import LocalCluster

    if nats_url and nats_nodes > 1:
        raise typer.BadParameter("--nats-nodes starts a NATS cluster; --nats-url uses one already running")
    base_model, reward_model_dir = _cluster_models(model_path, reward_model)
    cluster = LocalCluster(run_dir, nats_url=nats_url, redis_url=redis_url, namespace=namespace,
                           replicas=_parse_replicas(replicas), nats_nodes=nats_nodes, prometheus=prometheus,
                           extra_env={"POLICYLOOP_MODEL_PATH": str(base_model)},
                           tinker=tinker, serving_run=serving_run, reward_model=reward_model_dir,
                           relay_fanout=relay_fanout)
    _run_until_stopped(cluster, namespace, wait_s)


def _cluster_models(model_path: str | None, reward_model: bool) -> tuple[Path, Path | None]:
    """The base policy's directory (the bootstrap one by default; a Hugging Face id downloaded once,
    before any service starts) and, with `reward_model`, the bootstrap reward model's."""
    from policyloop.cli.models import model_dir
    from policyloop.models.bootstrap import BootstrapConfig, bootstrap

    base = Path(model_dir(model_path if model_path is not None else str(bootstrap(BootstrapConfig())))).resolve()
    if not reward_model:
        return base, None
    from policyloop.models.reward_model import REWARD_MODEL_BOOTSTRAP

    return base, bootstrap(REWARD_MODEL_BOOTSTRAP).resolve()


def _run_until_stopped(cluster, namespace: str, wait_s: float) -> None:  # type: ignore[no-untyped-def]
    """Starts the cluster, reports its health, restarts what exits until SIGINT/SIGTERM, then stops it."""
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
        print_status(status)
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


def print_status(status) -> None:  # type: ignore[no-untyped-def]
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
        print_status(result)
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
