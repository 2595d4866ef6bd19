"""`policyloop versions` and `policyloop traces`: a run's versions (evaluations, promotion, rollback) and the
serving endpoint's traces."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

if TYPE_CHECKING:
    pass

from policyloop.cli.common import DEFAULT_RUN_DIR, app, console
from policyloop.cli.loop import GatewayOption, RunDirOption, TokenOption, served_exchanges, with_gateway

versions_app = typer.Typer(no_args_is_help=True, help="A run's versions: evaluations, promotion and rollback.")
app.add_typer(versions_app, name="versions")


@versions_app.command("list")
def versions_list(
    run_id: Annotated[str, typer.Argument(help="The run.")],
    gateway: GatewayOption = None, run_dir: RunDirOption = DEFAULT_RUN_DIR, token: TokenOption = "",
) -> None:
    """The run's versions the publisher holds, with their evaluations; the one served is marked."""
    from policyloop.cluster.client import version_line

    listed = with_gateway(gateway, run_dir, token, lambda client: client.list_versions(run_id))
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

    promotion = with_gateway(gateway, run_dir, token,
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

    promotion = with_gateway(gateway, run_dir, token, lambda client: client.rollback(run_id, version, reason))
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

    count = export_sft(served_exchanges(model, nats_url, run_dir), to, min_reward=min_reward)
    console.print(f"{count} records of {model} written to {to}")


if __name__ == "__main__":
    app()
