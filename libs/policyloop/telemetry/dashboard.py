"""The Grafana dashboard shipped in the package (policyloop/telemetry/grafana/): where it is, the
Grafana release whose dashboard schema it is written in, and its panels' PromQL as Prometheus
itself can run it — Grafana's template variables and built-in intervals replaced by values.

The JSON file is the artefact (provisioned by compose and Kubernetes, importable anywhere);
nothing here generates it."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from importlib import resources
from importlib.resources.abc import Traversable
from typing import Any

# The uid of the Prometheus datasource the provisioning files create; every panel names it.
DATASOURCE_UID = "policyloop-prometheus"
DASHBOARD_UID = "policyloop-ledger"

# Grafana image tag → the dashboard schemaVersion that release writes and expects
# (DASHBOARD_SCHEMA_VERSION in public/app/features/dashboard/state/DashboardMigrator.ts of that
# release). The dashboard's schemaVersion must be the one of the release compose.yaml and
# deploy/k8s pin; tests/unit/test_grafana_dashboard.py checks it. Bumping the image: look the
# number up in that release's DashboardMigrator.ts, add a row, and migrate the dashboard
# (import it into the new release and export it) if the number changed.
#   12.4.4 → 42: DashboardMigrator.ts of the 12.4.4 release declares DASHBOARD_SCHEMA_VERSION = 42
#   and states that 42 is the final schema version of the v1 (classic JSON) dashboard API.
GRAFANA_SCHEMA_VERSIONS: dict[str, int] = {
    "12.4.4": 42,
}

# What a check of the queries against Prometheus substitutes for Grafana's variables: every
# value of a template variable, and a rate window a few scrape intervals (5 s) long.
ALL_VALUES = ".+"
BUILTINS = {"__rate_interval": "1m", "__interval": "15s", "__range": "5m", "__interval_ms": "15000",
            "__range_s": "300", "__range_ms": "300000"}


def grafana_dir() -> Traversable:
    """policyloop/telemetry/grafana: dashboards/ and provisioning/ as compose mounts them."""
    return resources.files("policyloop.telemetry").joinpath("grafana")


def load_dashboard() -> dict[str, Any]:
    return json.loads(grafana_dir().joinpath("dashboards", "policyloop.json").read_text())


@dataclass(frozen=True)
class PanelQuery:
    """One query of one panel: where it is (its row's title, the panel's) and its PromQL."""

    row: str
    panel: str
    panel_id: int
    ref_id: str
    expr: str

    @property
    def where(self) -> str:
        return f"{self.row} / {self.panel} [{self.ref_id}]"


def walk_panels(dashboard: Mapping[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(row title, panel) for every panel, rows included (title "" before the first row). An
    expanded row's panels follow it in the top-level list; a collapsed row holds them in its own."""
    row = ""
    for panel in dashboard.get("panels", []):
        if panel.get("type") == "row":
            row = panel.get("title", "")
        yield row, panel
        for inner in panel.get("panels", []):
            yield row, inner


def dashboard_queries(dashboard: Mapping[str, Any]) -> list[PanelQuery]:
    """Every target's PromQL, in dashboard order (targets without an expr are left out; the
    structural test requires one on each)."""
    return [PanelQuery(row, panel.get("title", ""), panel.get("id", 0), target.get("refId", ""), target["expr"])
            for row, panel in walk_panels(dashboard) for target in panel.get("targets", []) if target.get("expr")]


def template_variables(dashboard: Mapping[str, Any]) -> list[str]:
    return [variable["name"] for variable in dashboard.get("templating", {}).get("list", [])]


# Grafana's variable syntaxes: ${name}, ${name:format}, [[name]], $name. Names start with a letter
# or an underscore, so that label_replace's $1 is no reference.
_NAME = r"[A-Za-z_]\w*"
_REFERENCE = re.compile(rf"\$\{{({_NAME})(?::[^}}]*)?\}}|\[\[({_NAME})(?::[^\]]*)?\]\]|\$({_NAME})")


def substitute(expr: str, variables: Mapping[str, str], builtins: Mapping[str, str] = BUILTINS) -> str:
    """`expr` with Grafana's variable references replaced, in each of its syntaxes: `$name`,
    `${name}`, `${name:format}` and `[[name]]`. A reference to an unknown name is an error: the
    query would reach Prometheus with a `$` in it."""
    values = {**builtins, **variables}

    def replace(match: re.Match[str]) -> str:
        name = next(group for group in match.groups() if group)
        if name not in values:
            raise KeyError(f"{match.group(0)} in {expr!r}: no value for it")
        return values[name]

    return _REFERENCE.sub(replace, expr)


def runnable_queries(dashboard: Mapping[str, Any], value: str = ALL_VALUES,
                     builtins: Mapping[str, str] = BUILTINS) -> list[tuple[PanelQuery, str]]:
    """Every panel query with each template variable set to `value` (all of them, by default)."""
    variables = {name: value for name in template_variables(dashboard)}
    return [(query, substitute(query.expr, variables, builtins)) for query in dashboard_queries(dashboard)]
