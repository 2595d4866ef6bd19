"""The Grafana dashboard shipped in policyloop/telemetry/grafana: written in the dashboard schema
of the Grafana release compose.yaml and deploy/k8s pin, every panel on the provisioned
Prometheus datasource with a query, one row per ledger figure and per service, every query valid
PromQL over metrics the services define. (That every query returns data from a real cluster's
Prometheus is checked in tests/e2e/test_protos_client.py.)"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.metrics import MetricWrapperBase

import policyloop.telemetry.metrics as metrics
from policyloop.cluster.catalogue import SERVICE_NAMES
from policyloop.telemetry.dashboard import (
    DASHBOARD_UID,
    DATASOURCE_UID,
    GRAFANA_SCHEMA_VERSIONS,
    PanelQuery,
    dashboard_queries,
    grafana_dir,
    load_dashboard,
    runnable_queries,
    substitute,
    walk_panels,
)

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = load_dashboard()

# The ledger's figures (issue 18), each a row, in this order, and what its queries must read.
LEDGER_ROWS = {
    "Generated tokens per second": ["policyloop_generated_tokens_total"],
    "Learner tokens per update": ["policyloop_learner_tokens_total", "policyloop_learner_step_seconds_count"],
    "Backlog per stream and its change": ['policyloop_bus_backlog_messages{kind="pending"', "deriv("],
    "Version lag": ["policyloop_version_lag_bucket", "policyloop_learner_samples_at_lag_bound_total"],
    "KL and entropy": ['stat="kl_behaviour"', 'stat="kl_reference"', 'stat="entropy"'],
    "Reward per environment": ["policyloop_reward_bucket", "policyloop_reward_points", "policyloop_reward_count"],
    "Publish latency": ["policyloop_weights_step_to_serving_seconds_bucket", "policyloop_weight_sync_seconds_bucket"],
    "Drops, delays and dead letters": ["policyloop_learner_dropped_total", "policyloop_rollout_resubmits_total",
                                       "policyloop_bus_dead_lettered_total"],
}
# Each service's row: health (up and /healthz) for all; what is its own. Gateway, reward,
# sandbox, tinker and evaluator hold no policy version (they never set policyloop_policy_version).
HOLDS_A_VERSION = {"rollout", "learner", "publisher"}
SERVICE_ROWS = {
    "gateway": ['policyloop_grpc_requests_total{service="gateway"',
                'policyloop_grpc_request_seconds_bucket{service="gateway"'],
    "rollout": ['policyloop_engine_load{figure="queued_requests"', 'policyloop_engine_load{figure="kv_usage"',
                'policyloop_weight_sync_seconds_bucket{service="rollout"'],
    "reward": ['policyloop_reward_count{service="reward"', 'policyloop_bus_consumed_total{service="reward"'],
    "sandbox": ['policyloop_sandbox_jobs_total{service="sandbox"',
                'policyloop_sandbox_job_seconds_bucket{service="sandbox"'],
    "learner": ['policyloop_learner_step_seconds_bucket{service="learner"', "policyloop_learner_step_stat"],
    "publisher": ['policyloop_grpc_requests_total{service="publisher"', "policyloop_weights_quarantined_total"],
    "tinker": ['policyloop_bus_published_total{service="tinker"'],
    "evaluator": ['policyloop_bus_published_total{service="evaluator"'],
}


def grafana_pins() -> dict[str, str]:
    """Where the Grafana image is pinned → its tag."""
    compose = yaml.safe_load((REPO / "compose.yaml").read_text())["services"]["grafana"]["image"]
    default = re.fullmatch(r"\$\{GRAFANA_IMAGE:-([^}]+)\}", compose)
    assert default, compose
    k8s = [c["image"] for doc in yaml.safe_load_all((REPO / "deploy" / "k8s" / "base" / "grafana.yaml").read_text())
           if doc["kind"] == "Deployment" for c in doc["spec"]["template"]["spec"]["containers"]]
    pins = {"compose.yaml": default.group(1), **{f"deploy/k8s/base/grafana.yaml[{i}]": image
                                                 for i, image in enumerate(k8s)}}
    for where, image in pins.items():
        repository, _, tag = image.rpartition(":")
        assert repository == "grafana/grafana" and tag, f"{where}: {image}"
    return {where: image.rpartition(":")[2] for where, image in pins.items()}


def test_the_schema_version_is_the_pinned_grafana_releases() -> None:
    tags = set(grafana_pins().values())
    assert len(tags) == 1, f"compose.yaml and deploy/k8s pin different Grafana releases: {grafana_pins()}"
    [tag] = tags
    assert tag in GRAFANA_SCHEMA_VERSIONS, (
        f"Grafana {tag} is not in policyloop.telemetry.dashboard.GRAFANA_SCHEMA_VERSIONS: look up "
        "DASHBOARD_SCHEMA_VERSION in that release's DashboardMigrator.ts and add it")
    assert DASHBOARD["schemaVersion"] == GRAFANA_SCHEMA_VERSIONS[tag]


def _is_row(panel: dict[str, Any]) -> bool:
    return panel.get("type") == "row"


def test_every_panel_queries_the_provisioned_datasource() -> None:
    assert DASHBOARD["uid"] == DASHBOARD_UID
    panels = [p for _, p in walk_panels(DASHBOARD) if not _is_row(p)]
    assert panels
    for panel in panels:
        where = f"panel {panel.get('id')} {panel.get('title')!r}"
        assert panel["datasource"] == {"type": "prometheus", "uid": DATASOURCE_UID}, where
        assert panel.get("targets"), f"{where} has no query"
        for target in panel["targets"]:
            assert target.get("expr", "").strip(), f"{where} [{target.get('refId')}] has no expr"
            assert target.get("datasource", panel["datasource"]) == panel["datasource"], where
        assert len({t["refId"] for t in panel["targets"]}) == len(panel["targets"]), where
    for variable in DASHBOARD["templating"]["list"]:
        assert variable["datasource"]["uid"] == DATASOURCE_UID, variable["name"]


def test_panel_ids_are_unique_and_panels_fit_the_grid() -> None:
    everything = [p for _, p in walk_panels(DASHBOARD)]
    ids = [p["id"] for p in everything]
    assert len(ids) == len(set(ids)), sorted(i for i in ids if ids.count(i) > 1)
    for panel in everything:
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["w"] > 0 and grid["x"] + grid["w"] <= 24, panel["title"]


def _rows() -> dict[str, list[PanelQuery]]:
    rows: dict[str, list[PanelQuery]] = {}
    for panel in DASHBOARD["panels"]:
        if _is_row(panel):
            rows[panel["title"]] = []
    for query in dashboard_queries(DASHBOARD):
        rows[query.row].append(query)
    return rows


def test_one_row_per_ledger_figure_then_one_per_service() -> None:
    rows = _rows()
    assert list(rows) == [*LEDGER_ROWS, *(f"Service: {name}" for name in SERVICE_NAMES)]
    assert set(SERVICE_ROWS) == set(SERVICE_NAMES)
    for title, needed in LEDGER_ROWS.items():
        exprs = " ".join(q.expr for q in rows[title])
        missing = [n for n in needed if n not in exprs]
        assert not missing, f"row {title!r} does not read {missing}"
    for name, needed in SERVICE_ROWS.items():
        exprs = " ".join(q.expr for q in rows[f"Service: {name}"])
        needed = [*needed, f'up{{job="policyloop", service="{name}"', f'policyloop_service_healthy{{service="{name}"']
        if name in HOLDS_A_VERSION:
            needed.append(f'policyloop_policy_version{{service="{name}"')
        missing = [n for n in needed if n not in exprs]
        assert not missing, f"row of {name} does not read {missing}"


def _defined_series() -> set[str]:
    names = set()
    for value in vars(metrics).values():
        if isinstance(value, MetricWrapperBase):
            suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_count", "_sum"]}.get(value._type, [""])
            names |= {value._name + suffix for suffix in suffixes}
    return names


def test_every_metric_queried_is_one_the_services_define() -> None:
    defined = _defined_series()
    used = {name for q in dashboard_queries(DASHBOARD) for name in re.findall(r"\bpolicyloop_\w+", q.expr)}
    assert used and not used - defined, sorted(used - defined)
    assert used >= {"policyloop_generated_tokens_total", "policyloop_version_lag_bucket"}


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not installed (Debian package prometheus)")
def test_every_query_is_valid_promql(tmp_path: Path) -> None:
    """promtool parses each query (template variables substituted) as a recording rule's expr."""
    queries = runnable_queries(DASHBOARD)
    assert not [expr for _, expr in queries if "$" in expr]
    rules = {"groups": [{"name": "dashboard", "rules": [{"record": f"dashboard:query_{i}", "expr": expr}
                                                         for i, (_, expr) in enumerate(queries)]}]}
    path = tmp_path / "dashboard_rules.yml"
    path.write_text(yaml.safe_dump(rules))
    result = subprocess.run(["promtool", "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_provisioning_names_the_datasource_the_panels_use() -> None:
    [datasource] = yaml.safe_load(grafana_dir().joinpath("provisioning", "datasources", "policyloop.yml")
                                  .read_text())["datasources"]
    assert datasource["uid"] == DATASOURCE_UID and datasource["type"] == "prometheus"
    assert datasource["url"] == "http://prometheus:9090"
    [provider] = yaml.safe_load(grafana_dir().joinpath("provisioning", "dashboards", "policyloop.yml")
                                .read_text())["providers"]
    assert provider["type"] == "file" and provider["options"]["path"] == "/etc/grafana/dashboards/policyloop"


# --- the library -----------------------------------------------------------------------------------

def test_substitute_replaces_each_variable_syntax_and_the_builtin_intervals() -> None:
    variables = {"instance": ".+", "env": "a|b"}
    builtins = {"__rate_interval": "1m", "__range": "5m"}
    expr = 'rate(x{instance=~"$instance", e=~"${env}", f=~"${env:regex}", g=~"[[instance]]"}[$__rate_interval])'
    assert substitute(expr, variables, builtins) == 'rate(x{instance=~".+", e=~"a|b", f=~"a|b", g=~".+"}[1m])'
    assert substitute("increase(x[$__range])", {}, builtins) == "increase(x[5m])"
    # label_replace's $1 is no variable reference; an unknown name is an error, not a silent `$`.
    assert substitute('label_replace(x, "a", "$1", "b", "(.*)")', {}, builtins) == \
        'label_replace(x, "a", "$1", "b", "(.*)")'
    with pytest.raises(KeyError, match=r"\$instanc"):
        substitute('x{instance=~"$instanc"}', variables, builtins)


def test_queries_are_found_in_expanded_and_collapsed_rows() -> None:
    def panel(pid: int, *exprs: str) -> dict[str, Any]:
        return {"id": pid, "type": "timeseries", "title": f"p{pid}",
                "targets": [{"refId": chr(65 + i), "expr": e} for i, e in enumerate(exprs)]}

    dashboard = {
        "templating": {"list": [{"name": "instance"}]},
        "panels": [
            panel(1, "up"),
            {"id": 2, "type": "row", "title": "open", "collapsed": False, "panels": []},
            panel(3, 'a{instance=~"$instance"}', "b"),
            {"id": 4, "type": "row", "title": "closed", "collapsed": True,
             "panels": [panel(5, "rate(c[$__rate_interval])"), {"id": 6, "type": "text", "title": "note"}]},
        ],
    }
    found = [(q.row, q.panel, q.ref_id, q.expr) for q in dashboard_queries(dashboard)]
    assert found == [("", "p1", "A", "up"), ("open", "p3", "A", 'a{instance=~"$instance"}'), ("open", "p3", "B", "b"),
                     ("closed", "p5", "A", "rate(c[$__rate_interval])")]
    assert [expr for _, expr in runnable_queries(dashboard)] == ["up", 'a{instance=~".+"}', "b", "rate(c[1m])"]
