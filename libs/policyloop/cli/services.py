"""`policyloop serve`, `probe`, `sandbox-check` and `audit`: one service, and checks of a host and a ledger."""

from __future__ import annotations

import asyncio
import json
from dataclasses import asdict
from typing import TYPE_CHECKING, Annotated

import typer

from policyloop.cluster.catalogue import SERVICE_NAMES, service_main

if TYPE_CHECKING:
    pass

from policyloop.cli.common import app, console


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
