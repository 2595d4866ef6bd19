"""Each kind is declared once and everything else agrees with it: the scorer kinds
(policyloop.scorers.kinds) with the contract, the reward service's registry, the CLI and
docs/environments.md; the environments that drive their episodes with the contract and the docs.
(The loss kinds: tests/unit/test_loss_registry.py.)"""

from __future__ import annotations

import re
from pathlib import Path

from policyloop.contracts.v1 import bus_pb2, loop_pb2
from policyloop.envs.driven import DRIVER_KINDS
from policyloop.scorers.kinds import SCORER_KINDS, SCORERS, field_choices
from policyloop.scorers.registry import default_registry

DOCS = Path(__file__).resolve().parents[2] / "docs" / "environments.md"


def docs_table(header: str) -> dict[str, str]:
    """The rows of the docs table whose header row starts with `header`: first cell → second."""
    lines = DOCS.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {header} |"))
    rows = {}
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[0].strip("`")] = cells[1]
    return rows


def test_scorer_kinds_are_the_contracts_scorers() -> None:
    for message in (bus_pb2.Scorer, loop_pb2.Environment):
        oneof = message.DESCRIPTOR.oneofs_by_name["kind" if message is bus_pb2.Scorer else "scorer"]
        assert [f.name for f in oneof.fields] == list(dict.fromkeys(kind.field for kind in SCORER_KINDS)), message
    builtins = {v.number for v in bus_pb2.BuiltinVerifier.Kind.DESCRIPTOR.values if v.number}
    assert {kind.builtin for kind in SCORER_KINDS if kind.builtin is not None} == builtins
    assert all(sum(where is not None for where in (kind.verify, kind.sandboxed, kind.served)) == 1
               for kind in SCORER_KINDS)


def test_the_reward_service_runs_every_scorer_kind() -> None:
    async def no_sandbox(job: bus_pb2.SandboxJob) -> bus_pb2.SandboxResult:
        raise AssertionError("not called")

    assert default_registry(no_sandbox).kinds == sorted(SCORERS)


def test_the_docs_list_each_scorer_and_what_it_rewards() -> None:
    assert docs_table("scorer") == {kind.name: kind.rewards for kind in SCORER_KINDS}


def test_the_cli_and_the_gateway_offer_the_tables_choices() -> None:
    from typing import get_type_hints

    from policyloop.cli.loop import env_submit

    scorer_help = get_type_hints(env_submit, include_extras=True)["scorer"].__metadata__[0].help
    assert all(f"{kind.name}: {kind.rewards}" in scorer_help for kind in SCORER_KINDS)
    assert field_choices() == "builtin (exact_answer, numeric_tolerance, regex), unit_tests, reward_code, " \
                              "environment_reward, reward_model or judge"


def test_the_environments_that_drive_their_episodes_are_the_contracts_and_the_docs() -> None:
    for message in (bus_pb2.Task, loop_pb2.Environment):
        assert tuple(f.name for f in message.DESCRIPTOR.oneofs_by_name["driver"].fields) == DRIVER_KINDS
    assert tuple(docs_table("driver")) == DRIVER_KINDS
    assert all(re.search(rf"--{kind}\b", DOCS.read_text()) for kind in DRIVER_KINDS)  # each has its CLI flag
