"""The `policyloop` command: serve one service, bring up a local cluster, show its status,
run the demo."""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from policyloop.cluster.catalogue import SERVICE_NAMES, service_main

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="policyloop: an RL post-training loop of independent services.")
# Tables stay readable when the output is a file or a CI log (rich assumes 80 columns there).
console = Console() if sys.stdout.isatty() else Console(width=160)

DEFAULT_RUN_DIR = Path("runs/local")


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
    for name, ports in sorted(info.processes.items()):
        if name in ("nats-server", "redis-server"):
            continue
        where = []
        if "grpc" in ports:
            where.append(f"gRPC 127.0.0.1:{ports['grpc']}")
        where.append(f"http://127.0.0.1:{ports['http']}/metrics, /healthz")
        table.add_row(name, "; ".join(where))
    console.print(table)


@app.command()
def up(
    run_dir: Annotated[Path, typer.Option(help="Where logs, NATS/Redis data and weights go.")] = DEFAULT_RUN_DIR,
    nats_url: Annotated[str | None, typer.Option(help="Use this NATS instead of starting one.")] = None,
    redis_url: Annotated[str | None, typer.Option(help="Use this Redis instead of starting one.")] = None,
    namespace: Annotated[str, typer.Option(help="Redis key namespace of this cluster.")] = "default",
    replicas: Annotated[list[str], typer.Option("--replicas", help="e.g. --replicas rollout=2")] = [],  # noqa: B006
    wait_s: Annotated[float, typer.Option(help="How long to wait for every service to be healthy.")] = 60.0,
    model_path: Annotated[Path | None, typer.Option(help="Base policy directory (default: bootstrap).")] = None,
) -> None:
    """Start nats-server, redis-server and every service as local processes; Ctrl-C stops all."""
    from policyloop.cluster.local import LocalCluster

    if model_path is None:
        from policyloop.models.bootstrap import BootstrapConfig, bootstrap

        model_path = bootstrap(BootstrapConfig())
    cluster = LocalCluster(run_dir, nats_url=nats_url, redis_url=redis_url, namespace=namespace,
                           replicas=_parse_replicas(replicas),
                           extra_env={"POLICYLOOP_MODEL_PATH": str(Path(model_path).resolve())})
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
        table.add_row(inst.service, inst.instance, healthy, str(inst.policy_version), backlog, _notes(inst.detail))
    for name in status.missing:
        table.add_row(name, "—", "[red]no instance[/red]", "—", "—", "")
    console.print(table)


def _notes(detail: dict[str, object]) -> str:
    skip = {"nats", "redis"}
    return ", ".join(f"{k}={v}" for k, v in detail.items() if k not in skip and not k.startswith("consumer:"))


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
        }, indent=2, default=str))
    else:
        _print_status(result)
    raise typer.Exit(0 if result.all_healthy else 1)


@app.command()
def demo(
    run_dir: Annotated[Path, typer.Option(help="Where the demo cluster keeps its data.")] = Path("runs/demo"),
    out: Annotated[Path | None, typer.Option(help="Where summary.json and the plot go (default: runs/<run>).")] = None,
    budget_s: Annotated[float, typer.Option(help="Seconds of RL after the first evaluation.")] = 420.0,
    steps: Annotated[int, typer.Option(help="Stop after this many learner steps (0: the budget decides).")] = 0,
    model_path: Annotated[Path | None, typer.Option(help="Base model directory (default: bootstrap).")] = None,
    eval_problems: Annotated[int, typer.Option(help="Held-out problems per evaluation.")] = 200,
    eval_interval_s: Annotated[float, typer.Option(help="Seconds between held-out evaluations.")] = 60.0,
    groups_per_step: Annotated[int, typer.Option(help="Prompts per learner step.")] = 32,
    group_size: Annotated[int, typer.Option(help="Samples per prompt.")] = 8,
    lr: Annotated[float, typer.Option(help="Learning rate.")] = 1e-4,
    loss: Annotated[str, typer.Option(help="Policy loss: ppo, gspo or cispo.")] = "ppo",
    normalization: Annotated[str, typer.Option(
        help="token (DAPO), sequence (GRPO) or constant (Dr.GRPO).")] = "token",
    advantages: Annotated[str, typer.Option(help="group, group_no_std, leave_one_out or none.")] = "group",
    off_policy: Annotated[str, typer.Option(help="none, tis (truncated IS) or decoupled.")] = "none",
    tis_cap: Annotated[float, typer.Option(help="Cap of the IS weight.")] = 2.0,
    kl_coef: Annotated[float, typer.Option(help="KL penalty to the base policy (0: none).")] = 0.0,
    clip_high: Annotated[float, typer.Option(help="Upper clip range (clip-higher when > 0.2).")] = 0.2,
    max_lag: Annotated[int, typer.Option(help="Most versions a trained sample may lag (0: synchronous).")] = 1,
) -> None:
    """A real RL run: bootstrap the base model if needed, start the local cluster, train on the
    arithmetic environment for a fixed budget with live progress, and report held-out accuracy
    before and after (summary.json and a plot)."""
    from policyloop.cluster.demo import DemoConfig, run_demo

    config = DemoConfig(run_dir=run_dir, out=out, model_path=model_path, budget_s=budget_s, max_steps=steps,
                        eval_problems=eval_problems, eval_interval_s=eval_interval_s,
                        groups_per_step=groups_per_step, group_size=group_size, lr=lr, loss=loss,
                        normalization=normalization, advantages=advantages, off_policy=off_policy, tis_cap=tis_cap,
                        kl_coef=kl_coef, clip_high=clip_high, max_lag=max_lag)
    try:
        from policyloop.rl.objective import LossConfig

        LossConfig(kind=loss, normalization=normalization, advantages=advantages,  # type: ignore[arg-type]
                   off_policy=off_policy, tis_cap=tis_cap, kl_coef=kl_coef, clip_high=clip_high)
    except ValueError as exc:
        console.print(f"[red]{exc}[/red]")
        raise typer.Exit(2) from exc
    sys.exit(run_demo(config, console=console, print_status=_print_status))


@app.command()
def bootstrap(
    out: Annotated[Path | None, typer.Option(
        help="Cache root: the model goes into OUT/<name>-<config hash>/ "
             "(default $POLICYLOOP_CACHE/models or ~/.cache/policyloop/models).")] = None,
    force: Annotated[bool, typer.Option(help="Rebuild even when a complete cached model exists.")] = False,
) -> None:
    """Build (or find cached) the small base model warmed up on arithmetic; prints JSON."""
    from policyloop.models.bootstrap import BootstrapConfig, BootstrapError, bootstrap_dir, is_complete, read_record
    from policyloop.models.bootstrap import bootstrap as build_bootstrap

    config = BootstrapConfig()
    cached = is_complete(bootstrap_dir(config, out)) and not force
    try:
        path = build_bootstrap(config, out, force=force)
    except BootstrapError as exc:
        console.print(f"[red]bootstrap failed:[/red] {exc}")
        raise typer.Exit(1) from exc
    record = read_record(path)
    print(json.dumps({"path": str(path.resolve()), "heldout_accuracy": record["heldout_accuracy"],
                      "steps": record["steps"], "seconds": record["seconds"], "cached": cached}, indent=2))


if __name__ == "__main__":
    app()
